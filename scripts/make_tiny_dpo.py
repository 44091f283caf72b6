#!/usr/bin/env python3
"""Make data/tiny/python_prefs.jsonl, the preference pairs of configs/experiments/tiny-dpo.yaml, from
the tiny corpus on this machine (data/tiny/python_docs.jsonl, the Python language reference), as
scripts/make_tiny_sft.py makes tiny-sft's questions: for each section, a user asks in three ways which
section covers its topic; the chosen answer is the section's title ('The "assert" statement'), the
rejected one the title of another section (the next two in the corpus, one per question in turn).
Conversational (TRL's form: a prompt of messages, each response an assistant message), in a fixed
shuffled order. Deterministic;
nothing is downloaded.

    python scripts/make_tiny_dpo.py [--out data/tiny/python_prefs.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from make_tiny_sft import ROOT, TITLE_QUESTIONS, sections


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "data" / "tiny" / "python_prefs.jsonl"))
    a = p.parse_args()
    docs = sections()
    titles = [title for _, title, _ in docs]
    rows = []
    for i, (topic, _, _) in enumerate(docs):
        for k, q in enumerate(TITLE_QUESTIONS):
            wrong = titles[(i + 1 + k % 2) % len(titles)]
            if wrong == titles[i]:
                continue
            rows.append({
                "prompt": [{"role": "user", "content": q.format(topic=topic)}],
                "chosen": [{"role": "assistant", "content": titles[i]}],
                "rejected": [{"role": "assistant", "content": wrong}],
            })  # fmt: skip
    # a fixed shuffle: data.eval_fraction holds out the file's tail, which should not be the last
    # sections alone (their titles are rejected answers of the sections before them)
    random.Random(0).shuffle(rows)
    Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} pairs from {len(docs)} sections -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
