"""The second axis: the levers that shrink activations rather than model states, and the order they
are tried in.

A `Levers` is one setting of all of them: Ulysses sequence parallelism of degree `sp` (each rank holds
seq_len / sp of every sequence; DeepSpeed's `ulysses_sp`), the tiled loss (`model.chunked_loss`), the
tiled MLP (`model.tiled_mlp`: DeepSpeed's TiledMLP, the MLP recomputed in shards in backward),
activation checkpointing, and checkpointed activations offloaded to host memory
(`model.offload_activations`). What the experiment sets is fixed; `auto` lets the planner choose.
`lever_sets` yields every allowed setting cheapest first: fewest levers on, then the cheaper ones
(the tiled loss costs nothing measurable, then the tiled MLP's recompute, sequence parallelism's
all-to-alls, checkpointing's recompute of whole layers, the host copies), then the smaller degree. The
planner (search.py) times every setting on every rung and takes the fastest that fits; this order breaks
its ties and is the order the run-time escalation climbs past the last rung.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trainer.common.errors import UserError
from trainer.config import Experiment, chunked_loss_problem
from trainer.strategy.batch import SP_DEGREES, keeps, sp_degrees
from trainer.strategy.planning.candidates import ModelInfo

# Why a mixture of experts' MLP is not tiled (measured on CPU, review of issue 68): DeepSpeed's TiledMLP calls the
# block on 2-D shards in backward, which Qwen3-MoE's and Mixtral's blocks cannot unpack (they take 3 dimensions),
# gpt-oss's block returns a tuple, and the routers' logits for the auxiliary loss would be recorded shard by shard,
# without their gradient
UNTILED = (
    "a mixture of experts' MLP cannot be tiled (DeepSpeed's TiledMLP calls it on 2-D shards in backward, which "
    "Qwen3-MoE's and Mixtral's blocks cannot take, gpt-oss's returns a tuple, and the routers' logits would be "
    "recorded shard by shard, without their gradient)"
)
# Why the tiled loss is not taken under tensor parallelism (review of issue 70: every rank stopped at the first step,
# "index 256 is out of bounds for dimension 1 with size 129")
TP_TILED = (
    "the tiled loss multiplies by the LM head's weight, which AutoTP divides by the vocabulary (a rank holds 129 of "
    "257 rows), and looks its targets up in the whole vocabulary"
)
# the levers' costs, cheapest first (their order among settings with as many levers on)
COST = {
    "chunked_loss": 1,
    "tiled_mlp": 2,
    "sp": 3,
    "checkpointing": 4,
    "offload": 5,
    "ep": 6,
    "tp": 7,
    "pp": 8,
}
# the model-parallel axes (axes.py): degrees, not switches
DEGREE = {
    "sp": "sequence parallel",
    "tp": "tensor parallel",
    "ep": "expert parallel",
    "pp": "pipeline stages",
}
__all__ = ["COST", "SP_DEGREES", "Levers", "lever_sets", "sp_problem", "tiled_loss_by_default"]


@dataclass(frozen=True)
class Levers:
    """One setting of the activation levers."""

    sp: int = 1
    chunked_loss: bool = False
    tiled_mlp: bool = False
    checkpointing: bool = False
    offload: bool = False  # checkpointed activations on the host (needs checkpointing)
    tp: int = 1  # tensor parallelism (AutoTP): a group of tp ranks divides each layer, reading the same rows
    ep: int = 1  # expert parallelism (AutoEP): a group of ep ranks divides each MoE layer's experts
    pp: int = 1  # pipeline stages (DeepSpeed's pipeline engine): pp ranks hold the layers in sequence

    @property
    def on(self) -> list[str]:
        return [k for k in COST if (getattr(self, k) > 1 if k in DEGREE else getattr(self, k))]

    @property
    def mp(self) -> int:
        """The ranks that read the same rows: a sequence-parallel group x a tensor-parallel group x a pipeline's
        stages (its first stage reads the inputs, its last the labels)."""
        return self.sp * self.tp * self.pp

    @property
    def cost(self) -> tuple[int, int, int]:
        return len(self.on), sum(COST[k] for k in self.on), self.sp * self.tp * self.ep * self.pp

    def covers(self, other: Levers) -> bool:
        """Every lever `other` has on is on here too, at least at its degree (a model-parallel degree: the same)."""
        return (self.sp >= other.sp and (self.tp, self.ep, self.pp) == (other.tp, other.ep, other.pp)
                and all(getattr(self, k) for k in other.on if k not in DEGREE))  # fmt: skip

    def describe(self) -> str:
        names = {"chunked_loss": "tiled loss", "tiled_mlp": "tiled MLP", "checkpointing": "activation checkpointing",
                 "offload": "checkpointed activations on the host"}  # fmt: skip
        parts = [f"{DEGREE[k]} {getattr(self, k)}" if k in DEGREE else names[k] for k in self.on]
        return ", ".join(parts) or "none"

    def overrides(self) -> list[str]:
        """The --set overrides the supervisor's escalation adds for this setting: the levers on (a
        lever off keeps what the experiment says, so a later attempt may still climb to it)."""
        pins = [f"strategy.sequence_parallel={self.sp}"] if self.sp > 1 else []
        pins += [
            f"strategy.{DEGREE[k].replace(' ', '_')}={getattr(self, k)}"
            for k in ("tp", "ep", "pp")
            if k in self.on
        ]
        keys = {"chunked_loss": "model.chunked_loss", "tiled_mlp": "model.tiled_mlp",
                "checkpointing": "model.activation_checkpointing", "offload": "model.offload_activations"}  # fmt: skip
        return pins + [f"{keys[k]}=true" for k in self.on if k not in DEGREE]


def sp_problem(info: ModelInfo, sp: int, world_size: int, seq_len: int, attn: str | None) -> str | None:
    """Why sequence parallelism of degree `sp` cannot run this job (None: it can): the kernel, the
    family (trainer/model/sequence.py's check), the heads (DeepSpeed splits query heads, and key/value
    heads or replicates them), the sequence, the ranks."""
    if attn == "eager":
        return (
            "eager attention materialises the whole score matrix, which DeepSpeed's Ulysses refuses; use sdpa"
        )
    if info.ulysses:
        return f"model type '{info.model_type}': {info.ulysses}"
    heads, kv = info.heads or 0, info.kv_heads or info.heads or 0
    if heads % sp:
        return f"the model's {heads} attention heads do not divide by {sp}"
    if kv and kv % sp and sp % kv:
        return f"the model's {kv} key/value heads and {sp} divide neither way (DeepSpeed splits or replicates them)"
    if seq_len % sp:
        return f"data.seq_len {seq_len} does not divide by {sp}"
    if world_size % sp:
        return f"{world_size} rank(s) are not a multiple of {sp}"
    return None


def _choices(setting: Any, allowed: bool) -> list[bool]:
    if setting == "auto":
        return [False, True] if allowed else [False]
    return [bool(setting)]


def tiled_loss_by_default(exp: Experiment, info: ModelInfo, device_type: str, precision: str) -> bool:
    """model.chunked_loss: auto is on from the start on CPU in bf16 where the model allows it: there the
    tiled loss is the fast path, not a memory lever (its products run in fp32 on CPUs without AVX-512's
    bf16 kernels, where the whole logits' bf16 products are 3-14x slower; 1.4x faster on AVX-512 too;
    trainer/model/loss.py, BENCHMARKS.md)."""
    return (
        exp.model.chunked_loss == "auto"
        and device_type == "cpu"
        and precision == "bf16"
        and _tiled_loss_allowed(exp, info)
    )


def _tiled_loss_allowed(exp: Experiment, info: ModelInfo) -> bool:
    # a preference objective needs each response's log-prob, which the tiled loss does not give
    sft = exp.train.objective == "sft"
    problem = info.chunked_problem or chunked_loss_problem(info.model_type)
    return sft and exp.model.factory is None and not problem


def _keeping(exp: Experiment, world_size: int, sps: list[int]) -> list[int]:
    """The degrees of `sps` whose data-parallel ranks (world / sp) keep train.global_batch_size at the micro
    batch (strategy/batch.py: the global batch is kept whatever the degree); a UserError when none does."""
    t = exp.train
    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else 1
    kept = [d for d in sps if keeps(exp, world_size, d, micro)]
    if not kept:
        ranks = " or ".join(str(world_size // d) for d in sps)
        raise UserError(
            f"train.global_batch_size {t.global_batch_size} is not a multiple of micro_batch_size {micro} x {ranks} "
            f"data-parallel rank(s) (world {world_size} / the sequence-parallel degree this job can take: "
            f"{', '.join(map(str, sps))}); give a global batch they divide, or micro_batch_size: auto"
        )
    return kept


def lever_sets(
    exp: Experiment, info: ModelInfo, world_size: int, device_type: str, precision: str = "",
    axes: tuple[list[int], ...] = ([1], [1]),
) -> Iterator[Levers]:  # fmt: skip
    """Every setting of the levers the experiment allows, cheapest first (see the module docstring);
    `axes`: the tensor- and expert-parallel degrees it may take (axes.py's `degrees`), and the stage counts
    (stages.py's)."""
    m, s = exp.model, exp.strategy
    transformers_model = m.factory is None
    chunked = (
        [True]
        if tiled_loss_by_default(exp, info, device_type, precision)
        else _choices(m.chunked_loss, _tiled_loss_allowed(exp, info))
    )
    if m.tiled_mlp is True and info.experts:
        raise UserError(f"model.tiled_mlp: {UNTILED}; set model.tiled_mlp: false (or auto)")
    tiled = _choices(m.tiled_mlp, transformers_model and not info.experts)
    checkpointing = _choices(m.activation_checkpointing, True)
    offload = _choices(m.offload_activations, device_type == "cuda")
    # sequence parallelism runs sdpa where auto would have picked eager (CPU, bf16, short sequences)
    attn = (
        "sdpa"
        if info.attn_implementation == "eager" and m.attn_implementation == "auto"
        else info.attn_implementation
    )
    sps = sp_degrees(exp, world_size)
    if s.sequence_parallel == "auto":
        sps = [d for d in sps if d == 1 or not sp_problem(info, d, world_size, exp.data.seq_len, attn)]
    elif sps[0] > 1:
        problem = sp_problem(info, sps[0], world_size, exp.data.seq_len, attn)
        if problem:
            fix = (
                "set it to 1 (off)"
                if info.ulysses and problem.endswith(info.ulysses)
                else "give a degree that divides the ranks, the attention heads and data.seq_len, or 1 (off), or auto"
            )
            raise UserError(f"strategy.sequence_parallel: {sps[0]} cannot run this job: {problem}; {fix}")
    tps, eps, pps = (*axes, [1])[:3]
    if tps[0] > 1 and m.chunked_loss is True:
        raise UserError(f"model.chunked_loss: {TP_TILED}; set model.chunked_loss: false (or auto), or "
                        "strategy.tensor_parallel: 1")  # fmt: skip
    if (tps[0] > 1 or pps[0] > 1) and m.chunked_loss == "auto":
        # the tiled loss by default on CPU in bf16 (tiled_loss_by_default): not under AutoTP or pipeline stages
        chunked = [False]
    if sps[0] > 1 and (tps[0] > 1 or eps[0] > 1):
        key = "strategy.tensor_parallel" if tps[0] > 1 else "strategy.expert_parallel"
        raise UserError(f"{key}: {max(tps[0], eps[0])} with strategy.sequence_parallel: {sps[0]} is not verified "
                        "here (each axis is trained against one rank alone); set one of them to 1")  # fmt: skip
    if len(tps) == len(pps) == 1 and tps[0] > 1 and pps[0] > 1 and world_size % (tps[0] * pps[0]):
        raise UserError(f"strategy.pipeline_stages: {pps[0]} x strategy.tensor_parallel: {tps[0]} ranks hold one copy "
                        f"of the model, and {world_size} rank(s) are not a multiple of {tps[0] * pps[0]}; give "
                        "degrees whose product divides the ranks")  # fmt: skip
    sps = _keeping(exp, world_size, sps)
    micro = exp.train.micro_batch_size if isinstance(exp.train.micro_batch_size, int) else 1
    sets = {
        Levers(sp, c, t, k, o, tp, ep, pp)
        for sp, c, t, k, o, tp, ep, pp in itertools.product(
            sps, chunked, tiled, checkpointing, offload, tps, eps, pps
        )
        if (k or not o)  # the host copy is of checkpointed activations
        and (sp == 1 or tp == ep == 1)  # one model-parallel axis at a time (verified alone)
        and (pp == 1 or sp == ep == 1)  # (tensor parallelism inside a stage: 3D)
        and world_size % (sp * tp * pp) == 0
        and not ((tp > 1 or pp > 1) and c)  # the tiled loss needs the LM head whole (TP_TILED) and the logits
        and (tp == pp == 1 or keeps(exp, world_size, sp * tp * pp, micro))
    }
    if not sets:
        raise UserError(f"train.global_batch_size {exp.train.global_batch_size} is not a multiple of micro_batch_size "
                        f"{micro} x the data-parallel ranks of world {world_size} / strategy.tensor_parallel "
                        f"{tps[0]} / strategy.pipeline_stages {pps[0]}; give a global batch they divide, or "
                        "micro_batch_size: auto")  # fmt: skip
    yield from sorted(sets, key=lambda x: x.cost)
