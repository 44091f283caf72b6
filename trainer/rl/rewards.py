"""train.rl.rewards: the reward functions of GRPO, built in or the user's, checked.

Every function is called once a generation with the prompts (the rows' prompts as given: strings or message
lists, one per completion), the completions (decoded strings) and every other column of the rows (each a
list, one value per completion), plus its `options` as keyword arguments, and returns one float (or None:
no opinion, left out of the combined reward's weighted sum) per completion. A function that cannot be
imported, is not callable, raises, returns another count or something other than numbers is an error
naming it (exit 2: before training where it can be checked; else naming the row).

Built-ins, for verifiable tasks:

- `answer`: the answer in the completion, the last match of `pattern` (default: the last number), equal to
  the row's `column` (default `answer`): exactly as strings (stripped), or with `numeric: true` as numbers
  within `tolerance` (default 0); 1.0 or 0.0, None where the row has no such column value;
- `format`: 1.0 where the completion matches `pattern` (Python's re.search; `fullmatch: true` for the
  whole completion), else 0.0;
- `length`: minus the completion's distance from `target` characters over `scale` (default: target), at
  most 0: a penalty for straying from a length.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainer.errors import UserError

NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def answer(prompts: Sequence[Any], completions: Sequence[str], *, column: str = "answer", pattern: str = NUMBER,
           numeric: bool = False, tolerance: float = 0.0, **columns: Any) -> list[float | None]:  # fmt: skip
    """1.0 where the completion's answer (the last match of `pattern`; its first group if it has one) equals
    the row's `column`."""
    if column not in columns:
        raise UserError(f"train.rl.rewards: answer reads the column '{column}', which the data does not have; "
                        f"its columns: {', '.join(sorted(columns)) or 'none'} (set options.column)")  # fmt: skip
    rx = re.compile(pattern)
    out: list[float | None] = []
    for text, expected in zip(completions, columns[column], strict=True):
        if expected is None:
            out.append(None)
            continue
        found = [m.group(1) if m.groups() else m.group(0) for m in rx.finditer(text)]
        if not found:
            out.append(0.0)
            continue
        got = found[-1].strip()
        if numeric:
            a, b = _number(got), _number(str(expected))
            out.append(1.0 if a is not None and b is not None and abs(a - b) <= tolerance else 0.0)
        else:
            out.append(1.0 if got == str(expected).strip() else 0.0)
    return out


def format_(prompts: Sequence[Any], completions: Sequence[str], *, pattern: str, fullmatch: bool = False,
            **columns: Any) -> list[float]:  # fmt: skip
    """1.0 where the completion matches `pattern`."""
    rx = re.compile(pattern, re.DOTALL)
    match = rx.fullmatch if fullmatch else rx.search
    return [1.0 if match(text) else 0.0 for text in completions]


def length(prompts: Sequence[Any], completions: Sequence[str], *, target: int, scale: float | None = None,
           **columns: Any) -> list[float]:  # fmt: skip
    """Minus the distance from `target` characters over `scale`."""
    s = float(scale or target or 1)
    return [-abs(len(text) - target) / s for text in completions]


BUILTINS: dict[str, Callable[..., Any]] = {"answer": answer, "format": format_, "length": length}


@dataclass
class Reward:
    name: str
    fn: Callable[..., Any]
    weight: float
    options: dict[str, Any]

    def __call__(self, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]],
                 where: str) -> list[float]:  # fmt: skip
        """Its values, NaN for None; an error naming the function and `where` (the rows) otherwise."""
        try:
            values = self.fn(prompts=prompts, completions=completions, **columns, **self.options)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 (the user's function: named, never a silent zero)
            raise UserError(
                f"train.rl.rewards: {self.name} raised {type(e).__name__}: {e} ({where})"
            ) from None
        if not isinstance(values, list | tuple) or len(values) != len(completions):
            got = f"{len(values)} values" if isinstance(values, list | tuple) else type(values).__name__
            raise UserError(f"train.rl.rewards: {self.name} returned {got} for {len(completions)} completions "
                            f"({where}); it must return one float or None a completion")  # fmt: skip
        out = []
        for i, v in enumerate(values):
            if v is None:
                out.append(math.nan)
            elif isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(float(v)):
                raise UserError(f"train.rl.rewards: {self.name} returned {v!r} (a {type(v).__name__}) for completion "
                                f"{i} ({where}); it must return a finite float or None")  # fmt: skip
            else:
                out.append(float(v))
        return out


def combined(per_function: Any, weights: Any) -> Any:
    """Each completion's reward: the weighted sum of its functions' values (NaN for None), NaN where every
    function gave None. per_function: (completions, functions)."""
    import torch

    rewards = (per_function * weights.to(per_function).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_function).all(dim=1)] = float("nan")
    return rewards


def load(specs: Sequence[Any]) -> list[Reward]:
    """train.rl.rewards as callables: built-ins by name, the user's by package.module:function (imported now:
    an error here stops the run before training, exit 2)."""
    out = []
    for i, spec in enumerate(specs):
        name, options = spec.function, dict(spec.options)
        if name in BUILTINS:
            fn = BUILTINS[name]
            if name in ("format", "length"):
                need = "pattern" if name == "format" else "target"
                if need not in options:
                    raise UserError(f"train.rl.rewards[{i}]: {name} needs options.{need}")
            if name == "answer" and "pattern" in options:
                try:
                    re.compile(options["pattern"])
                except re.error as e:
                    raise UserError(
                        f"train.rl.rewards[{i}]: answer's pattern does not compile: {e}"
                    ) from None
        else:
            fn = import_function(name, f"train.rl.rewards[{i}]")
        out.append(Reward(name, fn, float(spec.weight), options))
    return out


def import_function(path: str, key: str) -> Callable[..., Any]:
    if not path.partition(":")[2]:
        raise UserError(
            f"{key}: '{path}' is neither a built-in ({', '.join(BUILTINS)}) nor package.module:function"
        )
    from trainer.dotted import load_callable

    return load_callable(path, key)
