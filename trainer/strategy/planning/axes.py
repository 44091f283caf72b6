"""The model-parallel axes: tensor parallelism through DeepSpeed's AutoTP and expert parallelism through its
AutoEP, what each divides, what each costs, and when the plan may take it.

What AutoTP divides (DeepSpeed 0.19.8 in training mode, read from the shards it makes; tests/dist/test_axes.py
holds these counts to its real partitioning): every decoder layer's attention projections (q, k, v by their
heads, o by its input) and MLP projections (gate and up by their outputs, down by its input), and the LM
head by the vocabulary, its logits gathered whole again (`gather_output`); a tied input embedding shares the
head's shard. Norms, an untied input embedding and the routers stay whole on every rank. A rank of a tensor-
parallel group is a model of heads / tp, key/value heads / tp and an MLP of intermediate / tp, on the whole
batch of its group (every rank of the group reads the same rows); ZeRO partitions what it holds over the
data-parallel ranks, world / tp.

What AutoEP divides: each MoE layer's routed experts, routed / ep a rank; everything else stays whole. ZeRO
partitions the experts over the ranks holding the same experts (world / ep) and the rest over the world, so
that the partitioned states (ZeRO-1 and up) are those of the model without it, and only what every rank
holds whole (its parameters at stages 0-2, its gradients at 0-1, the gathered layer at 3) shrinks. Every rank
still reads its own rows (the data-parallel world is unchanged); the routed tokens travel to their experts and
back by all-to-all.

The rule (the seed's): tensor parallelism for very large models across fast interconnects. `auto` offers a
degree only inside a node whose link between devices is NVLink-class, and the plan takes it only where it is
the fastest setting that fits or nothing fits without it (search.py's rules, as for every costlier setting);
expert parallelism likewise inside a node over NVLink-class links. A pinned degree runs where it can, and is
refused, with the key and the fix, where it cannot.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer.common.errors import UserError
from trainer.strategy.planning.candidates import ModelInfo

DEGREES = (2, 4, 8)  # the degrees `auto` tries (inside a node)
# Why ZeRO-3 is not taken under tensor parallelism (review of issue 70, measured with DeepSpeed 0.19.8): it trains
# (TP 2 = TP 1 at ZeRO-3 to 4e-7), but its checkpoints cannot be read back whole or converted
TP_ZERO3 = (
    "tensor parallelism at ZeRO-3 writes checkpoints DeepSpeed 0.19.8 cannot read whole (zero_to_fp32: "
    '"consumed 61888 numels out of 53504"; ds_to_universal: "start (0) + length (16448) exceeds dimension size '
    '(8224)"), so bin/export and a resume at another degree would fail'
)
NVLINK_CLASS = 100e9  # bytes a second between a node's devices from which a link counts as NVLink-class

# Families AutoTP shards as transformers builds them, checked on two CPU ranks (the one-rank losses): the
# decoder layers' q/k/v/o and gate/up/down projections by name. GPT-2 is refused by DeepSpeed itself ("AutoTP
# not supported for model. Please use kernel injection": it has an inference container policy).
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# AutoEP's presets (deepspeed/module_inject/auto_ep_presets) this project has trained against one rank
EP_FAMILIES = ("mixtral", "qwen3_moe")


def _attention(info: ModelInfo) -> int:
    """A layer's attention projection weights: queries, keys, values, output."""
    h = info.hidden or 0
    kv = info.kv_count * info.qk_head_dim + info.kv_count * info.value_head_dim
    return h * info.q_width + h * kv + (info.heads or 1) * info.value_head_dim * h


def tp_divided(info: ModelInfo) -> int:
    """The parameters AutoTP divides among a tensor-parallel group (the module docstring): the layers'
    attention and MLP projections (the query, key and value biases with them) and the LM head (with a tied
    embedding, which shares it)."""
    h, layers = info.hidden or 0, info.layers or 0
    mlp = (3 if info.intermediate else 2) * h * (info.intermediate or 4 * h)
    return layers * (_attention(info) + mlp + info.qkv_bias) + (info.vocab or 0) * h


def expert_params(info: ModelInfo) -> int:
    """A mixture's routed experts' parameters (gated: gate, up, down a expert)."""
    e = info.experts
    return 0 if e is None else e.layers * e.routed * 3 * (info.hidden or 0) * e.width


