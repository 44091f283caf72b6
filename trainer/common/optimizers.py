"""The optimizers an experiment can name (`optim.name`), each described once: what DeepSpeed calls
it, which `optim.*` values become its parameters, and the fp32 tensors it keeps per parameter (their
bytes are what the planner counts; checkpoint conversion carries them, whatever their names).

Adding an optimizer is an entry in `OPTIMIZERS`: DeepSpeed takes its own optimizers by name (Adam,
AdamW, Lamb, Lion, ...) and any `torch.optim` class by its class name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Optimizer:
    deepspeed_type: str  # "optimizer.type" in the DeepSpeed JSON
    state: tuple[str, ...]  # fp32 tensors kept per parameter (besides the master weight), by name
    adam: bool = False  # takes betas and eps, and DeepSpeed's torch_adam switch (optim.implementation)
    fixed: tuple[tuple[str, Any], ...] = ()  # further parameters, the same for every experiment
    zero_tested: bool = True  # DeepSpeed's ZeRO knows it; else the JSON allows it explicitly

    @property
    def state_bytes(self) -> int:
        """Bytes per parameter of its state (fp32)."""
        return 4 * len(self.state)

    def params(self, optim: Any, lr: float) -> dict[str, Any]:
        """DeepSpeed's "optimizer.params" from the experiment's optim section (without torch_adam)."""
        out: dict[str, Any] = {"lr": lr, "weight_decay": optim.weight_decay}
        if self.adam:
            out.update(betas=list(optim.betas), eps=optim.eps)
        return out | dict(self.fixed)


ADAM_STATE = ("exp_avg", "exp_avg_sq")
OPTIMIZERS = {
    "adamw": Optimizer("AdamW", ADAM_STATE, adam=True),
    "adam": Optimizer("Adam", ADAM_STATE, adam=True),
}
