"""The estimated step time of one setting -- the activation levers (levers.py) on a ZeRO rung
(candidates.py) at a micro batch -- which the planner picks by among the settings that fit (ladder.py):
the memory rules say what fits, this says which of those is fastest. The machine's figures (FLOP/s, the
links, CPU Adam) are hardware.py's profiles with strategy.hardware over them.

A step is `grad_accum` micro steps and the optimizer step. A micro step takes the longer of the device's
work and the host's (the host launches the kernels ahead of the device while it can; on a CPU, where the
same cores do both, their sum: `Machine.overlap`), plus the communication, which is assumed not to overlap
with either (DeepSpeed's overlap_comm and ZeRO-3's prefetch
hide part of it on GPUs: the higher rungs' estimates are upper bounds). Per micro step, over its tokens
(rows x seq_len / sp on each rank):

- device work: FLOPs per token as bin/train counts MFU (4 N + 2 N_trainable + attention: forward, the
  activations' gradients, the trainable weights' gradients, the scores; N the parameters a token multiplies by,
  a mixture of experts' active ones: layers.py's `flops_per_token`), plus a forward of every layer
  again under activation checkpointing (2 N + a third of attention's), and the MLP's forward again under the tiled
  MLP (`mlp_flops`), at `Machine.flops`;
- host work: the operators a layer launches (`ops_per_layer`) in each pass -- forward, the recompute,
  backward (twice a forward's) -- at `Machine.op_s` each, and at ZeRO-3 the fetch and release of every
  parameter tensor in each pass (`Machine.zero3_tensor_s`, DeepSpeed's hooks), and what a micro step costs
  whatever its size (`Machine.micro_s`: the engine's forward, backward and step calls);
- ZeRO's collectives span every rank it shards over, the whole world (with sequence parallelism too:
  DeepSpeed partitions over the sequence-and-data-parallel group, as the memory plan counts), over the
  node's links while the world fits a node and the network past it. ZeRO-3 gathers the stored parameters
  (packed where quantized) in each pass, (W - 1) / W of them a rank; with the parameters offloaded each
  rank's partition crosses the host link first;
- the gradients: ZeRO-2 and 3 reduce-scatter them at every micro step (DeepSpeed's engine,
  `allreduce_gradients`: "ZeRO stage >= 2 communicates during non gradient accumulation boundaries as
  well"), with the optimizer offloaded each rank's partition then goes to the host (where it accumulates
  in fp32); ZeRO-0 and 1 reduce once a step, at the boundary (below);
- sequence parallelism: a layer's all-to-alls of queries, keys, values (fewer with grouped key/value
  heads) and outputs in each pass, inside a node (DeepSpeed's Ulysses groups are consecutive ranks) where the
  groups tile a node (the degree divides the node's GPUs), over the network otherwise (a group of 4 on nodes of 6
  straddles two), each all-to-all also paying a latency whatever its size (`Machine.collective_s`; ZeRO's
  collectives are not charged it: few and large);
- activations offloaded: each checkpointed layer input to the host and back.

Per optimizer step: ZeRO-0 all-reduces the gradients and ZeRO-1 reduce-scatters them and all-gathers the
updated parameters (twice the trainable bytes either way); ZeRO-2 all-gathers the updated parameters; with
the optimizer offloaded, DeepSpeed's CPU Adam updates each rank's partition, a node's ranks sharing the
host (`Machine.cpu_adam` a node), the updated partition goes back to the device (not with ZeRO-3's
parameters offloaded: they live on the host), and NVMe reads and writes the optimizer states.

The figures order settings; they are no prediction of a run (bench/plan_order.py checks the order against
measured CPU steps, bench/gpu.sh measures GPU ones). Unit tests hold the orderings that matter
(tests/unit/test_plan_speed.py) and the decisions over a matrix of jobs (tests/unit/test_plan_matrix.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.strategy.batch import accumulation
from trainer.strategy.planning.candidates import Candidate, ModelInfo
from trainer.strategy.planning.generation import row_length
from trainer.strategy.planning.hardware import Machine, machine
from trainer.strategy.planning.layers import attention_flops, flops_per_token, mlp_flops


@dataclass(frozen=True)
class StepTime:
    """An estimated step, in seconds, and its parts."""

    seconds: float
    tokens: float  # the step's tokens, every rank (sequence parallelism shrinks the data-parallel world)
    device: float  # the device's work, all micro steps
    host: float  # the host's launches, all micro steps
    transfers: float  # gathers, host-link copies, all-to-alls: what overlaps with neither
    optimizer: float  # an offloaded optimizer's step on the host
    reductions: float = 0.0  # the gradients' reductions and the updated parameters' gathers

    @property
    def per_token(self) -> float:
        """What settings are compared by: a step's seconds over its tokens (a setting of sequence
        parallelism trains fewer sequences a step, at the same micro batch and accumulation)."""
        return self.seconds / max(1.0, self.tokens)

    def describe(self) -> str:
        return (
            f"{self.seconds:.2f} s (device {self.device:.2f}, host {self.host:.2f}, reductions {self.reductions:.2f}, "
            f"transfers {self.transfers:.2f}"
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
    hardware: Machine | None = None,
) -> StepTime:
    """The estimated seconds of one optimizer step (see the module's doc)."""
    m = hardware or machine(device_type, exp.strategy.hardware)[0]
    timer = Timer(exp, info, world_size=world_size, gpus_per_node=gpus_per_node, lp=lp, hardware=m, micro=micro,
                  accum=accum)  # fmt: skip
    return timer(levers, c)


class Timer:
    """`step_time` for one job on one machine, every setting: what no setting changes is worked out once."""

    def __init__(
        self, exp: Any, info: ModelInfo, *, world_size: int, gpus_per_node: int, lp: int, hardware: Machine,
        micro: int | None = None, accum: int | None = None,
    ) -> None:  # fmt: skip
        t, m = exp.train, hardware
        # train.global_batch_size is kept whatever the sequence-parallel degree: a degree's step accumulates what
        # its data-parallel ranks need for it (strategy/batch.py), so that every setting trains as many tokens
        self.exp = exp if accum is None and micro is None else None
        micro = t.micro_batch_size if micro is None else micro
        self.accum = t.grad_accum if accum is None else accum
        self.rows = micro * (
            1 if t.objective in ("sft", "grpo") else 2
        )  # (grpo: generation's time not counted)
        self.m, self.lp, self.s = m, lp, row_length(exp)
        self._model(info, world_size, gpus_per_node)
        self.link = m.peers if self.world <= self.node else m.network  # ZeRO's collectives span the world
        # the values a token's queries, keys, values and outputs hold (Ulysses' all-to-alls: the config's head sizes)
        self.exchanged = (
            (info.heads or 0) * (info.qk_head_dim + info.value_head_dim)
            + info.kv_count * (info.qk_head_dim + info.value_head_dim)
            if info.heads
            else 0
        )
        lora = exp.model.lora
        adapters = (
            (len(lora.target_modules) if lora.target_modules else (7 if info.intermediate else 3))
            if lora
            else 0
        )
        fused = lora is not None and getattr(lora, "kernels", "fused") == "fused"
        self.launches = (
            (info.layers or 0) * ops_per_layer(info, adapters, bool(info.quantized), fused) * m.op_s
        )
        self.tensors = len(info.param_sizes) or 2 * (info.layers or 0)

    def __call__(self, levers: Any, c: Candidate) -> StepTime:
        tp, ep, pp = getattr(levers, "tp", 1), getattr(levers, "ep", 1), getattr(levers, "pp", 1)
        if tp > 1 or ep > 1 or pp > 1:
            return self._axes(levers, c, tp, ep, pp)
        m, info, lp, world, node, grads, share, link = (self.m, self.info, self.lp, self.world, self.node,
                                                        self.grads, self.share, self.link)  # fmt: skip
        sp = max(1, levers.sp)
        dp = max(1, world // sp)
        tokens = self.rows * self.s / sp
        passes = 2 + (1 if levers.checkpointing else 0)  # the forward, the recompute, the backward
        device = tokens * _flops_per_token(info, levers, self.s) / m.flops
        # the layers' operators in the forward, the recompute and the backward (twice a forward's);
        # at ZeRO-3 its hooks' fetch and release of every parameter tensor in each pass
        host = self.launches * (passes + 1) + (
            self.tensors * passes * m.zero3_tensor_s if c.stage == 3 else 0.0
        )
        transfers, reductions = 0.0, 0.0
        if c.stage == 3:
            transfers += self.stored * passes * share / link
            if c.offload_params:  # each rank's partition to the device, then gathered as ever
                transfers += (
                    self.stored / world * passes / (m.host_link if c.offload == "cpu" else m.nvme / node)
                )
        if c.stage >= 2:  # reduce-scattered at every micro step; offloaded, each rank's partition to the host
            reductions += grads * share / link
            transfers += grads / world / m.host_link if c.offload != "none" else 0.0
        if sp > 1:  # Ulysses: queries, keys, values and outputs exchanged a layer and pass, inside a node
            volume = self.exchanged * tokens * lp * (info.layers or 0) * passes
            inside = sp <= node and node % sp == 0  # groups of consecutive ranks that tile a node
            transfers += volume * (sp - 1) / sp / (m.peers if inside else m.network)
            transfers += 4 * (info.layers or 0) * passes * m.collective_s  # four all-to-alls a layer and pass
        if levers.offload:
            transfers += 2 * (info.layers or 0) * tokens * (info.hidden or 0) * lp / m.host_link
        host += m.micro_s
        micro_s = (max(device, host) if m.overlap else device + host) + transfers + reductions
        step_reductions = (2, 2, 1, 0)[c.stage] * grads * share / link
        optimizer, step_copies = 0.0, 0.0
        if c.offload != "none":
            optimizer = self.trainable / world * node / m.cpu_adam  # a node's ranks share its host's cores
            step_copies = (
                0.0 if c.offload_params else grads / world / m.host_link
            )  # the updated partition back
            if c.offload == "nvme":
                optimizer += 2 * self.trainable * 12 / world * node / m.nvme  # the states read and written
        a = self.accum if self.exp is None else accumulation(self.exp, world, sp)
        return StepTime(
            seconds=a * micro_s + step_reductions + step_copies + optimizer,
            tokens=a * tokens * sp * dp,
            device=a * device,
            host=a * host,
            transfers=a * transfers + step_copies,
            optimizer=optimizer,
            reductions=a * reductions + step_reductions,
        )

    def _model(self, info: ModelInfo, world_size: int, gpus_per_node: int) -> None:
        """What depends on the model a rank holds and the ranks ZeRO partitions it over."""
        self.info, self.world = info, max(1, world_size)
        self.node = max(1, min(gpus_per_node, self.world))
        self.trainable = info.params if info.trainable is None else info.trainable
        self.stored, self.grads = _stored_bytes(info, self.lp), self.trainable * self.lp
        self.share = (self.world - 1) / self.world  # of a collective's bytes that cross to other ranks

    def _axes(self, levers: Any, c: Candidate, tp: int, ep: int, pp: int = 1) -> StepTime:
        """Under tensor or expert parallelism (axes.py) or pipeline stages (stages.py): one rank's model (the largest
        stage's) on its rows, ZeRO's collectives over the ranks it partitions over (world / tp / pp: a group's ranks
        hold one copy of the model), the step's tokens those of the data-parallel ranks, the axes' own collectives
        each micro step, and a pipeline's bubble ((p - 1) micro steps of its largest stage) and transfers."""
        import dataclasses

        from trainer.strategy.planning import stages
        from trainer.strategy.planning.axes import axes_seconds, rank_model

        key = (tp, ep, pp)
        sub = self.__dict__.setdefault("_subs", {}).get(key)
        if sub is None:  # this Timer over one rank's model (as many operators a layer, on smaller shapes)
            sub = object.__new__(Timer)
            sub.__dict__.update(self.__dict__, _subs={})
            sub._model(rank_model(self.info, tp, ep, pp, self.s), self.world // (tp * pp), self.node)
            sub.launches = self.launches * (sub.info.layers or 0) / max(1, self.info.layers or 1)
            self._subs[key] = sub
        plain = dataclasses.replace(levers, tp=1, ep=1, pp=1)
        t = Timer.__call__(sub, plain, c)
        passes = 2 + (1 if levers.checkpointing else 0)
        accum = self.accum if self.exp is None else accumulation(self.exp, self.world, levers.mp)
        staged = stages.stage_info(self.info, pp, self.s) if pp > 1 else self.info  # (3D: a stage's layers)
        extra = accum * axes_seconds(staged, tp, ep, self.rows * self.s, passes, self.lp, self.m, self.node)
        if pp > 1:  # ZeRO 0-1: every reduction is the step's, after the micro steps
            micro = (t.seconds - t.optimizer - t.reductions) / max(1, accum)
            extra += micro * (pp - 1) + stages.p2p_seconds(
                self.info, pp, accum, self.rows * self.s, self.lp, self.m, self.world, self.node
            )
        return dataclasses.replace(t, seconds=t.seconds + extra, transfers=t.transfers + extra)


def _flops_per_token(info: ModelInfo, levers: Any, s: int) -> float:
    """FLOPs a token as bin/train counts MFU (layers.py: a mixture of experts' active parameters), with the
    recompute of checkpointing (a forward again) and the tiled MLP (the MLPs' forward again)."""
    flops = flops_per_token(info, s)
    if levers.checkpointing:
        flops += 2 * ((info.active or info.params) - info.idle) + attention_flops(info, s) / 3
    if levers.tiled_mlp:
        flops += mlp_flops(info)
    return flops


def _stored_bytes(info: ModelInfo, lp: int) -> float:
    """The parameters' bytes as stored: packed where quantized, the training precision otherwise."""
    q = info.quantized
    if not q:
        return info.params * lp
    return (info.params - q.elements) * lp + q.elements * q.packed + q.state_bytes()