def parallel_degrees(config: Any) -> tuple[int, int]:
    """(tensor parallel, expert parallel) a DeepSpeed JSON asks for: tensor_parallel.autotp_size (0 or absent:
    off) and expert_parallel.autoep_size where expert_parallel.enabled is true (DeepSpeed's default: off)."""
    config = config or {}
    tp = int((config.get("tensor_parallel") or {}).get("autotp_size") or 1)
    ep_section = config.get("expert_parallel") or {}
    ep = int(ep_section.get("autoep_size") or 1) if ep_section.get("enabled") is True else 1
    return max(1, tp), max(1, ep)


def local_info(info: ModelInfo, tp: int = 1, ep: int = 1) -> ModelInfo:
    """One rank's model under tensor parallelism `tp` and expert parallelism `ep` (the module docstring):
    its parameters, its heads and MLP width (what its activations and FLOPs are counted from)."""
    if tp == 1 and ep == 1:
        return info
    h = info.hidden or 0
    head = (info.vocab or 0) * h  # divided by the vocabulary, unevenly where it does not divide (the first
    # ranks a row more: 257 as 129 and 128): the largest share, rank 0's
    layers = tp_divided(info) - head
    params = info.params - layers + layers // tp - head + -(-(info.vocab or 0) // tp) * h
    params -= expert_params(info) * (ep - 1) // ep
    sizes = tuple(sorted(s if s <= h else s // tp for s in info.param_sizes)) if tp > 1 else info.param_sizes
    largest = info.largest_layer // tp
    if ep > 1 and info.experts is not None:  # the largest module: a layer's experts, now routed / ep of them
        largest = max(info.largest_layer - expert_params(info) // info.experts.layers * (ep - 1) // ep,
                      (info.vocab or 0) * h)  # fmt: skip
    local = dataclasses.replace(
        info, params=params, largest_layer=max(1, largest), param_sizes=sizes,
        heads=(info.heads or 0) // tp or None, kv_heads=(info.kv_heads // tp if info.kv_heads else None),
        intermediate=(info.intermediate // tp if info.intermediate else None),
    )  # fmt: skip
    # (a token's active parameters, a mixture's top-k experts, are as many under expert parallelism, and a rank's
    # experts see as many routed tokens on average: the experts' activations are the model's; the looked-up
    # embeddings, `idle`, stay whole under tensor parallelism unless tied to the head, which multiplies)
    return local


def rank_model(info: ModelInfo, tp: int, ep: int, pp: int, seq_len: int) -> ModelInfo:
    """One rank's model: under tensor or expert parallelism (`local_info`), or the largest pipeline stage, under
    both (3D) its rank's share: its parameters counted item by item (stages.item_params: the embedding whole on
    the first stage, an untied head divided on the last), its heads and widths divided as `local_info` divides
    them."""
    if pp > 1:
        from trainer.strategy.planning.stages import stage_info

        divided = (tp_divided(info) - (info.vocab or 0) * (info.hidden or 0)) // max(1, info.layers or 1)
        stage = stage_info(info, pp, seq_len, tp, divided if tp > 1 else 0)
        if tp == 1:
            return stage
        return dataclasses.replace(local_info(stage, tp, 1), params=stage.params, trainable=stage.trainable)
    return local_info(info, tp, ep)


def axes_reason(levers: Any, found: Any) -> str:
    """The seed's 'always justify' for a model-parallel axis the plan took: the fastest setting without it."""
    if levers.tp == levers.ep == levers.pp == 1:
        return ""
    plain = next((f for f in found.fits if f.levers.tp == f.levers.ep == f.levers.pp == 1
                  and not (found.device_only and f.offloads)), None)  # fmt: skip
    if plain is None:
        return "; nothing fits without tensor or expert parallelism or pipeline stages"
    return (
        f"; without tensor or expert parallelism or pipeline stages the fastest that fits is {plain.candidate.name} "
        f"with {plain.levers.describe()}, {plain.time.per_token * 1e6:.1f} us a token"
    )


def refuse_zero3(estimates: list[Any], tp: int) -> list[Any]:
    """The ZeRO-3 rungs refused under tensor parallelism (TP_ZERO3), the others as they are."""
    if tp == 1:
        return estimates
    return [dataclasses.replace(e, refused=TP_ZERO3, fits_device=False) if e.candidate.stage == 3 else e
            for e in estimates]  # fmt: skip


def zero_world(info: ModelInfo, local: ModelInfo, world: int, tp: int, ep: int) -> float:
    """The ranks ZeRO partitions one rank's model over, as one figure for states.py (P_local / n = what a
    rank holds partitioned): world / tp under tensor parallelism; under expert parallelism the experts are
    partitioned over world / ep ranks and the rest over the world, which is the model's own parameters over
    the world: n = world x P_local / P."""
    if ep > 1:
        return world * local.params / max(1, info.params)
    return max(1, world // tp)


def nvlink_class(peers: float) -> bool:
    return peers >= NVLINK_CLASS


def tp_problem(info: ModelInfo, tp: int, world: int, gpus_per_node: int) -> str | None:
    """Why tensor parallelism of degree `tp` cannot run this job (None: it can)."""
    if info.model_type not in TP_FAMILIES:
        return (
            f"model type '{info.model_type}' is not one AutoTP has been verified on here "
            f"({', '.join(TP_FAMILIES)}; GPT-2 DeepSpeed refuses, a mixture's experts are expert parallelism's)"
        )
    if info.experts is not None:
        return "a mixture of experts is divided by expert parallelism (strategy.expert_parallel), not AutoTP"
    for what, n in (("attention heads", info.heads), ("key/value heads", info.kv_heads or info.heads),
                    ("MLP's intermediate size", info.intermediate)):  # fmt: skip
        if n and n % tp:
            return f"the model's {n} {what} do not divide by {tp}"
    if world % tp:
        return f"{world} rank(s) are not a multiple of {tp}"
    if tp > gpus_per_node or gpus_per_node % tp:
        return (
            f"a tensor-parallel group of {tp} would cross nodes of {gpus_per_node} rank(s) (its all-reduces run "
            "twice a layer in each pass: inside a node only)"
        )
    return None


def ep_problem(info: ModelInfo, ep: int, world: int, precision: str) -> str | None:
    """Why expert parallelism of degree `ep` cannot run this job (None: it can)."""
    if info.experts is None:
        return f"model type '{info.model_type}' is dense: it has no experts to divide"
    if info.model_type not in EP_FAMILIES:
        return (
            f"model type '{info.model_type}' has no AutoEP preset verified here ({', '.join(EP_FAMILIES)}; "
            "DeepSpeed's presets also name Qwen3.5-MoE and DeepSeek-V2/V3, untrained here)"
        )
    if info.experts.routed % ep:
        return f"the model's {info.experts.routed} experts a layer do not divide by {ep}"
    if world % ep:
        return f"{world} rank(s) are not a multiple of {ep}"
    if precision != "bf16":
        return (
            f"AutoEP trains in bf16 (its grouped expert kernels), and train.precision resolves to {precision}"
        )
    return None


def degrees(
    exp: Any,
    info: ModelInfo,
    world: int,
    gpus_per_node: int,
    peers: float,
    precision: str,
    template: Any = None,
    large: bool = True,
    device_type: str = "cuda",
) -> tuple[list[int], list[int]]:
    """The tensor- and expert-parallel degrees the plan may choose from: a pinned degree (the experiment's,
    else its DeepSpeed template's), checked; under auto 1, and inside a node over NVLink-class links each
    degree of DEGREES that can run this job, tensor parallelism only for a `large` model (the seed's "very
    large models": one whose states at ZeRO-0 do not fit a device; a smaller one's layers would be split
    into narrower products for what data parallelism does without). A UserError names the key and the fix
    for a pin that cannot."""
    s = exp.strategy
    tp_pin, ep_pin = s.tensor_parallel, s.expert_parallel
    section = template or {}
    if tp_pin == "auto" and isinstance(section.get("tensor_parallel"), dict):
        tp_pin = section["tensor_parallel"].get("autotp_size", "auto")
        tp_pin = 1 if tp_pin == 0 else tp_pin  # DeepSpeed's own default, 0: off
    if ep_pin == "auto" and isinstance(section.get("expert_parallel"), dict):
        ep_section = section["expert_parallel"]
        if "enabled" not in ep_section and ep_section.get("autoep_size", 1) != 1:
            raise UserError(
                f"strategy.deepspeed: expert_parallel.autoep_size {ep_section['autoep_size']} without "
                "expert_parallel.enabled, which DeepSpeed reads as false (it would ignore the size); add "
                '"enabled": true, or remove the section and set strategy.expert_parallel'
            )
        ep_pin = ep_section.get("autoep_size", "auto") if ep_section.get("enabled") is True else 1
    fast = (
        device_type == "cuda"
        and nvlink_class(peers)
        and exp.train.objective == "sft"
        and exp.model.lora is None
    )
    out = []
    for key, pin, problem, offered in (
        (
            "strategy.tensor_parallel",
            tp_pin,
            lambda d: tp_problem(info, d, world, gpus_per_node),
            fast and large,
        ),
        ("strategy.expert_parallel", ep_pin, lambda d: ep_problem(info, d, world, precision), fast),
    ):
        if pin == "auto":
            inside = [d for d in DEGREES if d <= min(world, gpus_per_node) and gpus_per_node % d == 0]
            out.append([1] + ([d for d in inside if not problem(d)] if offered else []))
            continue
        pin = int(pin)
        why = problem(pin) if pin > 1 else None
        if why:
            divides = "divide" in why or "nodes" in why or "multiple" in why
            fix = (
                "give a degree that divides them inside a node, or 1 (off)"
                if divides
                else "set it to 1 (off)"
            )
            raise UserError(f"{key}: {pin} cannot run this job: {why}; {fix}")
        out.append([pin])
    return out[0], out[1]


def axes_seconds(
    info: ModelInfo, tp: int, ep: int, tokens: float, passes: int, lp: int, m: Any, node: int
) -> float:
    """The seconds a micro step's tensor- and expert-parallel collectives take (`tokens`: a rank's), on
    `m`'s links (`node`: ranks a node). AutoTP: two all-reduces of a token's hidden state a layer in each
    pass (after the attention's output projection and the MLP's down projection; the column layers' input
    gradients in backward), and the LM head's logits gathered in the forward (and their gradient's shard
    in backward). AutoEP: a layer's routed tokens (top-k copies of the hidden state) to their experts and
    back, an all-to-all each way in each pass."""
    h, layers, seconds = info.hidden or 0, info.layers or 0, 0.0
    if tp > 1:
        volume = 2 * layers * passes * tokens * h * lp * 2 * (tp - 1) / tp  # ring all-reduce: twice the data
        volume += 2 * tokens * (info.vocab or 0) * lp * (tp - 1) / tp
        seconds += volume / m.peers + (2 * layers * passes + 2) * m.collective_s
    if ep > 1 and info.experts is not None:
        e = info.experts
        volume = 2 * e.layers * passes * tokens * e.per_token * h * lp * (ep - 1) / ep
        link = m.peers if ep <= node and node % ep == 0 else m.network
        seconds += volume / link + 2 * e.layers * passes * m.collective_s
    return seconds


def layout(world: int, sp: int = 1, tp: int = 1, ep: int = 1, pp: int = 1) -> str:
    """'dp D x tp T x ep E x sp S' and the process groups: a sequence- or tensor-parallel group is consecutive
    ranks (DeepSpeed's (data, tensor) mesh and Ulysses' groups); the data-parallel ranks are one of each; an
    expert-parallel group is consecutive ranks too (DeepSpeed's expert groups), its experts' data-parallel
    ranks one of each group."""
    mp = sp * tp
    dp = world // (mp * pp)
    text = f"dp {dp} x tp {tp}" + (f" x pp {pp}" if pp > 1 else "") + f" x ep {ep} x sp {sp}"

    def show(made: list[list[int]]) -> str:
        shown = ", ".join(str(x).replace(" ", "") for x in made[:4])
        return shown + (f", ... ({len(made)})" if len(made) > 4 else "")

    def groups(size: int, stride: int) -> str:
        if stride == 1:
            return show([list(range(g * size, (g + 1) * size)) for g in range(world // size)])
        return show([list(range(g, world, stride)) for g in range(stride)])

    parts = []
    if (
        pp > 1
    ):  # DeepSpeed's pipe-data(-model) topology: the stages outermost, a stage's tensor-parallel ranks innermost
        per = world // pp
        data = [[s * per + d * mp + t for d in range(dp)] for s in range(pp) for t in range(mp)]
        parts.append(f"pipelines {groups(pp, dp * mp)}; data-parallel groups (a stage's) {show(data)}")
        if mp > 1:
            parts.append(f"tensor-parallel groups (a stage's) {groups(mp, 1)}")
    elif mp > 1:
        parts.append(f"{'tensor' if tp > 1 else 'sequence'}-parallel groups {groups(mp, 1)}")
        parts.append(f"data-parallel groups {groups(dp, mp)}")
    if ep > 1:
        parts.append(
            f"expert-parallel groups {groups(ep, 1)}; expert data-parallel groups {groups(world // ep, ep)}"
        )
    return text + (f" ({'; '.join(parts)})" if parts else "")
