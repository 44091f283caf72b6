"""Fixtures shared by the dist tests."""

import json

import pytest
from helpers import ROOT


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """About 60 sequences of 128 tokens: an epoch is 7 micro steps of 2 ranks x 4."""
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    docs, size = [], 0
    for line in (ROOT / "data" / "tiny" / "python_docs.jsonl").read_text().splitlines():
        text = json.loads(line)["text"]
        if size + len(text) <= 60 * 128:
            docs.append(line)
            size += len(text) + 1
    path.write_text("\n".join(docs) + "\n")
    return path
