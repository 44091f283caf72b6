#!/usr/bin/env python3
"""Make data/tiny/python_feedback.jsonl, the unpaired rows of configs/experiments/tiny-kto.yaml, from tiny-dpo's
pairs (data/tiny/python_prefs.jsonl): each pair's chosen response a row labelled true, its rejected one a row
labelled false (TRL's unpaired preference format: prompt, completion, label), shuffled with seed 0.

    python scripts/make_tiny_kto.py [--out data/tiny/python_feedback.jsonl]
"""

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "data" / "tiny" / "python_feedback.jsonl"))
    args = p.parse_args()
    rows = []
    for line in (ROOT / "data" / "tiny" / "python_prefs.jsonl").read_text().splitlines():
        pair = json.loads(line)
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    random.Random(0).shuffle(rows)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
