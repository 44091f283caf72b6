"""Field types of the experiment schema: choices, sizes, globs, read-only mappings, and the base
of every section (unknown keys are errors, the tree is immutable)."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, PlainSerializer

from trainer.common.units import parse_size


def choice(*allowed: Any) -> Any:
    """A field that takes exactly one of `allowed` (type-exact: True is not 1)."""
    shown = ", ".join(_show(a) for a in allowed)

    def check(value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip()
            lowered = value.lower()
            for a in allowed:
                if isinstance(a, str) and a == lowered:
                    return a
        for a in allowed:
            if type(value) is type(a) and value == a:
                return a
        raise ValueError(f"must be one of: {shown}")

    check.allowed = shown.replace(", ", "|")  # type: ignore[attr-defined]  (for the reference)
    return Annotated[Any, BeforeValidator(check)]


def auto_or(number: type, what: str) -> Any:
    """A field that takes "auto" or a `number` >= 0 (int or float; a float field takes an int as
    float); `what` names the number in the error."""
    accepted = (int, float) if number is float else (int,)

    def check(value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, accepted) and not isinstance(value, bool) and value >= 0:
            return number(value)
        raise ValueError(f"must be auto or {what} >= 0")

    check.allowed = f"auto|{number.__name__}"  # type: ignore[attr-defined]  (for the reference)
    return Annotated[Any, BeforeValidator(check)]


def auto_or_count(what: str) -> Any:
    """A field that takes "auto" or an integer >= 1; `what` names the number in the error."""

    def check(value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        raise ValueError(f"must be auto or {what} >= 1")

    check.allowed = "auto|int"  # type: ignore[attr-defined]  (for the reference)
    return Annotated[Any, BeforeValidator(check)]


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _freeze(value: Any) -> Any:
    """Deeply read-only view of YAML mappings/lists, so the config tree is immutable."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """A plain, mutable deep copy of a frozen mapping (to hand to libraries)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


FrozenMapping = Annotated[Mapping[str, Any], AfterValidator(_freeze), PlainSerializer(lambda v: thaw(v))]
Size = Annotated[int | None, BeforeValidator(parse_size)]
Globs = Annotated[list[str], BeforeValidator(_as_list)]
AutoBool = choice("auto", True, False)


class Section(BaseModel):
    """Base of every section: unknown keys are errors and the tree is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, validate_by_name=True)


def keys(model: type[BaseModel]) -> dict[str, Any]:
    """A section's YAML keys and their fields: the field's alias where it has one (a key that is a
    Python keyword, `checkpoint.async`, is the field `async_`), else its name."""
    return {info.alias or name: info for name, info in model.model_fields.items()}


# ----------------------------------------------------------------------------- annotations


def _unwrap(annotation: Any) -> list[Any]:
    """The member types of Optional/Union/Annotated annotations."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _unwrap(a)]
    return [annotation]


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for member in _unwrap(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _is_mapping(annotation: Any) -> bool:
    return any(typing.get_origin(m) in (Mapping, dict) or m in (dict, Mapping) for m in _unwrap(annotation))


def _is_str(annotation: Any) -> bool:
    members = [m for m in _unwrap(annotation) if m is not type(None)]
    return bool(members) and all(m is str for m in members)
