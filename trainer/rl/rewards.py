"""train.rl.rewards: the reward functions of GRPO, built in, a local reward model, or the user's, called as
TRL's GRPOTrainer calls them (so that a TRL reward function runs here unchanged).

Every function is called once a generation with keyword arguments: `prompts` (the rows' prompts as given:
strings or message lists, one per completion), `completions` (the decoded completions: strings for text
prompts, `[{"role": "assistant", "content": text}]` for chat prompts, as TRL), `completion_ids` (their token
ids, without padding), `trainer_state` (`global_step`, `epoch`, `max_steps`), `log_extra(column, values)` and
`log_metric(name, value)` (TRL's: a column of the completions log, a scalar averaged into the log line) and
every other column of the rows (a list each, one value per completion), plus its `options`. A function
without `**kwargs` gets those it names. It returns one number per completion (floats, ints, bools, numpy's;
None or NaN: no opinion, left out of the combined reward's weighted sum), as a list, tuple or 1-D array.
`async def` functions are awaited together, on one event loop for the run (a thread's, as TRL's). A
function given by path whose parameters take none of prompts, completions and completion_ids (nor **kwargs)
is a factory (TRL's get_soft_overlong_punishment): called once with its options, it returns the reward
function.

A function that cannot be imported, is not callable, raises, returns another count or something other than
numbers is an error naming it (exit 2: before training where it can be checked; else naming the rows).

Built-ins, for verifiable tasks (`answers.py`: how an answer is read):

- `answer`: the completion's answer (the last `\\boxed{}`, else GSM8K's `#### x`, else the last number; or
  the last match of `pattern`, its first group if it has one) equals the row's `column` (default `answer`;
  GSM8K's solutions are read after their `####`): as strings (stripped of spaces and trailing punctuation,
  numbers of their thousands separators), or with `numeric: true` as numbers within `tolerance`; 1.0 or 0.0,
  None where the row has no value;
- `format`: 1.0 where the completion matches `pattern` (Python's re.search; `fullmatch: true` for the
  whole completion), else 0.0;
- `length`: minus the completion's distance from `target` characters over `scale` (default: target), at
  most 0: a penalty for straying from a length;
- `model`: a local sequence-classification model's logit (`reward_model.py`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.common.errors import UserError
from trainer.rl.answers import answer, text_of

# what TRL gives every reward function beside the columns
GIVEN = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def format_(prompts: Sequence[Any], completions: Sequence[Any], *, pattern: str, fullmatch: bool = False,
            **columns: Any) -> list[float]:  # fmt: skip
    """1.0 where the completion matches `pattern`."""
    rx = re.compile(pattern, re.DOTALL)
    match = rx.fullmatch if fullmatch else rx.search
    return [1.0 if match(text_of(c)) else 0.0 for c in completions]


def length(prompts: Sequence[Any], completions: Sequence[Any], *, target: int, scale: float | None = None,
           **columns: Any) -> list[float]:  # fmt: skip
    """Minus the distance from `target` characters over `scale`."""
    s = float(scale or target or 1)
    return [-abs(len(text_of(c)) - target) / s for c in completions]


BUILTINS: dict[str, Callable[..., Any]] = {"answer": answer, "format": format_, "length": length}


@dataclass(frozen=True)
class TrainerState:
    """What a reward function reads of the run (TRL's `trainer_state`, a transformers TrainerState's names):
    optimizer steps done before this generation, the epoch (with its fraction), the run's last step; only
    these three (TRL passes the whole TrainerState: log_history, best_metric... are not here; docs/rl.md)."""

    global_step: int
    epoch: float
    max_steps: int


@dataclass
class Batch:
    """A generation's completions as the reward functions get them (see the module's doc)."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]]
    trainer_state: TrainerState
    where: str  # the rows, for errors
    log_extra: Callable[[str, list[Any]], None] = lambda column, values: None
    log_metric: Callable[[str, float], None] = lambda name, value: None
    given: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.given = {"prompts": self.prompts, "completions": self.completions, "completion_ids": self.completion_ids,
                      "trainer_state": self.trainer_state, "log_extra": self.log_extra, "log_metric": self.log_metric,
                      **{k: v for k, v in self.columns.items() if k not in GIVEN}}  # fmt: skip


