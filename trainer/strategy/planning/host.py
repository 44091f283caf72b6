"""Host memory per node: what a candidate needs there (`host_needs`, DeepSpeed's estimator formulas,
offloaded states included) and the copy an asynchronous save takes (`snapshot_bytes`).
"""

from __future__ import annotations

from trainer.strategy.planning.candidates import Candidate, GiB, Quantized

HOST_BUFFER_FACTOR = 1.5  # DeepSpeed estimators' additional_buffer_factor


def host_needs(
    c: Candidate, p: int, largest: int, n: int, gpus_per_node: int, trainable: int | None = None,
    quantized: Quantized | None = None,
) -> int:  # fmt: skip
    """Host bytes per node, DeepSpeed's estimator formulas (zero_init for stage 3); with offload the
    optimizer's part counts the `trainable` parameters only, and at stages 0-2 the load of every weight (the
    frozen base of a LoRA too) all the same: ZeRO-Offload cannot fix a host that cannot load the model. `quantized` (ModelInfo.quantized): those
    elements are loaded quantized, tensor by tensor onto the device, and offloaded packed: they count
    their packed bytes where the formulas count 2 (offloaded) or 4 (loading) bytes an element."""
    t = p if trainable is None else trainable
    q, packed = (quantized.elements, quantized.packed + quantized.state) if quantized else (0, 0.0)
    nodes = max(1, n // max(1, gpus_per_node))
    f = HOST_BUFFER_FACTOR
    if c.stage == 3:
        if c.offload == "none":
            return int(largest * 4 * gpus_per_node * f)
        if c.offload == "nvme":  # states live on NVMe; the host keeps pinned swap buffers
            return int(largest * 4 * gpus_per_node * f + 2 * GiB)
        return int((16 * t + (2 * (p - q) + packed * q if c.offload_params else 0)) / nodes * f)
    # stages 0-2 load every weight on each rank's host first (no zero.Init), the frozen ones too
    load = (4 * (p - q) + packed * q) * gpus_per_node
    if c.offload != "none":  # DeepSpeed's max(4 x GPUs, 16) a parameter: the load, or the optimizer's states
        return int(max(load, 16 * t / nodes) * f)
    return int(load * f)


def snapshot_bytes(
    c: Candidate,
    p: int,
    n: int,
    gpus_per_node: int,
    lp: int,
    state_bytes: int = 8,
    trainable: int | None = None,
    frozen_saved: bool = True,
) -> int:
    """Host bytes per node for the copy an asynchronous save takes (checkpoint.async): what the
    node's ranks write. Rank 0 writes the module (low-precision values) at stages 0-2, every rank
    its shard at stage 3; the optimizer (fp32 masters and moments) goes whole in rank 0's file at
    stage 0, a partition per rank at stages 1-3 (offloaded or not: the copy is taken either way).
    `frozen_saved=False` (LoRA on a pretrained model): the module holds the trainable ones only."""
    g = max(1, min(gpus_per_node, n))
    master = 4 if (lp < 4 or c.stage > 0) else 0  # fp32 at stage 0 has no separate master copy
    t = p if trainable is None else trainable
    saved = p if frozen_saved else t
    module = lp * saved if c.stage < 3 else lp * saved * g / n
    optim = (master + state_bytes) * t * (1 if c.stage == 0 else g / n)
    return int(module + optim)
