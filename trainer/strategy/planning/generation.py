"""What online RL (train.objective: grpo, docs/rl.md) adds to a plan: the rows a micro step trains (the
completions, each its prompt and up to max_new_tokens after it) and the memory generation holds on each rank
while it samples, between two training steps (when the training activations are freed: the peak is the
larger of the two, as for the optimizer step).

Generation (trainer/rl/generate.py) samples train.rl.generation_batch prompts' groups a call (by default all
of a rank's prompts of the step): R = G x those prompts sequences of at most data.seq_len tokens (a prompt
of at most seq_len - max_new_tokens, and its completion; `generation_rows`). It holds

- the key/value cache: keys and values of every layer x R x length x kv_heads x the config's head sizes
  (Qwen3's 128 where hidden / heads is 64), a sliding or chunked layer's for its window only, in the compute
  precision (`kv_cache_bytes`, held against transformers' own cache object);
- while the prompt runs (prefill, no gradients): the prompt's cache, and one layer's activations at a
  time, R x prompt x (2 MLP widths, 3 gated, + ATTENTION_HIDDEN hidden sizes) (and the scores, where
  eager attention materialises them);
- then, a token at a time: the whole cache, one layer's keys or values copied as they grow, the last position's
  logits (`logits_bytes`): R x vocab x 12 bytes (the model's, transformers' fp32 copy, the choice), 4 more where
  temperature, top-k, top-p or min-p make processed scores, and the largest of top-p's sort (16 a row and
  token), min-p's probabilities and mask (5) and the Gumbel noise's int64 and float64 temporaries (24 a row
  and token, for at most NOISE_ELEMENTS pairs at a time).

The peak is the larger of the two phases; calibrated against malloc's live bytes while GPT-2 shapes
sample on CPU (tests/unit/test_grpo_plan.py: GPT-2 and Llama shapes, prefill-bound and decode-bound, within
10%).

A reward model (train.rl.rewards' `function: model`) is held on every rank for the whole run: its weights in
the run's precision (`reward_model_bytes`, among the plan's buffers), and while it scores (after sampling,
when the cache is freed) one layer's activations of options.batch_size rows of data.seq_len tokens at a time.

No reference model is held: beta 0 builds none, and with LoRA the reference is the model with its adapters
off (beta > 0 without LoRA is refused). The old log-probs (num_iterations > 1) and the rollouts are kept on
the host: a step's completions x length x 32 bytes (rows of three int64, two fp32 log-probs; `host_bytes`).
"""

from __future__ import annotations

import functools
from typing import Any

from trainer.strategy.planning.layers import cache_per_token, layer_cache_per_token

# hidden states a prompt token holds at the prefill's peak beside its MLP's, measured (malloc's live bytes
# while sampling on CPU, tests/unit/test_grpo_plan.py): GPT-2's fused c_attn (Conv1D, addmm) and its
# head splits hold 14; Llama's layout (q/k/v/o projections apart, rotary embeddings; Mistral, Qwen2/3
# share it) 4.5, the default
ATTENTION_HIDDEN = {"gpt2": 14.0}


def is_rl(exp: Any) -> bool:
    return exp.train.objective == "grpo"


def row_length(exp: Any) -> int:
    """The tokens of a trained row at most: data.seq_len (grpo: a prompt and its completion, which the stream
    checks at start: the longest prompt + max_new_tokens <= seq_len). Distill's generated steps: seq_len +
    max_new_tokens, a row's tokens and a new answer of its example (the rows' examples and their new answers packed
    into rows of seq_len: one example a row, exact; k a row, up to (k - 1) x max_new_tokens more)."""
    if distill_generates(exp):
        return exp.data.seq_len + exp.train.distill.generation.max_new_tokens
    return exp.data.seq_len


def kv_cache_bytes(info: Any, sequences: int, length: int, lp: int, windowed: bool = True) -> int:
    """The key/value cache of `sequences` rows of `length` tokens: every layer's keys and values (the key/value
    heads x the config's head sizes), a sliding or chunked layer's for its window only once decoding has begun
    (`windowed`; right after the prompt's forward every layer holds the whole prompt: layers.py)."""
    return int(cache_per_token(info, lp, length, windowed) * length * sequences)


def largest_layer_cache(info: Any, sequences: int, length: int, lp: int) -> int:
    """One layer's share of the cache at most (a full-attention layer's, where the others slide)."""
    return int(layer_cache_per_token(info, lp) * sequences * length)


