"""The config reference: every field of the schema as (key, type, default, meaning) rows, for
`bin/train --describe-config` and docs/reference.md (scripts/update_reference.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from trainer.config.fields import _model_of, _show, _unwrap, keys, thaw
from trainer.config.schema import Experiment


def describe(model: type[BaseModel] = Experiment, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every field: the config reference."""
    rows = []
    for name, info in keys(model).items():
        key = f"{prefix}{name}"
        sub = _model_of(info.annotation)
        if sub is not None and _model_of(info.annotation) is not None and name != "config":
            rows.append((key, "section", "", info.description or ""))
            rows += describe(sub, key + ".")
            continue
        if info.is_required():
            default = "required"
        elif info.default_factory is not None:
            default = _show(thaw(info.default_factory()))
        else:
            default = _show(info.default)
        rows.append((key, _type_name(info), default, info.description or ""))
    return rows


def _type_name(info: Any) -> str:
    for meta in info.metadata:
        allowed = getattr(getattr(meta, "func", None), "allowed", None)
        if allowed:
            return allowed
    annotation = info.annotation
    members = [m for m in _unwrap(annotation) if m is not type(None)]
    names = []
    for m in members:
        names.append(getattr(m, "__name__", str(m)).replace("typing.", ""))
    return " | ".join(names) + (" | null" if type(None) in _unwrap(annotation) else "")


def describe_table() -> str:
    """`bin/train --describe-config`: every key, its type, default and meaning, by section."""
    rows = describe()
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{'key'.ljust(w[0])}  {'type'.ljust(w[1])}  {'default'.ljust(w[2])}  meaning"]
    for key, typ, default, desc in rows:
        if typ == "section":
            lines.append(f"\n{key}:  {desc}")
        else:
            lines.append(f"{key.ljust(w[0])}  {typ.ljust(w[1])}  {default.ljust(w[2])}  {desc}")
    return "\n".join(lines)
