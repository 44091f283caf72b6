"""Pipeline stages through DeepSpeed's pipeline engine (`deepspeed.pipe.PipelineModule`, its 1F1B schedule): what a
stage holds, how the model is cut into stages, what the pipeline costs, and when the plan may take it.

The model as a pipeline (trainer/model/stages.py builds it from the transformers model): its token embedding, GPT-2's
position embedding, each decoder layer, the final norm and the LM head, one item each, in order. A tied head is the
embedding again on the last stage (DeepSpeed's TiedLayerSpec: both stages hold it, their gradients summed). The
stages are contiguous runs of items balanced by each item's time (`item_weights`: the FLOPs a token, the layers'
own attention windows and experts), never uniformly by count: a vocabulary's head weighs as several layers. The
embedding stays with the first layer and the final norm with the head (`units`), so every stage holds both
weight-decay groups.

What a stage holds: its items' parameters, their gradients, and at ZeRO-1 its optimizer states partitioned over the
stage's data-parallel ranks (world / stages); ZeRO-2 and 3 DeepSpeed's engine refuses. Under 1F1B the first stage
keeps the activations of min(stages, micro batches) micro batches in flight, the last one's; the plan counts the
largest stage's parameters with the most layers any stage has and the first stage's micro batches in flight (an
upper bound where they are different stages).

What it costs: the bubble, (p - 1) micro steps of the slowest stage idle in each step of m micro batches (p - 1) /
(m + p - 1) of its time, and each boundary's point-to-point transfers, a micro batch's hidden states forward and their
gradient back, over the node's link or the network where the boundary crosses nodes. DeepSpeed's topology puts the
stages outermost (rank = stage x data-parallel ranks + data rank), so stages cross nodes first and each stage's
data-parallel all-reduce stays inside a node where it fits one.

The rule (the seed's: pipeline parallel when tensor parallel alone is not enough): `auto` offers stages on GPUs for a
model whose ZeRO-0 states do not fit a device, and the plan takes them only where they are the fastest setting that
fits or nothing fits without them (search.py's rules, as for every costlier setting). A pinned count runs where it
can and is refused, with the key and the fix, where it cannot.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer.common.errors import UserError
from trainer.strategy.planning.candidates import ModelInfo

DEGREES = (2, 4, 8)  # the stage counts `auto` tries
# the families whose stages train as the whole model does (PP 2 = PP 1 on two CPU ranks, tests/dist/test_pipeline.py;
# one rank's items against the model's forward, tests/unit/test_pipeline_plan.py): their decoder layers take the hidden
# states, the position ids and the family's own masks and rotary embeddings, which each layer recomputes
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3_text", "phi3", "gpt2", "olmo2",
            "gpt_oss", "deepseek_v3")  # fmt: skip
PP_ZERO = (
    "DeepSpeed's pipeline engine refuses ZeRO-2 and 3 (\"ZeRO-2 and ZeRO-3 are incompatible with pipeline "
    "parallelism\"): a stage's gradients are reduced once a step, after its micro batches"
)
# Why ZeRO-0 is not a rung in bf16 under stages (review of issue 71, measured on 2 CPU ranks): DeepSpeed's pipeline
# engine then takes its BF16_Optimizer, whose gradients accumulate in bf16
PP_BF16 = (
    "without ZeRO DeepSpeed's pipeline engine trains bf16 through its BF16_Optimizer, which accumulates the micro "
    "batches' gradients in bf16 (GPT-2's losses 1.5% off one rank's at step 3) and whose checkpoints do not load "
    "back (KeyError in _load_legacy_checkpoint); ZeRO-1 trains as one rank does"
)
PP_ROUTER = (
    "a mixture's auxiliary loss sums every layer's router logits, which the stages hold apart (DeepSpeed's pipeline "
    "passes hidden states between them, not the routers' logits)"
)


def kinds(info: ModelInfo) -> list[str]:
    """The pipeline's items in order (trainer/model/stages.py builds one module each)."""
    positions = ["positions"] if info.model_type == "gpt2" else []
    return ["tokens", *positions, *(["layer"] * (info.layers or 0)), "norm", "head"]


def _embedding(info: ModelInfo) -> int:
    return (info.vocab or 0) * (info.hidden or 0)


