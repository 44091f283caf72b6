"""What online RL (train.objective: grpo, docs/rl.md) adds to a plan: the rows a micro step trains (the
completions, each its prompt and up to max_new_tokens after it) and the memory generation holds on each rank
while it samples, between two training steps (when the training activations are freed: the peak is the
larger of the two, as for the optimizer step).

Generation (trainer/rl/generate.py) samples one prompt's group at a time: G sequences of at most
data.seq_len tokens (a prompt of at most seq_len - max_new_tokens, and its completion). It holds

- the key/value cache: 2 (keys, values) x layers x G x length x kv_heads x head_dim, in the compute
  precision (the part that grows with the job; `kv_cache_bytes`);
- the prompt's forward (prefill, no gradients): one layer's hidden states and MLP input at a time, G x
  prompt x (4 hidden + the MLP's width), in the compute precision;
- the sampling step's logits of the last position in fp32, thrice (the logits, the processed scores,
  the probabilities): G x vocab x 12 bytes.

No reference model is held: beta 0 builds none, and with LoRA the reference is the model with its adapters
off (beta > 0 without LoRA is refused). The old log-probs (num_iterations > 1) and the rollouts are kept on
the host: a step's completions x length x 32 bytes (rows of three int64, two fp32 log-probs; `host_bytes`).
"""

from __future__ import annotations

from typing import Any


def is_rl(exp: Any) -> bool:
    return exp.train.objective == "grpo"


def row_length(exp: Any) -> int:
    """The tokens of a trained row at most: data.seq_len (grpo: a prompt and its completion, which the stream
    checks at start: the longest prompt + max_new_tokens <= seq_len)."""
    return exp.data.seq_len


def kv_cache_bytes(info: Any, sequences: int, length: int, lp: int) -> int:
    """The key/value cache of `sequences` rows of `length` tokens (head_dim: hidden / heads)."""
    heads = info.heads or 1
    kv = info.kv_heads or heads
    head_dim = (info.hidden or 0) // heads
    return int(2 * (info.layers or 0) * sequences * length * kv * head_dim * lp)


def generation_bytes(exp: Any, info: Any, lp: int) -> int:
    """What generation holds on a rank beyond the weights (see the module's doc); 0 for other objectives."""
    if not is_rl(exp):
        return 0
    g = exp.train.rl.num_generations
    hidden = info.hidden or 0
    width = info.intermediate or 4 * hidden
    prefill = g * max(exp.data.seq_len - exp.train.rl.max_new_tokens, 0) * (4 * hidden + width) * lp
    logits = g * (info.vocab or 0) * 12
    return kv_cache_bytes(info, g, row_length(exp), lp) + int(prefill + logits)


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

    rl, e = exp.train.rl, plan.estimate
    return (
        f"generation: {format_size(e.generation)} per rank between steps (key/value cache of {rl.num_generations} "
        f"completions x {row_length(exp)} tokens, the prompt's forward, the sampling logits); rows of a prompt "
        f"(at most {exp.data.seq_len - rl.max_new_tokens} tokens) and its completion (max_new_tokens {rl.max_new_tokens}) "
        "trained; no reference model " + ("(beta 0)" if rl.beta == 0 else "(LoRA's adapters off)")
    )
