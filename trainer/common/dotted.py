"""A function named by the user as package.module:function (model.factory, train.rl.rewards), imported and
checked: a path that does not import (not found; or its module raised as it ran: a syntax error, a missing
API key, anything), names nothing or names something not callable is a UserError naming the key, the module
and the cause's first line (no traceback). Besides PYTHONPATH and the installed packages, the user's modules import from the experiment file's
directory and the working directory (`search`: bin/train adds them, after the installed packages)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from trainer.common.errors import UserError

SEARCHED: list[str] = []  # the directories `search` added


def search(*directories: str | os.PathLike) -> None:
    """Let the user's modules import from these directories too (after what is on sys.path already)."""
    for d in directories:
        d = os.path.abspath(d)
        if d not in sys.path:
            sys.path.append(d)
        if d not in SEARCHED:
            SEARCHED.append(d)


def load_callable(path: str, key: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if isinstance(e, ModuleNotFoundError) and missing and not _within(module_name, missing):
            raise UserError(f"{key}: importing '{module_name}' failed: it imports '{missing}', which is not "
                            f"installed ({_first_line(e)}); install it") from None  # fmt: skip
        where = f"PYTHONPATH, the installed packages or {' or '.join(SEARCHED)}" if SEARCHED else "PYTHONPATH"
        raise UserError(f"{key}: cannot import '{module_name}' ({e}); is it on {where}?") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 (the user's module ran and failed: named, no traceback)
        raise UserError(f"{key}: importing '{module_name}' raised {_cause(e)}; fix the module or what it "
                        "needs (an environment variable, a file) and run again") from None  # fmt: skip
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise UserError(f"{key}: '{module_name}' has no '{attr}'")
    if not callable(fn):
        raise UserError(f"{key}: '{path}' is not callable")
    return fn


def _within(module_name: str, missing: str) -> bool:
    """Whether the missing module is the one asked for or a package above it (not something it imports)."""
    return module_name == missing or module_name.startswith(missing + ".")


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def _cause(e: BaseException) -> str:
    """An exception raised at import in one line: its type, its message's first line, where a syntax error is."""
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({e.filename}, line {e.lineno})"
    text = _first_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
