"""A function named by the user as package.module:function (model.factory, train.rl.rewards), imported and
checked: a path that does not import, names nothing or names something not callable is a UserError naming
the key. Besides PYTHONPATH and the installed packages, the user's modules import from the experiment file's
directory and the working directory (`search`: bin/train adds them, after the installed packages)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from trainer.errors import UserError

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
        where = f"PYTHONPATH, the installed packages or {' or '.join(SEARCHED)}" if SEARCHED else "PYTHONPATH"
        raise UserError(f"{key}: cannot import '{module_name}' ({e}); is it on {where}?") from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise UserError(f"{key}: '{module_name}' has no '{attr}'")
    if not callable(fn):
        raise UserError(f"{key}: '{path}' is not callable")
    return fn
