"""The built-in `answer` reward (train.rl.rewards; docs/rl.md): reading a completion's final answer and
comparing it with the row's.

The answer read: the last match of `pattern` (its first group if it has one) where one is given; by default
the last `\\boxed{...}` (braces balanced), else the last GSM8K `#### x`, else the last number (thousands
separators kept within it: "1,234"; a comma or full stop after it is punctuation: "42," and "42." read 42; a
leading dot is a decimal: ".5"; Unicode's minus (U+2212) a sign; a fraction one number: "1/2").
The expected value is the row's `column`; a GSM8K solution (text ending `#### x`) is read after its `####`.
Both are normalised before a string comparison: spaces and trailing punctuation (. , ; : ! ?) stripped, a
number's thousands separators and a `$` before it dropped, its minus made ASCII's and a leading dot's zero
written (".5" = "0.5"). With `numeric: true` both are read as numbers (a fraction as its value) and compared
within `tolerance`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from trainer.common.errors import UserError

# a number: a sign (ASCII's or Unicode's minus), thousands groups of three after a comma ("1,234,567") or plain
# digits, a decimal part (".5": a leading dot), a fraction's denominator ("1/2": one number, not two)
MINUS = "-\u2212"
DIGITS = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
NUMERIC = rf"[{MINUS}]?{DIGITS}(?:/\d+)?"
NUMBER = rf"{NUMERIC}(?![\d,]*\d)"
GSM8K = re.compile(r"####\s*(.+?)\s*$", re.S)
TRAILING = ".,;:!? \t\n"


def text_of(completion: Any) -> str:
    """A completion's text: the string, or a chat completion's message content (TRL's conversational form)."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), its braces balanced; None without one."""
    at = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if at < 0:
        return None
    start = text.index("{", at) + 1
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None  # unclosed: no answer


def extract(text: str, pattern: str | None = None) -> str | None:
    """The completion's answer (see the module's doc), None where it has none."""
    if pattern is not None:
        found = [m.group(1) if m.groups() else m.group(0) for m in re.finditer(pattern, text)]
        return found[-1] if found else None
    inside = boxed(text)
    if inside is not None:
        return inside
    marked = re.findall(r"####\s*([^\n]+)", text)
    if marked:
        return marked[-1]
    numbers = re.findall(NUMBER, text)
    return numbers[-1] if numbers else None


def expected_of(value: Any) -> str:
    """The row's answer: a GSM8K solution's after its ####, else the value as a string."""
    text = str(value)
    m = GSM8K.search(text)
    return m.group(1) if m else text


def normalise(text: str) -> str:
    """Spaces and trailing punctuation stripped; a number's thousands separators and leading $ dropped, its
    minus ASCII's, a leading dot's zero written (".5": "0.5")."""
    text = text.strip().rstrip(TRAILING).strip()
    plain = text.removeprefix("$").strip()
    if re.fullmatch(NUMERIC, plain):
        plain = plain.replace(",", "").replace("\u2212", "-")
        return re.sub(r"(^|-|/)\.", r"\g<1>0.", plain)
    return text


def as_number(text: str) -> float | None:
    """The number a text is (a fraction's value), None where it is none."""
    plain = normalise(text).removeprefix("$").replace(",", "")
    numerator, slash, denominator = plain.partition("/")
    try:
        value = float(numerator)
        return value / float(denominator) if slash else value
    except (ValueError, ZeroDivisionError):
        return None


def answer(prompts: Sequence[Any], completions: Sequence[Any], *, column: str = "answer", pattern: str | None = None,
           numeric: bool = False, tolerance: float = 0.0, **columns: Any) -> list[float | None]:  # fmt: skip
    """1.0 where the completion's answer equals the row's `column` (see the module's doc)."""
    if column not in columns:
        raise UserError(f"train.rl.rewards: answer reads the column '{column}', which the data does not have; "
                        f"its columns: {', '.join(sorted(k for k in columns if k not in GIVEN)) or 'none'} "
                        "(set options.column)")  # fmt: skip
    out: list[float | None] = []
    for c, expected in zip(completions, columns[column], strict=True):
        if expected is None:
            out.append(None)
            continue
        got = extract(text_of(c), pattern)
        if got is None:
            out.append(0.0)
        elif numeric:
            a, b = as_number(got), as_number(expected_of(expected))
            out.append(1.0 if a is not None and b is not None and abs(a - b) <= tolerance else 0.0)
        else:
            out.append(1.0 if normalise(got) == normalise(expected_of(expected)) else 0.0)
    return out


GIVEN = ("trainer_state", "log_extra", "log_metric", "completion_ids")