def item_params(info: ModelInfo, tp: int = 1, divided: int = 0) -> list[int]:
    """Each item's parameters a rank holds (a tied head: the embedding again, which the last stage holds too).
    Under tensor parallelism inside the stages (3D), as trainer/model/stages.py's AutoTP plan divides them: a
    layer's projections (`divided` of its parameters, axes.tp_divided's share a layer) and an untied head by
    `tp`; the embeddings, the norms and a tied head whole."""
    h, e = info.hidden or 0, _embedding(info)
    pos = (info.positions or 0) * h if info.model_type == "gpt2" else 0
    layers = max(1, info.layers or 1)
    layer = max(0, info.params - e * (1 if info.tied else 2) - pos - h) // layers
    head = e if info.tied or tp == 1 else -(-(info.vocab or 0) // tp) * h
    layer -= min(divided, layer) - -(-min(divided, layer) // tp)
    table = {"tokens": e, "positions": pos, "layer": layer, "norm": h, "head": head}
    return [table[k] for k in kinds(info)]


def item_weights(info: ModelInfo, seq_len: int) -> list[float]:
    """Each item's FLOPs a token of a training step (forward, the activations' and the weights' gradients): a layer's
    share of the parameters a token multiplies by and its own attention (window and all), the head's product with
    the vocabulary; the embeddings' look-ups and the norm nothing measurable."""
    h, e = info.hidden or 0, _embedding(info)
    heads, hd, vd = info.heads or 0, info.qk_head_dim, info.value_head_dim
    layers = max(1, info.layers or 1)
    dense = max(0, (info.active or info.params) - info.idle - e) / layers  # a layer's share, less the head
    out, i = [], 0
    for k in kinds(info):
        if k == "layer":
            w = info.windows[i] if i < len(info.windows) else 0
            out.append(6 * dense + 6 * heads * (hd + vd) * (min(seq_len, w) if w else seq_len))
            i += 1
        else:
            out.append(6.0 * e if k == "head" else float(h))
    return out


def balanced(weights: list[float], parts: int) -> list[int]:
    """Contiguous parts of `weights` whose largest sum is the least (each part at least one item): the bounds,
    parts + 1 of them, as DeepSpeed's PipelineModule takes them (`parts` property)."""
    n = len(weights)
    if parts > n:
        raise ValueError(f"{parts} parts of {n} items")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the least largest part of the first i items in k parts; cut[k][i]: where its last part starts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-9:
                    best[k][i], cut[k][i] = v, j
    bounds, i = [n], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def units(info: ModelInfo) -> list[int]:
    """The items a stage takes whole, as counts: the embeddings with the first layer, each other layer, the final norm
    with the head. A stage then holds both of param_groups' groups, the matrices (decayed) and the norms (not): a
    stage of the head alone, or of the norm alone, has one, and DeepSpeed's pipeline engine hangs at ZeRO-1 (its
    checkpoint waits on the group the stage lacks; found by the review of issue 71: 1-layer Llama at 2 stages)."""
    first = len(kinds(info)) - (info.layers or 0) - 2  # tokens (and GPT-2's positions)
    layers = max(1, info.layers or 1)
    return [first + 1, *([1] * (layers - 1)), 2]


def bounds(info: ModelInfo, pp: int, seq_len: int) -> list[int]:
    """The stages' bounds over the items, balanced by time over `units` (whole)."""
    sizes, weights = units(info), item_weights(info, seq_len)
    starts = [sum(sizes[:u]) for u in range(len(sizes) + 1)]
    grouped = [sum(weights[starts[u] : starts[u + 1]]) for u in range(len(sizes))]
    return [starts[u] for u in balanced(grouped, pp)]


def describe(info: ModelInfo, parts: list[int]) -> str:
    """The partition as the banner shows it: each stage's items, e.g. 'stage 0: tokens, layers 0-3; ...'."""
    ks, out = kinds(info), []
    for s in range(len(parts) - 1):
        names, layer0 = [], sum(1 for k in ks[: parts[s]] if k == "layer")
        items = ks[parts[s] : parts[s + 1]]
        n = items.count("layer")
        for k in dict.fromkeys(items):
            if k == "layer":
                names.append(f"layer {layer0}" if n == 1 else f"layers {layer0}-{layer0 + n - 1}")
            else:
                names.append(k)
        out.append(f"stage {s}: {', '.join(names)}")
    return "; ".join(out)


def stage_info(info: ModelInfo, pp: int, seq_len: int, tp: int = 1, divided: int = 0) -> ModelInfo:
    """The largest stage as a model of its own (the module docstring): the most parameters a stage's rank holds
    (3D: `item_params`' shares, each stage's own items: the first holds the embedding whole, a middle one no head),
    the most layers a stage runs (their activations, FLOPs and launches)."""
    if pp == 1:
        return info
    parts, params = bounds(info, pp, seq_len), item_params(info, tp, divided)
    ks = kinds(info)
    held = max(sum(params[parts[s] : parts[s + 1]]) for s in range(pp))
    layers = max(ks[parts[s] : parts[s + 1]].count("layer") for s in range(pp))
    share = layers / max(1, info.layers or 1)
    trainable = None if info.trainable is None else int(info.trainable * held / max(1, info.params))
    return dataclasses.replace(
        info, params=held, trainable=trainable, layers=layers,
        active=None if info.active is None else int(info.active * share),
        idle=0, layer_windows=info.windows[:layers],
    )  # fmt: skip


def in_flight(pp: int, accum: int) -> int:
    """Micro batches whose activations the first stage holds at once under 1F1B."""
    return max(1, min(pp, accum))


def stage_activations(count: Any, info: ModelInfo, pp: int, accum: int) -> int:
    """A stage's activation bytes (`count`: activations.py's for a model): its layers' for the micro batches in
    flight on the first stage, and the logits' for one micro batch (the last stage computes the loss as each
    arrives)."""
    whole = count(info)
    if pp == 1:
        return whole
    layers = count(dataclasses.replace(info, vocab=None))
    return layers * in_flight(pp, accum) + (whole - layers)


def bubble(pp: int, accum: int) -> float:
    """The share of a step a stage idles: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (accum + pp - 1)


def p2p_seconds(
    info: ModelInfo, pp: int, accum: int, tokens: float, lp: int, m: Any, world: int, node: int
) -> float:
    """A step's point-to-point transfers on the critical path: each micro batch's hidden states (`tokens` a micro
    batch on a rank) forward and their gradient back across each of the p - 1 boundaries, as the schedule lays them
    out ((m + p - 1) slots of each), over the network where a boundary crosses nodes (stages outermost: a stage of
    world / p ranks)."""
    if pp == 1:
        return 0.0
    per_stage = world // pp
    link = m.network if per_stage % node and world > node or per_stage >= node else m.peers
    volume = (
        tokens * (info.hidden or 0) * lp
    )  # (3D too: each tensor rank sends them whole, ds_config.py's _axes)
    return 2 * (accum + pp - 1) * (volume / link + m.collective_s)


def problem(info: ModelInfo, pp: int, world: int) -> str | None:
    """Why `pp` stages cannot run this job (None: they can)."""
    if info.model_type not in FAMILIES:
        return (
            f"model type '{info.model_type}' has not been trained in stages here ({', '.join(FAMILIES)} have: their "
            "decoder layers in sequence, checked against the model without stages)"
        )
    if info.router_logits:
        return PP_ROUTER
    if pp > len(units(info)):
        return (
            f"the model has {info.layers} layers: {len(units(info))} stages at most (the embedding stays with the "
            "first layer and the final norm with the head, so that each stage holds both weight-decay groups)"
        )
    if world % pp:
        return f"{world} rank(s) are not a multiple of {pp}"
    return None


def degrees(exp: Any, info: ModelInfo, world: int, device_type: str, large: bool) -> list[int]:
    """The stage counts the plan may choose from: a pinned count, checked (a UserError with the key and the fix);
    under auto 1, and on GPUs for a `large` model (its ZeRO-0 states do not fit a device) each of DEGREES that can
    run this job."""
    pin = exp.strategy.pipeline_stages
    if pin == "auto":
        offered = device_type == "cuda" and large and exp.train.objective == "sft" and exp.model.lora is None
        return [1] + ([d for d in DEGREES if d <= world and not problem(info, d, world)] if offered else [])
    pin = int(pin)
    why = problem(info, pin, world) if pin > 1 else None
    if why:
        fix = (
            "set model.config.output_router_logits: false (the routers train on the loss alone), or 1 (off)"
            if why == PP_ROUTER
            else "set it to 1 (off)"
            if "trained in stages" in why
            else "give fewer stages that divide the ranks, or 1 (off)"
        )
        raise UserError(f"strategy.pipeline_stages: {pin} cannot run this job: {why}; {fix}")
    if pin > 1:
        _bubble_pin(exp, pin, world)
    return [pin]


def _bubble_pin(exp: Any, pp: int, world: int) -> None:
    """Fewer micro batches a step than stages leave most of each step idle: refused unless justified."""
    from trainer.strategy.batch import accumulation

    m = accumulation(exp, world, pp)
    if m < pp and not exp.strategy.justification.strip():
        raise UserError(
            f"strategy.pipeline_stages: {pp} with {m} micro batch(es) a step: the pipeline's bubble, (p - 1) / "
            f"(m + p - 1), leaves {100 * bubble(pp, m):.0f}% of each step idle on every stage; raise train.grad_accum "
            f"(or train.global_batch_size) to at least {pp} micro batches (4 x {pp} keeps the bubble under 20%), or "
            "say why in strategy.justification"
        )


def refuse_sharded(estimates: list[Any], pp: int, bf16: bool = False) -> list[Any]:
    """ZeRO-2 and 3 refused under pipeline stages (PP_ZERO), and in bf16 ZeRO-0 (PP_BF16), the other rungs as they
    are."""
    if pp == 1:
        return estimates
    out = []
    for e in estimates:
        why = PP_ZERO if e.candidate.stage >= 2 else PP_BF16 if bf16 and e.candidate.stage == 0 else ""
        out.append(dataclasses.replace(e, refused=why, fits_device=False) if why else e)
    return out


def stages_line(info: ModelInfo, pp: int, exp: Any) -> str:
    """The banner's line: each stage's items, and the bubble at this accumulation."""
    parts = bounds(info, pp, exp.data.seq_len)
    m = exp.train.grad_accum
    return (
        f"pipeline: {describe(info, parts)} (balanced by each item's FLOPs a token); bubble "
        f"{100 * bubble(pp, m):.0f}% of a step ({pp} stages, {m} micro batches: (p - 1) / (m + p - 1))"
    )
