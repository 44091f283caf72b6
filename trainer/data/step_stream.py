"""A training stream that does work at a step's start (its `loss_denominator`) over the step's micro batches, taken
ahead from the run's TrainStream and then fed in order: distill's on-policy steps (trainer/objectives/on_policy.py)
and KTO's KL reference point (trainer/objectives/kto.py). Everything else is the inner stream's: the position (a
checkpoint's, a resume's), the sampler, the record of rows."""

from __future__ import annotations

from typing import Any


class StepStream:
    """Delegates to `inner`; `queue` holds the step's micro batches where the subclass took them ahead."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.queue: list[Any] | None = None

    def __getattr__(self, name: str) -> Any:  # the TrainStream's (sampler, steps_per_epoch, padding...)
        return getattr(self.inner, name)

    @property
    def position(self) -> Any:
        return self.inner.position

    @property
    def record(self) -> Any:
        return self.inner.record

    @record.setter
    def record(self, value: Any) -> None:
        self.inner.record = value

    def seek(self, position: Any) -> None:
        self.inner.seek(position)
        self.queue = None

    def next(self) -> Any:
        return self.queue.pop(0) if self.queue else self.inner.next()
