#!/usr/bin/env python3
"""Make data/tiny/python_qa.jsonl, the instruction set of configs/experiments/tiny-sft.yaml, from the
tiny corpus on this machine (data/tiny/python_docs.jsonl, the Python language reference): for each
section, a user asks in three ways which section covers its topic and the assistant answers with the
section's title ('The "assert" statement'); and for its first prose paragraphs, what the reference
says about the topic, answered with the paragraph's first sentence (short ones only). Short answers a
0.86M-parameter model can learn to give, and to end. Deterministic; nothing is downloaded.

    python scripts/make_tiny_sft.py [--out data/tiny/python_qa.jsonl]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TITLE_QUESTIONS = (
    "Which section covers {topic}?",
    "Where do I read about {topic}?",
    "Name the section on {topic}.",
)
QUESTIONS = ("What does the Python reference say about {topic}?", "Explain {topic}.")


def sections() -> list[tuple[str, str, str]]:
    """(topic, title, text) of each section of the tiny corpus, in its order."""
    docs = [
        json.loads(line) for line in (ROOT / "data" / "tiny" / "python_docs.jsonl").read_text().splitlines()
    ]
    return [(d["topic"], d["text"].split("\n", 1)[0].strip(), d["text"]) for d in docs]


def first_sentence(paragraph: str, limit: int = 80) -> str | None:
    text = " ".join(paragraph.split())
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    if not m:
        return None
    s = m.group(1)
    if len(s) < 30 or len(s) > limit or s.startswith(("*", "=", "-", ">>>", "...")):
        return None
    return s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "data" / "tiny" / "python_qa.jsonl"))
    a = p.parse_args()
    rows = []
    for topic, title, text in sections():
        for q in TITLE_QUESTIONS:
            rows.append({"messages": [{"role": "user", "content": q.format(topic=topic)},
                                      {"role": "assistant", "content": title}]})  # fmt: skip
        paragraphs = [x for x in text.split("\n\n") if x and not x.startswith((" ", "*"))]
        answers = [s for s in (first_sentence(x) for x in paragraphs) if s]
        for k, answer in enumerate(answers[:2]):
            question = QUESTIONS[k % len(QUESTIONS)].format(topic=topic)
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
    Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(
        f"{len(rows)} conversations from {sum(1 for _ in (ROOT / 'data' / 'tiny' / 'python_docs.jsonl').open())} sections -> {a.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
