"""The planner: which ZeRO stage and offload, which activation levers, and why.

`plan()` estimates per-rank memory (model states, activations, buffers; host memory per node for
offload) for every candidate under every setting of the activation levers, and takes the fastest that
fits by the estimated step (speed.py, on hardware.py's machine) under the escalation rules as
constraints: offload only when no setting fits on the devices alone, a costlier rung of `LADDER` (0 -> 1
-> 2 -> 3 -> 2+cpu -> 3+cpu optimizer only -> 3+cpu -> 3+nvme) only where the cheaper ones do not fit or
are slower; a pinned stage or offload above the rules' choice needs a justification. The run-time
escalation climbs the same ladder (`next_rung`, ladder.py's `escalation_after`).

One kind of bytes per module: candidates.py (the model's facts, the candidates, the ladder, the
pins), states.py (parameters, gradients, optimizer state; precision), step.py (the optimizer step's
own memory), activations.py (what backward keeps, and the levers that shrink it), buffers.py (the
CUDA context, ZeRO's buckets and the DeepSpeed sizes behind them), host.py (host memory per node),
estimate.py (all of these per candidate); speed.py and hardware.py (a step's time); search.py (the
choice), pins.py (what the experiment pins and what only narrows the rungs), ladder.py (the Plan and
its table), hints.py (what would make a rung fit, when none does); layers.py counts one layer of each family from the model's shape (what it keeps for backward,
its key/value cache, its FLOPs), which activations.py, generation.py and speed.py build on.

Nothing here imports torch or deepspeed: planning runs anywhere, in well under a second.
"""

from trainer.strategy.planning.activations import (
    COMPILED_LAYERS,
    activations,
    activations_for,
    layer_bytes_per_token,
)
from trainer.strategy.planning.axes import layout
from trainer.strategy.planning.buffers import (
    CUDA_CONTEXT,
    DEEPSPEED_DEFAULTS,
    MEASURED,
    auto_bucket,
    buffers,
    is_number,
    measured_sizes,
    overlap_comm,
    zero_section,
    zero_sizes,
)
from trainer.strategy.planning.candidates import (
    LADDER,
    TABLE,
    Candidate,
    GiB,
    ModelInfo,
    describe_params,
    device_of,
    next_rung,
    pinned_choice,
)
from trainer.strategy.planning.estimate import Estimate, estimate_all
from trainer.strategy.planning.host import HOST_BUFFER_FACTOR, host_needs, snapshot_bytes
from trainer.strategy.planning.ladder import Plan, describe_plan, plan
from trainer.strategy.planning.layers import flops_per_token
from trainer.strategy.planning.stages import stages_line
from trainer.strategy.planning.states import (
    low_precision_bytes,
    model_states,
    optimizer_implementation,
    resolve_precision,
)
from trainer.strategy.planning.step import SUB_GROUP_SIZE, step_bytes

__all__ = [
    "COMPILED_LAYERS",
    "CUDA_CONTEXT",
    "DEEPSPEED_DEFAULTS",
    "HOST_BUFFER_FACTOR",
    "LADDER",
    "MEASURED",
    "SUB_GROUP_SIZE",
    "TABLE",
    "Candidate",
    "Estimate",
    "GiB",
    "ModelInfo",
    "Plan",
    "activations",
    "activations_for",
    "auto_bucket",
    "buffers",
    "describe_params",
    "describe_plan",
    "device_of",
    "estimate_all",
    "flops_per_token",
    "host_needs",
    "layout",
    "stages_line",
    "is_number",
    "layer_bytes_per_token",
    "low_precision_bytes",
    "measured_sizes",
    "model_states",
    "next_rung",
    "optimizer_implementation",
    "overlap_comm",
    "pinned_choice",
    "plan",
    "resolve_precision",
    "snapshot_bytes",
    "step_bytes",
    "zero_section",
    "zero_sizes",
]
