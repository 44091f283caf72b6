"""A rank's start without the garbage collector walking the libraries it imports again and again.

Importing torch and transformers' modeling code makes ~360,000 objects (modules, classes,
functions) that live as long as the process. CPython runs a full collection each time the objects
that survived its young generations grow by a quarter: 7 full passes while a rank starts, each over
everything imported so far (0.7 s of CPU of a rank's ~5 s start on a CPU machine), then another when
the loop starts (0.18 s). Nothing is built there, only imported, so bin/train imports them with
the collector off and then freezes what exists (`gc.freeze`: later passes skip it). The garbage
importing leaves in cycles is kept with it: ~9,400 cycles, ~200,000 objects, ~6 MiB a process, for
0.7 s of CPU at every start (a pass to free it first would cost 0.18 s: with the collector off,
everything is in the youngest generation). Under torchrun, bin/train's main() imports torch this way
too (trainer/run/cli.py). Planning, the process group, the data, the model and the engine
are built with the collector on; the training loop collects and freezes once more when everything
is built, a pass over only what the run built (trainer/run/loop.py).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """Around imports only (no garbage of any size is made): the collector off, then what exists
    frozen and the collector on again (also when the block raises)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()


def import_libraries(section: Any) -> None:
    """What a rank imports anyway, now, inside `importing`: torch and, for a model of transformers
    (not a `model.factory`'s), the modeling code every family's module imports (DTensor through the
    weight loading, torch._dynamo through the attention masks). DeepSpeed is imported by
    trainer/cluster/dist.py's `setup`, after the accelerator is chosen."""
    import torch  # noqa: F401

    if section.factory is None:
        import transformers.masking_utils  # noqa: F401
        import transformers.modeling_utils  # noqa: F401
