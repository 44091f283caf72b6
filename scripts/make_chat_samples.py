#!/usr/bin/env python3
"""Make data/chat/tools.jsonl, the data of configs/experiments/qwen3-chat.yaml, and the chat data of
the fine-tuning tests (tests/helpers.py: real_chat_data): OpenAI-style conversations of 1-3
exchanges, a system prompt in every other one, questions with fixed answers, and every third one a
tool call (the assistant's `tool_calls`, the tool's result, the answer; the schemas in a `tools`
column). Deterministic; nothing is downloaded.

    python scripts/make_chat_samples.py [--out data/chat/tools.jsonl] [--rows 60]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
ANSWERS = {
    "What is the capital of France?": "Paris.", "Name a prime number.": "Seven.",
    "How many legs has a spider?": "Eight.", "What colour is the sky?": "Blue.", "Say hello.": "Hello!",
    "What is 2 + 2?": "Four.", "Spell cat.": "C, A, T.", "Which is larger, 3 or 5?": "Five.",
}  # fmt: skip


def conversations(rows: int = 60, system: bool = True, tools: bool = False, seed: int = 0,
                  random_users: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """The rows: {"messages": [...]} (and "tools" for the tool calls). `random_users`: user turns of
    random letters, every answer "Noted." (nothing to learn from the prompts)."""
    r = random.Random(seed)
    out = []
    for i in range(rows):
        msgs: list[dict[str, Any]] = (
            [{"role": "system", "content": "You answer in one word."}] if system and i % 2 else []
        )
        row: dict[str, Any] = {}
        if tools and i % 3 == 0:
            city = r.choice(["Paris", "Lima", "Oslo", "Cairo"])
            call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
            msgs += [{"role": "user", "content": f"What is the weather in {city}?"},
                     {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": f"sunny in {city}"},
                     {"role": "assistant", "content": f"It is sunny in {city}."}]  # fmt: skip
            row["tools"] = WEATHER
        else:
            for _ in range(1 + i % 3):
                if random_users:
                    letters = "abcdefghijklmnopqrstuvwxyz"
                    words = (
                        "".join(r.choice(letters) for _ in range(r.randint(3, 7)))
                        for _ in range(r.randint(5, 10))
                    )
                    q, a = " ".join(words), "Noted."
                else:
                    q = r.choice(list(ANSWERS))
                    a = ANSWERS[q]
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"messages": msgs, **row})
    return out


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "data" / "chat" / "tools.jsonl"))
    ap.add_argument("--rows", type=int, default=60)
    a = ap.parse_args()
    print(f"{write(Path(a.out), conversations(a.rows, tools=True))}: {a.rows} conversations")


if __name__ == "__main__":
    main()
