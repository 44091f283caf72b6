"""Loading an experiment: YAML (with the line of every key) -> `--set` overrides (each parsed by the
type of the field it names) -> validation of each section on its own, then the rules between
sections (`rules.py`). Every problem is collected and reported at once, each naming the file, the
line, the key path, what was found and what is allowed."""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer.common.errors import ConfigError, Problem, UserError, did_you_mean
from trainer.config.fields import _is_mapping, _is_str, _model_of, keys
from trainer.config.rules import contradictions, line_for
from trainer.config.schema import Experiment


def load(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> Experiment:
    """Read, override and validate an experiment file; raise ConfigError with every problem."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise UserError(
            f"experiment file {source} does not exist (looked in {Path(path).resolve().parent}); "
            "pass the path of a YAML file, e.g. configs/experiments/tiny.yaml"
        ) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read experiment file {source}: {e}") from None
    raw, lines = parse_yaml(text, source)
    problems = list(lines.pop(DUPLICATES, []))  # type: ignore[arg-type]
    for override in overrides:
        problems += apply_override(raw, override, lines)
    return validate(raw, source=source, lines=lines, problems=problems)


DUPLICATES = ("<duplicates>",)


def parse_yaml(text: str, source: str) -> tuple[dict[str, Any], dict[tuple, int | str]]:
    """YAML -> (dict, line of every key path). Syntax errors and duplicate keys carry the line."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        what = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        msg = f"invalid YAML: {what}" + (f" ({context})" if context else "")
        raise ConfigError(source, [Problem("", msg + "; fix the syntax at this line", line)]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            source, [Problem("", "the file must be a YAML mapping of sections (model:, data:, ...)", 1)]
        )
    lines: dict[tuple, int | str] = {}
    dups: list[Problem] = []
    _walk_lines(node, (), lines, dups)
    if dups:
        lines[DUPLICATES] = dups  # type: ignore[assignment]  (reported with the other problems)
    return raw, lines


def _walk_lines(
    node: yaml.Node | None, path: tuple, lines: dict[tuple, int | str], dups: list[Problem]
) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            child = (*path, key)
            if key in seen:
                dups.append(
                    Problem(
                        ".".join(map(str, child)), "duplicate key; keep one", key_node.start_mark.line + 1
                    )
                )
            seen.add(key)
            lines[child] = key_node.start_mark.line + 1
            _walk_lines(value_node, child, lines, dups)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[(*path, i)] = item.start_mark.line + 1
            _walk_lines(item, (*path, i), lines, dups)


def apply_override(
    raw: dict[str, Any], override: str, lines: dict[tuple, int | str] | None = None
) -> list[Problem]:
    """Apply one `--set a.b.c=value`; the value is parsed by the type of the field it names.
    Problems with an overridden key are then reported as coming from --set, not the file."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        return [
            Problem(key, f"--set '{override}': expected KEY=VALUE, e.g. --set train.max_steps=100", "--set")
        ]
    parts = key.split(".")
    annotation: Any = Experiment
    for i, part in enumerate(parts):
        model = _model_of(annotation)
        if model is None:
            if _is_mapping(annotation):  # free-form mapping (model.config): any sub-key goes
                annotation = Any
                continue
            where = ".".join(parts[:i])
            return [
                Problem(key, f"--set: '{where}' is a value, not a section; it has no key '{part}'", "--set")
            ]
        fields = keys(model)
        if part not in fields:
            prefix = ".".join(parts[:i])
            known = ", ".join(fields)
            return [
                Problem(
                    key,
                    f"--set: no such key '{part}' in {prefix or 'the experiment'}."
                    f"{did_you_mean(part, fields)} Known keys: {known}",
                    "--set",
                )
            ]
        annotation = fields[part].annotation
    value: Any
    if _is_str(annotation):
        value = text
    else:
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
    _set_path(raw, parts, value)
    if lines is not None:
        for path in [p for p in lines if p[: len(parts)] == tuple(parts)]:
            del lines[path]
        lines[tuple(parts)] = "--set"
    return []


def _set_path(data: dict, parts: typing.Sequence[str], value: Any) -> None:
    for part in parts[:-1]:
        nxt = data.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            data[part] = nxt
        data = nxt
    data[parts[-1]] = value


# ----------------------------------------------------------------------------- validation


def validate(
    raw: dict[str, Any],
    source: str | None = None,
    lines: dict[tuple, int | str] | None = None,
    problems: list[Problem] | None = None,
) -> Experiment:
    """Validate each section on its own (so every section's problems are reported), then the
    contradictions between sections that validated."""
    lines = lines or {}
    problems = list(problems or [])
    raw = dict(raw)
    if not raw.get("run_dir") and isinstance(raw.get("name", "experiment"), str):
        raw["run_dir"] = f"runs/{raw.get('name', 'experiment')}"
    from trainer.config.schema import reward_head

    raw = reward_head(raw)

    fields = Experiment.model_fields
    for key in raw:
        if key not in fields:
            problems.append(
                Problem(
                    str(key),
                    f"unknown top-level key.{did_you_mean(str(key), fields)} Allowed: {', '.join(fields)}",
                    lines.get((key,)),
                )
            )
    valid: dict[str, Any] = {}
    for name, info in fields.items():
        if name not in raw:
            if info.is_required():
                problems.append(Problem(name, f"required section is missing: {info.description}", None))
            elif not info.is_required():
                valid[name] = info.get_default(call_default_factory=True)
            continue
        try:
            valid[name] = getattr(_field_adapter(name).model_validate({name: raw[name]}), name)
        except ValidationError as e:
            problems += _problems_from(e, lines)
    # Contradictions between the sections that validated (a check that needs a broken section is skipped).
    problems += contradictions(types.SimpleNamespace(**valid), lines)  # type: ignore[arg-type]
    if not problems:
        return Experiment.model_validate({k: raw[k] for k in raw if k in fields})
    raise ConfigError(source, _sorted(problems))


_ADAPTERS: dict[str, type[BaseModel]] = {}


def _field_adapter(name: str) -> type[BaseModel]:
    if name not in _ADAPTERS:
        from pydantic import create_model

        info = Experiment.model_fields[name]
        _ADAPTERS[name] = create_model(  # a model with just this field, same type and constraints
            f"_Only_{name}",
            __config__=ConfigDict(extra="forbid"),
            **{name: (info.rebuild_annotation(), Field(...))},
        )
    return _ADAPTERS[name]


def _problems_from(error: ValidationError, lines: dict[tuple, int | str]) -> list[Problem]:
    out = []
    for e in error.errors(include_url=False):
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc)
        line = line_for(loc, lines)
        kind = e["type"]
        if kind == "extra_forbidden":
            parent = _model_at(loc[:-1])
            allowed = list(keys(parent)) if parent else []
            msg = f"unknown key.{did_you_mean(str(loc[-1]), allowed)} Allowed here: {', '.join(allowed)}"
        elif kind == "missing":
            desc = _description_at(loc)
            msg = "required key is missing" + (f": {desc}" if desc else "")
        else:
            text = e["msg"]
            text = text.removeprefix("Value error, ")
            text = text[0].lower() + text[1:]
            text = text.replace("input should be", "must be")
            desc = _description_at(loc)
            msg = f"{text}; got {_show_input(e.get('input'))}" + (f" ({desc})" if desc else "")
        out.append(Problem(key, msg, line))
    return out


def _show_input(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


def _model_at(loc: tuple) -> type[BaseModel] | None:
    annotation: Any = Experiment
    for part in loc:
        model = _model_of(annotation)
        if model is None or part not in keys(model):
            return None
        annotation = keys(model)[part].annotation
    return _model_of(annotation)


def _description_at(loc: tuple) -> str | None:
    parent = _model_at(loc[:-1]) if loc else None
    if parent is None or not loc or loc[-1] not in keys(parent):
        return None
    return keys(parent)[loc[-1]].description


def _sorted(problems: list[Problem]) -> list[Problem]:
    return sorted(
        problems, key=lambda p: (not isinstance(p.line, int), p.line if isinstance(p.line, int) else 0, p.key)
    )
