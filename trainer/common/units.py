"""Sizes in bytes: parsed from what people write ('80GB', '24GiB', '512M', 1e9), printed for people."""

from __future__ import annotations

import re
from typing import Any

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(value: Any) -> int | None:
    """'80GB', '80GiB', '512M', 1e9 -> bytes. GB means 2**30 here, as in DeepSpeed's estimators
    and nvidia-smi (an '80GB' H100 reports about 80 GiB)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, float):
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError("must be a size such as 80GB, 24GiB, 512MB or a number of bytes")
    scale = 1024 ** "_kmgtp".index(m.group(2).lower() or "_")
    return int(float(m.group(1)) * scale)


def format_size(n: float) -> str:
    for unit, scale in (("TB", 2**40), ("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
