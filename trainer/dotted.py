"""A function named by the user as package.module:function (model.factory, train.rl.rewards), imported and
checked: a path that does not import, names nothing or names something not callable is a UserError naming
the key."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from trainer.errors import UserError


def load_callable(path: str, key: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"{key}: cannot import '{module_name}' ({e}); is it on PYTHONPATH?") from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise UserError(f"{key}: '{module_name}' has no '{attr}'")
    if not callable(fn):
        raise UserError(f"{key}: '{path}' is not callable")
    return fn
