"""A rank's start without the garbage collector walking the libraries it imports.

Importing torch, DeepSpeed and transformers' modeling code makes ~380,000 objects (modules,
classes, functions) that live as long as the process. CPython runs a full collection each time the
objects that survived its young generations grow by a quarter: 7 full passes while a rank imports,
each over everything imported so far, 0.7 s of CPU of a rank's ~5 s start on a CPU machine (then a
0.18 s pass when the loop starts). None of it is garbage (a pass finds ~20 objects), so bin/train
keeps the collector off while it imports and then freezes what exists (`gc.freeze`: later passes
skip it) before it builds anything large. The collector is on again for the data, the model and
the engine; the training loop collects and freezes once more when everything is built
(trainer/loop.py).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """Around the imports of a rank's start: the collector off, then what exists frozen and the
    collector on again (also when the block raises)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()


def import_modeling(section: Any) -> None:
    """transformers' modeling code that every model family's module imports (DTensor through the
    weight loading, torch._dynamo through the attention masks), for a model of transformers (not a
    `model.factory`'s): inside `importing`, before the model is built."""
    if section.factory is not None:
        return
    import transformers.masking_utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
