"""Rewrite the configuration reference in README.md from the schema (`bin/train --describe-config`)."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer.cli import describe_config  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def block() -> str:
    return f"{START}\n```\n{describe_config()}\n```\n{END}"


if __name__ == "__main__":
    text = README.read_text()
    new = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block(), text, flags=re.S)
    README.write_text(new)
    print("README.md reference updated" if new != text else "README.md reference already current")