def distill_generates(exp: Any) -> bool:
    """Distillation's on-policy steps or the teacher's completions (trainer/objectives/on_policy.py)."""
    d = exp.train.distill
    return exp.train.objective == "distill" and (d.lmbda > 0 or d.seq_kd)


def _sampling(exp: Any) -> tuple[Any, int]:
    """(what sampling reads: temperature, top_p, top_k, min_p; max_new_tokens) of grpo or distill."""
    if not distill_generates(exp):
        return exp.train.rl, exp.train.rl.max_new_tokens
    from types import SimpleNamespace

    d, g = exp.train.distill, exp.train.distill.generation
    sampling = SimpleNamespace(
        temperature=g.temperature or d.temperature, top_p=g.top_p, top_k=g.top_k, min_p=g.min_p
    )
    return sampling, g.max_new_tokens


def generation_rows(exp: Any) -> int:
    """The sequences a generate call samples: G x train.rl.generation_batch prompts, at most a rank's step's
    (distill: train.distill.generation.batch, else a rank's step's rows, an example each: a row packing several
    shorter ones holds as many prompts of fewer tokens)."""
    t, rl = exp.train, exp.train.rl
    if distill_generates(exp):
        return t.distill.generation.batch or int(t.micro_batch_size) * t.grad_accum
    per_rank = max(int(t.micro_batch_size) * t.grad_accum // rl.num_generations, 1)
    return rl.num_generations * min(rl.generation_batch or per_rank, per_rank)


def generation_bytes(exp: Any, info: Any, lp: int) -> int:
    """What generation holds on a rank beyond the weights (see the module's doc); 0 for other objectives."""
    if not is_rl(exp) and not distill_generates(exp):
        return 0
    (sampling, new), g = _sampling(exp), generation_rows(exp)
    prompt = max(exp.data.seq_len - new, 1)
    hidden = info.hidden or 0
    # the prompt's forward: its keys and values so far (a sliding layer's too: the whole prompt), and one
    # layer's activations at a time: the MLP's (its widths: 2, 3 gated; a mixture of experts: each of a token's
    # experts its input, gate/up and product) and the rest of the layer's (ATTENTION_HIDDEN hidden states a
    # token), and the scores where the attention materialises them
    e = info.experts
    if e:
        mlp = e.per_token * (2 * hidden + 4 * e.width) + 3 * e.shared_width + e.routed * 4 / lp
    else:
        mlp = (3 if info.intermediate else 2) * (info.intermediate or 4 * hidden)
    rest = ATTENTION_HIDDEN.get(info.model_type or "", 4.5) * hidden
    prefill = kv_cache_bytes(info, g, prompt, lp, windowed=False) + int(g * prompt * (rest + mlp) * lp)
    if (info.attn_implementation or "eager") == "eager":
        prefill += g * (info.heads or 1) * prompt * prompt * lp
    # then one token at a time: the whole cache, one layer's keys (or values) copied as they grow, the last
    # position's logits
    length = row_length(exp)
    decode = kv_cache_bytes(info, g, length, lp) + largest_layer_cache(info, g, length, lp) / 2
    decode += logits_bytes(sampling, g, info.vocab or 0)
    scoring = max((m[1] for m in reward_models(exp, lp)), default=0)
    return int(max(prefill, decode, scoring))


def generation_hint(exp: Any, info: Any, by: dict[Any, Any], budget: int, lp: int) -> str:
    """When generation's memory is what keeps a rung from fitting: the most prompts a generate call may sample
    (train.rl.generation_batch) for the cheapest rung of the ladder to fit, e.g. "set train.rl.generation_batch:
    8 (...) and zero3 fits"; empty when fewer prompts a call would not make a rung fit."""
    if not is_rl(exp):
        return ""
    t, rl = exp.train, exp.train.rl
    per_rank = max(int(t.micro_batch_size) * t.grad_accum // rl.num_generations, 1)
    for e in sorted(by.values(), key=lambda e: e.candidate.cost):
        room = budget - (e.total - max(e.activations, e.step, e.generation))
        if (
            e.refused
            or not e.fits_host
            or not e.usable
            or max(e.activations, e.step) > room
            or e.generation <= room
        ):
            continue
        for prompts in range(min(rl.generation_batch or per_rank, per_rank) - 1, 0, -1):
            fewer = exp.model_copy(update={"train": t.model_copy(update={"rl": rl.model_copy(
                update={"generation_batch": prompts})})})  # fmt: skip
            held = generation_bytes(fewer, info, lp)
            if held <= room:
                from trainer.config import format_size

                return (
                    f"set train.rl.generation_batch: {prompts} ({prompts * rl.num_generations} completions a generate "
                    f"call: {format_size(held)} of generation) and {e.candidate.name} fits"
                )
        return ""
    return ""


def reward_models(exp: Any, lp: int) -> list[tuple[int, int]]:
    """(weights, a forward's activations) of each reward model (function: model) whose config reads."""
    if not is_rl(exp):
        return []
    out = []
    for r in exp.train.rl.rewards:
        if r.function == "model" and isinstance(r.options.get("path"), str):
            params, hidden, width, heads = _reward_model_shape(r.options["path"])
            rows, length = int(r.options.get("batch_size", 8)), exp.data.seq_len
            # one layer at a time (no cache: use_cache off), its MLP's and the rest of its hidden states, and
            # eager attention's scores
            act = rows * length * ((3 * width) + 4.5 * hidden) * lp + rows * heads * length * length * lp
            out.append((params * lp, int(act)))
    return out


def reward_model_bytes(exp: Any, lp: int) -> int:
    """The reward models' weights, held on every rank for the whole run (a buffer of every candidate)."""
    return sum(w for w, _ in reward_models(exp, lp))


@functools.lru_cache(maxsize=8)
def _reward_model_shape(path: str) -> tuple[int, int, int, int]:
    """(parameters, hidden size, MLP width, heads) of the sequence-classification model at `path`, counted on
    the meta device; zeros where it does not read (the run then stops at load, naming it)."""
    cfg, params = meta_count(path, "AutoModelForSequenceClassification")
    if cfg is None:
        return 0, 0, 0, 0
    text = cfg.get_text_config()
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    width = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    heads = int(getattr(text, "num_attention_heads", 0) or 1)
    return params, hidden, width, heads


def meta_count(path: str, auto: str) -> tuple[Any, int]:
    """(the config, the parameters) of the model at `path` as transformers' `auto` class builds it, counted on the
    meta device; (None, 0) where it does not read."""
    try:
        import torch
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = getattr(transformers, auto).from_config(cfg)
    except (OSError, ValueError, KeyError, TypeError):
        return None, 0
    return cfg, sum(p.numel() for p in model.parameters())


def logits_bytes(rl: Any, rows: int, vocab: int) -> int:
    """The last position's logits while a token is sampled (see the module's doc; measured on CPU at vocab
    65,536 and 32 rows, tests/unit/test_grpo_plan.py: the noise in one chunk 36.3 bytes a row and token, 40.3
    with temperature 0.7, top_k 50 or top_p 0.9; in chunks of 8 rows 18.3, 22.3 and 32.0; all within 1.5%)."""
    from trainer.rl.generate import noise_rows

    min_p = getattr(rl, "min_p", None) is not None
    processing = rl.temperature != 1.0 or rl.top_k or rl.top_p < 1.0 or min_p
    base = rows * vocab * (12 + (4 if processing else 0))
    noise = min(rows, noise_rows(vocab)) * vocab * 24  # the int64 counter, its shift, the float64 uniform
    sort = rows * vocab * 16 if rl.top_p < 1.0 else 0  # top-p's sorted scores, their order, softmax, cumsum
    drop = rows * vocab * 5 if min_p else 0  # min-p's probabilities and their mask
    return int(base + max(noise, sort, drop))


def host_bytes(exp: Any) -> int:
    """The step's rollouts on the host (rows and per-token log-probs), per rank."""
    if not is_rl(exp):
        return 0
    t = exp.train
    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else 1
    return int(micro * t.grad_accum * row_length(exp) * 32)


def generation_line(exp: Any, plan: Any) -> str:
    """--plan's line for grpo: what generation holds and why."""
    from trainer.config import format_size
    from trainer.strategy.planning.states import low_precision_bytes

    rl, e = exp.train.rl, plan.estimate
    weights = reward_model_bytes(exp, low_precision_bytes(plan.precision))
    held = f"; reward model(s): {format_size(weights)} of weights, held through the run" if weights else ""
    return (
        f"generation: {format_size(e.generation)} per rank between steps (key/value cache of {generation_rows(exp)} "
        f"completions a generate call x {row_length(exp)} tokens, the prompt's forward, the sampling logits); rows of a prompt "
        f"(at most {exp.data.seq_len - rl.max_new_tokens} tokens) and its completion (max_new_tokens {rl.max_new_tokens}) "
        "trained; no reference model " + ("(beta 0)" if rl.beta == 0 else "(LoRA's adapters off)") + held
    )