def _params(fn: Any) -> tuple[set[str], bool]:
    """(the keyword names `fn` takes, whether it takes **kwargs); (empty, True) where it cannot be told."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return set(), True
    names = {p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())


@dataclass
class Reward:
    name: str  # as train.rl.rewards gives it (the errors name it so)
    fn: Callable[..., Any]
    weight: float
    options: dict[str, Any]
    label: str = ""  # the metrics' name (reward_<label>): a path's function name, unless two share it

    def __post_init__(self) -> None:
        self.label = self.label or self.name

    def kwargs(self, batch: Batch) -> dict[str, Any]:
        names, var = _params(self.fn)
        given = batch.given if var else {k: v for k, v in batch.given.items() if k in names}
        return {**given, **self.options}

    def call(self, batch: Batch) -> Any:
        """The function's output (a coroutine where it is async); its errors named."""
        try:
            return self.fn(**self.kwargs(batch))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 (the user's function: named, never a silent zero)
            raise UserError(
                f"train.rl.rewards: {self.name} raised {type(e).__name__}: {e} ({batch.where})"
            ) from None

    def __call__(self, batch: Batch) -> list[float]:
        return self.values(self.call(batch), batch)

    def values(self, out: Any, batch: Batch) -> list[float]:
        """Its output as floats, NaN for None (and NaN): an error naming the function and the rows otherwise."""
        n, where = len(batch.completions), batch.where
        if (
            hasattr(out, "reshape") and getattr(out, "ndim", 1) == 2 and out.shape[-1] == 1
        ):  # (n, 1): TRL reads it
            out = out.reshape(-1)
        if hasattr(out, "tolist") and getattr(out, "ndim", 1) == 1:  # a numpy array or a tensor
            out = out.tolist()
        if not isinstance(out, list | tuple | str | bytes | dict) and hasattr(out, "__next__"):
            out = list(out)  # a generator or an iterator (TRL's list comprehension takes them)
        if not isinstance(out, list | tuple) or len(out) != n:
            got = f"{len(out)} values" if isinstance(out, list | tuple) else type(out).__name__
            hint = " (a factory? give its options: it is called with them once its parameters take no completions)"
            raise UserError(f"train.rl.rewards: {self.name} returned {got} for {n} completions ({where}); it must "
                            f"return one number or None a completion{hint if callable(out) else ''}")  # fmt: skip
        return [number(self.name, v, i, where) for i, v in enumerate(out)]


def number(name: str, v: Any, i: int, where: str) -> float:
    """A reward value as a float: None and NaN are NaN (no opinion); bools and numpy's numbers converted."""
    if v is None:
        return math.nan
    if hasattr(v, "item") and _size(v) == 1:  # numpy's scalars, arrays and tensors of one element (TRL's)
        v = v.item()
    if isinstance(v, bool | int | float) and not (isinstance(v, float) and math.isinf(v)):
        return float(v)
    raise UserError(f"train.rl.rewards: {name} returned {v!r} (a {type(v).__name__}) for completion {i} ({where}); "
                    "it must return a finite number or None")  # fmt: skip


def _size(v: Any) -> int:
    size = v.numel() if callable(getattr(v, "numel", None)) else getattr(v, "size", 1)
    return int(size) if isinstance(size, int) else 1


class Loop:
    """The event loop the async reward functions run on: one for the run, in a daemon thread (TRL's
    start_event_loop_in_daemon), started at the first async call, so that what a function's module keeps
    between generations (an httpx.AsyncClient, an AsyncOpenAI: bound to the loop they first ran on) lives on;
    closed at the end of the process (atexit, as TRL), or by `close`."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.registered = False  # (close registered with atexit)

    def run(self, coroutine: Any) -> Any:
        """The coroutine's result, run on the loop (started now if it is not running)."""
        with self.lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                ready = threading.Event()
                self.thread = threading.Thread(target=self._serve, args=(self.loop, ready), daemon=True,
                                               name="rewards-async-loop")  # fmt: skip
                self.thread.start()
                ready.wait()
                if not self.registered:
                    atexit.register(self.close)
                    self.registered = True
            loop = self.loop
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

    @staticmethod
    def _serve(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    def close(self) -> None:
        """Stop the loop and close it (its async generators shut down first); a later `run` starts another."""
        with self.lock:
            loop, thread, self.loop, self.thread = self.loop, self.thread, None, None
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(Exception):  # (best effort, at the end)
            asyncio.run_coroutine_threadsafe(loop.shutdown_asyncgens(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=5)
        if not loop.is_running():
            loop.close()


LOOP = Loop()
close_loop = LOOP.close  # the end of a run (atexit calls it too)


def score(rewards: Sequence[Reward], batch: Batch) -> list[list[float]]:
    """Every function's values (functions, completions): the synchronous ones in order, the async ones
    awaited together (asyncio.gather, TRL's) on the run's one event loop (`Loop`)."""
    out: list[Any] = [None] * len(rewards)
    waiting: list[tuple[int, Any]] = []
    for i, r in enumerate(rewards):
        got = r.call(batch)
        if inspect.isawaitable(got):
            waiting.append((i, got))
        else:
            out[i] = r.values(got, batch)
    if waiting:

        async def all_of() -> list[Any]:
            return await asyncio.gather(*(c for _, c in waiting), return_exceptions=True)

        for (i, _), got in zip(waiting, LOOP.run(all_of()), strict=True):
            if isinstance(got, UserError):
                raise got
            if isinstance(got, BaseException):
                raise UserError(f"train.rl.rewards: {rewards[i].name} raised {type(got).__name__}: {got} "
                                f"({batch.where})") from None  # fmt: skip
            out[i] = rewards[i].values(got, batch)
    return out


def combined(per_function: Any, weights: Any) -> Any:
    """Each completion's reward: the weighted sum of its functions' values (NaN for None), NaN where every
    function gave None. per_function: (completions, functions)."""
    import torch

    rewards = (per_function * weights.to(per_function).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_function).all(dim=1)] = float("nan")
    return rewards


def load(specs: Sequence[Any], model: Callable[[int, dict[str, Any]], Any] | None = None) -> list[Reward]:
    """train.rl.rewards as callables: built-ins by name, `model` by `model(i, options)` (a reward model on the
    run's device), the user's by package.module:function (imported now, a factory called now: an error here
    stops the run before training, exit 2)."""
    out = []
    for i, spec in enumerate(specs):
        name, options, key = spec.function, dict(spec.options), f"train.rl.rewards[{i}]"
        if name == "model":
            if model is None:
                raise UserError(f"{key}: function: model needs the run's device (bin/train loads it)")
            out.append(Reward(f"model:{options['path']}", model(i, options), float(spec.weight), {},
                              label=f"model_{Path(options['path']).name}"))  # fmt: skip
            continue
        clash = sorted(set(options) & set(GIVEN))
        if clash:
            raise UserError(f"{key}.options: {', '.join(clash)} is what every reward function is given (TRL's "
                            f"arguments: {', '.join(GIVEN)}); rename the option")  # fmt: skip
        if name in BUILTINS:
            fn = BUILTINS[name]
            check_builtin(name, options, key)
        else:
            fn = import_function(name, key)
            names, var = _params(fn)
            if not var and not names & {"prompts", "completions", "completion_ids"}:  # a factory
                try:
                    fn = fn(**options)
                except Exception as e:  # noqa: BLE001 (the user's factory: named)
                    raise UserError(f"{key}: {name} takes none of prompts, completions, completion_ids, so it is "
                                    f"called as a factory with options {options}: it raised {type(e).__name__}: {e}; "
                                    "give the factory's arguments as options") from None  # fmt: skip
                if not callable(fn):
                    raise UserError(f"{key}: {name} (a factory: it takes none of prompts, completions, "
                                    f"completion_ids) returned {type(fn).__name__}, not a reward function")  # fmt: skip
                options = {}
        out.append(Reward(name, fn, float(spec.weight), options))
    label(out)
    return out


def label(rewards: Sequence[Reward]) -> None:
    """Each reward's label (its metrics reward_<label>, its completions column), unique: a built-in's name, a
    path's function name (the whole path where two paths share one), model_<directory>; where a label
    repeats (two format patterns, two answer columns, one function twice), the second is <label>_2, ..."""
    short = [r.name.rpartition(":")[2] if ":" in r.name and not r.name.startswith("model:") else r.label
             for r in rewards]  # fmt: skip
    paths = {r.name for r in rewards if ":" in r.name and not r.name.startswith("model:")}
    taken: set[str] = set()
    for r, name in zip(rewards, short, strict=True):
        clash = sum(1 for p in paths if p.rpartition(":")[2] == name) > 1  # two paths' function names
        base = r.name if clash else name
        got, n = base, 1
        while got in taken:
            n += 1
            got = f"{base}_{n}"
        taken.add(got)
        r.label = got


def check_builtin(name: str, options: dict[str, Any], key: str) -> None:
    if name in ("format", "length"):
        need = "pattern" if name == "format" else "target"
        if need not in options:
            raise UserError(f"{key}: {name} needs options.{need}")
    if name in ("answer", "format") and "pattern" in options:
        try:
            re.compile(options["pattern"])
        except (re.error, TypeError) as e:
            raise UserError(f"{key}: {name}'s options.pattern does not compile: {e}") from None


def import_function(path: str, key: str) -> Callable[..., Any]:
    if not path.partition(":")[2]:
        raise UserError(
            f"{key}: '{path}' is neither a built-in ({', '.join([*BUILTINS, 'model'])}) nor package.module:function"
        )
    from trainer.common.dotted import load_callable

    return load_callable(path, key)
