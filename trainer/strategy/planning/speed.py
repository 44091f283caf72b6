"""The estimated step time of one setting -- the activation levers (levers.py) on a ZeRO rung
(candidates.py) at a micro batch -- which the planner picks by among the settings that fit (ladder.py):
the memory rules say what fits, this says which of those is fastest. Issue 55: at 16 GB the memory-first
order chose ZeRO-3 with CPU offload and the tiled MLP for QLoRA of an 8B (one lever, 6.99 s a step on an
H200) over ZeRO-0 with activation checkpointing (two levers' worth of memory, 2.79 s).

A step is `grad_accum` micro steps and the optimizer step. A micro step takes the longer of the device's
work and the host's (the host launches the kernels ahead of the device while it can), plus what does not
overlap with either: ZeRO-3's gathers, parameters or activations crossing the host link, Ulysses'
all-to-alls. Per micro step, over its tokens (rows x seq_len / sp on each rank):

- device work: FLOPs per token as bin/train counts MFU (4 N + 2 N_trainable + 12 L h s: forward, the
  activations' gradients, the trainable weights' gradients, attention), plus a forward of every layer
  again under activation checkpointing (2 N + 4 L h s), and the MLP's forward again under the tiled MLP
  (2 N_mlp), at `Machine.flops`;
- host work: the operators a layer launches (`ops_per_layer`) in each pass -- forward, the recompute,
  backward (twice a forward's) -- at `Machine.op_s` each, and at ZeRO-3 the fetch and release of every
  parameter tensor in each pass (`Machine.zero3_tensor_s`, DeepSpeed's hooks: QLoRA of an 8B pinned to
  ZeRO-3 on one H200 took 9.6 s a step against ZeRO-0's 2.8, ~0.8 ms a tensor a pass);
- ZeRO-3's gathers: the stored parameters (packed where quantized) in each pass, (dp - 1) / dp of them
  over the ranks' link; with the parameters offloaded, each rank's partition over the host link first;
- sequence parallelism: four all-to-alls of the layer's activations a layer and pass;
- activations offloaded: each checkpointed layer input to the host and back.

Per optimizer step: the gradients reduced across data-parallel ranks (an all-reduce at ZeRO 0/1, a
reduce-scatter and the parameters' all-gather at 2, a reduce-scatter at 3: about twice the trainable
bytes either way), and with the optimizer offloaded the gradients down and the parameters up over the
host link, DeepSpeed's CPU Adam (`Machine.cpu_adam`) and NVMe's reads and writes of the states.

The machine's figures are round numbers for an H100/H200 node and for this project's CPU hosts (`MACHINES`);
they order settings, they are no prediction of a run (bench/gpu.sh measures those). Unit tests hold the
orderings that matter (tests/unit/test_plan_speed.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.strategy.planning.candidates import Candidate, ModelInfo
from trainer.strategy.planning.generation import row_length


@dataclass(frozen=True)
class Machine:
    flops: float  # dense FLOP/s a device achieves on the model's matmuls
    host_link: float  # bytes/s between a device and host memory
    peers: float  # bytes/s between the devices of a node
    nodes: float  # bytes/s per device between nodes
    op_s: float  # host seconds per operator launched (Python, autograd, dispatch, the launch)
    zero3_tensor_s: float  # host seconds ZeRO-3 spends per parameter tensor per pass
    cpu_adam: float  # parameters a second DeepSpeed's CPU Adam updates
    nvme: float  # bytes/s to and from NVMe


MACHINES = {
    # 45% of an H100's 989 TFLOP/s; PCIe 5 x16 in practice; NVLink; 100 Gb/s a GPU between nodes
    "cuda": Machine(
        flops=445e12,
        host_link=25e9,
        peers=150e9,
        nodes=12.5e9,
        op_s=30e-6,
        zero3_tensor_s=0.8e-3,
        cpu_adam=1.5e9,
        nvme=2e9,
    ),  # fmt: skip
    # two cores; "offload" copies within host memory; gloo between processes
    "cpu": Machine(
        flops=60e9,
        host_link=8e9,
        peers=2e9,
        nodes=1e9,
        op_s=10e-6,
        zero3_tensor_s=0.2e-3,
        cpu_adam=0.3e9,
        nvme=1e9,
    ),  # fmt: skip
}


@dataclass(frozen=True)
class StepTime:
    """An estimated step, in seconds, and its parts."""

    seconds: float
    tokens: float  # the step's tokens, every rank (sequence parallelism shrinks the data-parallel world)
    device: float  # the device's work, all micro steps
    host: float  # the host's launches, all micro steps
    transfers: (
        float  # what overlaps with neither: gathers, host-link copies, all-to-alls, the step's reductions
    )
    optimizer: float  # an offloaded optimizer's step on the host

    @property
    def per_token(self) -> float:
        """What settings are compared by: a step's seconds over its tokens (a setting of sequence
        parallelism trains fewer sequences a step, at the same micro batch and accumulation)."""
        return self.seconds / max(1.0, self.tokens)

    def describe(self) -> str:
        return (
            f"{self.seconds:.2f} s (device {self.device:.2f}, host {self.host:.2f}, transfers {self.transfers:.2f}"
            + (f", host optimizer {self.optimizer:.2f}" if self.optimizer else "")
            + ")"
        )


def ops_per_layer(info: ModelInfo, adapters: int, quantized: bool, fused: bool) -> int:
    """Operators a transformer layer launches in a forward: about 40 for its norms, rotary embedding,
    attention, activation and residuals, 1 a linear layer (4 when it dequantizes 4-bit weights first:
    bitsandbytes' absmax, its dequantization, the product), and an adapter's branch (3 fused, 7 as
    peft's modules compute it: dropout, two products, the scaling, the sum, casts)."""
    linear = 7 if info.intermediate else 4
    return 40 + linear * (4 if quantized else 1) + adapters * (3 if fused else 7)


def step_time(
    exp: Any,
    info: ModelInfo,
    levers: Any,
    c: Candidate,
    *,
    world_size: int,
    gpus_per_node: int,
    device_type: str,
    lp: int,
    micro: int | None = None,
    accum: int | None = None,
) -> StepTime:
    """The estimated seconds of one optimizer step (see the module's doc)."""
    m = MACHINES["cuda" if device_type == "cuda" else "cpu"]
    t = exp.train
    micro = t.micro_batch_size if micro is None else micro
    accum = t.grad_accum if accum is None else accum
    rows = micro * (1 if t.objective in ("sft", "grpo") else 2)  # (grpo: generation's time not counted)
    sp = max(1, levers.sp)
    dp = max(1, world_size // sp)
    tokens = rows * row_length(exp) / sp
    n = info.active or info.params
    trainable = info.params if info.trainable is None else info.trainable
    h, layers, s = info.hidden or 0, info.layers or 0, row_length(exp)
    attention = 12 * layers * h * s
    flops = 4 * n + 2 * trainable + attention
    if levers.checkpointing:
        flops += 2 * n + attention / 3
    if levers.tiled_mlp:
        width = info.intermediate or 4 * h
        flops += 2 * layers * h * width * (3 if info.intermediate else 2)
    device = tokens * flops / m.flops
    lora = exp.model.lora
    adapters = (
        (len(lora.target_modules) if lora.target_modules else (7 if info.intermediate else 3)) if lora else 0
    )
    quantized = bool(info.quantized)
    fused = lora is not None and getattr(lora, "kernels", "fused") == "fused"
    passes = 3 + (1 if levers.checkpointing else 0)  # forward, backward (twice a forward's work), recompute
    host = layers * ops_per_layer(info, adapters, quantized, fused) * passes * m.op_s
    gather_passes = 2 + (1 if levers.checkpointing else 0)
    tensors = len(info.param_sizes) or 2 * layers
    stored = _stored_bytes(info, lp)
    link = m.peers if world_size <= gpus_per_node else m.nodes
    transfers = 0.0
    if c.stage == 3:
        host += tensors * gather_passes * m.zero3_tensor_s
        if c.offload != "none" and c.offload_params:  # to the device from the host, then gathered as ever
            transfers += stored / dp * gather_passes / m.host_link
        if dp > 1:
            transfers += stored * gather_passes * (dp - 1) / dp / link
    if sp > 1:
        transfers += 4 * tokens * h * lp * layers * gather_passes * (sp - 1) / sp / link
    if levers.offload:
        transfers += 2 * layers * tokens * h * lp / m.host_link
    micro_s = max(device, host) + transfers
    step_transfers = 2 * trainable * lp * (dp - 1) / dp / link if dp > 1 else 0.0
    optimizer = 0.0
    if c.offload != "none":
        step_transfers += trainable * (4 + lp) / dp / m.host_link
        optimizer = trainable / dp / m.cpu_adam
        if c.offload == "nvme":
            optimizer += 2 * trainable * 12 / dp / m.nvme
    return StepTime(
        seconds=accum * micro_s + step_transfers + optimizer,
        tokens=accum * tokens * sp * dp,
        device=accum * device,
        host=accum * host,
        transfers=accum * transfers + step_transfers,
        optimizer=optimizer,
    )


def _stored_bytes(info: ModelInfo, lp: int) -> float:
    """The parameters' bytes as stored: packed where quantized, the training precision otherwise."""
    q = info.quantized
    if not q:
        return info.params * lp
    return (info.params - q.elements) * lp + q.elements * q.packed + q.state_bytes()
