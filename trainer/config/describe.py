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
