"""Fixtures shared by the dist tests.

Under pytest-xdist every worker is its own pytest session, so a session fixture would run once per
worker. The expensive ones here (the data file, the run A of each ZeRO case) are made once per test
session instead: in a directory all workers share, by the first worker that asks, under a file
lock; the others wait for it and read its result from disk.
"""

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import CASE_SETS, CASES, PRECISIONS, ROOT, Result, resume_sets, train

from trainer.common.files import file_lock


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory, worker_id):
    """A directory every xdist worker of this test session sees (the session's own base under plain pytest)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if worker_id != "master" else base


@pytest.fixture(scope="session")
def small_data(shared_dir):
    """About 60 sequences of 128 tokens: an epoch is 7 micro steps of 2 ranks x 4."""
    path = shared_dir / "small-data" / "small.jsonl"
    with file_lock(shared_dir / "small-data.lock"):
        if not path.exists():
            docs, size = [], 0
            for line in (ROOT / "data" / "tiny" / "python_docs.jsonl").read_text().splitlines():
                text = json.loads(line)["text"]
                if size + len(text) <= 60 * 128:
                    docs.append(line)
                    size += len(text) + 1
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(docs) + "\n")
    return path


@pytest.fixture(scope="session")
def runs(shared_dir, small_data):
    """Run A per ZeRO case (helpers.CASES), launcher and precision: 2K steps on small_data with a
    checkpoint every K. Made once per test session and shared by the test files that ask for it
    (fp32: test_stages.py, test_kills.py; bf16: test_bf16_*.py). bf16 runs train without dropout
    (see helpers.PRECISIONS)."""
    cache: dict[str, Result] = {}

    def get(name: str, launcher: str = "torchrun", precision: str = "fp32") -> Result:
        key = f"A-{name}-{launcher}{'' if precision == 'fp32' else '-' + precision}".replace("+", "_")
        if key not in cache:
            tmp = shared_dir / key
            done = tmp / "result.json"
            with file_lock(shared_dir / f"{key}.lock"):
                if done.exists():
                    d = json.loads(done.read_text())
                    cache[key] = Result(
                        **{**d, "run_dir": Path(d["run_dir"]), "debug_dir": d["debug_dir"] and Path(d["debug_dir"])}
                    )
                else:
                    stage, accum, offload = CASES[name]
                    extra = {"strategy.offload": offload} if offload != "none" else {}
                    extra.update(CASE_SETS.get(name, {}))
                    sets = resume_sets(small_data, stage, accum, **extra, **PRECISIONS[precision])
                    r = train(tmp, sets, launcher=launcher)
                    done.write_text(json.dumps(dataclasses.asdict(r), default=str))
                    cache[key] = r
        return cache[key]

    return get
