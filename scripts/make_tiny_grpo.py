#!/usr/bin/env python3
"""Make data/tiny/count_prompts.jsonl, the prompts of configs/experiments/tiny-grpo.yaml: for each word of
the tiny corpus's section topics (data/tiny/python_docs.jsonl), a prompt asking how many letters it has and
its answer, the count (one digit): a verifiable task whose answer a regular expression reads off the
completion. In a fixed shuffled order. Deterministic; nothing is downloaded. With --chat, the same as chat
prompts (a user message asking to think in <think></think> first) in data/tiny/count_chat_prompts.jsonl, for
configs/experiments/tiny-grpo-trl.yaml.

    python scripts/make_tiny_grpo.py [--chat] [--out data/tiny/count_prompts.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chat", action="store_true", help="chat prompts (count_chat_prompts.jsonl)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    a.out = a.out or str(
        ROOT / "data" / "tiny" / ("count_chat_prompts.jsonl" if a.chat else "count_prompts.jsonl")
    )
    topics = [
        json.loads(x)["topic"]
        for x in (ROOT / "data" / "tiny" / "python_docs.jsonl").read_text().splitlines()
    ]
    words = sorted(
        {w for t in topics for w in t.replace("-", " ").split() if w.isalpha() and 1 <= len(w) <= 9}
    )
    rows = [{"prompt": f"How many letters are in '{w}'? Answer:", "answer": str(len(w))} for w in words]
    if a.chat:
        ask = "How many letters are in '{}'? Think in <think></think> first, then answer."
        rows = [
            {"prompt": [{"role": "user", "content": ask.format(w)}], "answer": str(len(w))} for w in words
        ]
    random.Random(0).shuffle(rows)
    Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
