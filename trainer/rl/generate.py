"""Generation for online RL: completions of prompts from the weights being trained.

The seam (`Sampler`): `sample(prompts, streams)` takes prompts as token ids, one random stream a row, and returns
each one's completion (token ids, at most max_new_tokens, up to and including the stop token where it ended) and
whether it ended. `ModelSampler` runs transformers' `generate` on the engine's own module, in eval mode without
gradients: the policy is the trained weights at every step, at every ZeRO stage (ZeRO-3 gathers each layer for
every forward; `synced_gpus` keeps the ranks in lockstep until every rank's completions have ended), with LoRA
and QLoRA (peft's model, bitsandbytes' layers). It samples `batch` rows a call (train.rl.generation_batch
prompts' groups: by default all of a rank's step, the fewest decode passes). Prompts are left-padded to
`width` at least (the data's longest prompt and one more: every row of every call padded alike, so that no call
takes transformers' unmasked path), and every completion starts at the same position; sampling stops where
`generate` and TRL stop: at the tokenizer's EOS and every `eos_token_id` of the model's generation config; and
(not TRL's, train.rl.stop_at_end_of_turn) at the chat template's end-of-turn token (`stop_tokens`).

Sampling is Gumbel-max with a counter-based noise: a row's token at decode step t is the argmax of its
processed logits (/ temperature, top-k, top-p, min-p, as transformers' warpers) plus Gumbel noise that is a function of
(the row's stream, t, the token) only (splitmix64 over int64 tensors, 52 bits of uniform; `gumbel`). That is a
sample from softmax(processed logits) (to the uniform's 2**-52 grain), and a completion depends on its own
stream and its own logits, not on the RNG, its rank or which rows share its call: each row's stream comes from
train.seed, the epoch, the prompt's place in the epoch's order and the completion's index in its group
(trainer/rl/rollout.py). A resumed run draws the completions the uninterrupted run drew; a step split over
other ranks, micro batches or calls draws the same ones wherever a row's logits do not depend on the rows
beside it: on CPU in fp32 (tested), not guaranteed on GPUs, whose matrix kernels are chosen by the rows of
the call (bf16 rounding then flips a near tie now and then, and the completion goes its own way from there).
The training RNG (dropout) is untouched. Only the sampling asked for applies: the
model's published generation_config (a repetition penalty, min_p...) is set aside while sampling (its end
tokens are read at start).

An inference engine (vLLM, SGLang) would implement `Sampler` over its own copy of the weights: after each
optimizer step the trained weights (gathered, and with LoRA the adapters merged or passed as an adapter)
are pushed to it -- NCCL broadcast from rank 0 or a shared-memory handle on one node -- before the next
`sample`; the loss then needs the log-probs of its completions under the trained weights, which the
objective computes itself (docs/rl.md). (Its own sampler would draw other completions than these streams.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    stop: tuple[int, ...] = ()  # token ids that end a completion (EOS, the generation config's, end-of-turn)
    pad: int = 0
    width: int = 0  # prompts are left-padded to at least this many tokens (the data's longest prompt + 1)


class Sampler(Protocol):
    def sample(self, prompts: list[list[int]], streams: list[int]) -> list[tuple[list[int], bool]]: ...


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN, MIX1, MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: Any, k: int) -> Any:
    """Logical right shift of int64 (torch's is arithmetic)."""
    import torch

    return torch.bitwise_right_shift(x, k).bitwise_and_((1 << (64 - k)) - 1)


def mix64_(x: Any) -> Any:
    """splitmix64's finalizer on an int64 tensor, in place (products wrap modulo 2**64): one int64
    temporary at a time."""
    for k, m in ((30, MIX1), (27, MIX2), (31, 0)):
        x ^= _shr(x, k)
        if m:
            x *= m
    return x


def gumbel(streams: Any, step: int, vocab: int) -> Any:
    """Gumbel(0, 1) noise, (rows, vocab) float32: a function of (the row's stream, step, token) only, the same
    on every device. 52 bits of uniform, (k + 0.5) / 2**52, and the logs in float64: a token 36 nats below the
    row's best can still be drawn (23 bits in float32 stopped at 19)."""
    import torch

    counter = (step * vocab + torch.arange(vocab, device=streams.device, dtype=torch.int64)) * GOLDEN
    x = mix64_(counter[None, :] + streams.to(torch.int64)[:, None])
    u = _shr(x, 12).to(torch.float64)
    del x
    return u.add_(0.5).mul_(2.0**-52).log_().neg_().log_().neg_().to(torch.float32)


def processed(scores: Any, s: Sampling) -> Any:
    """The logits sampling draws from: / temperature, then top-k, then top-p, then min-p (transformers'
    warpers, in their order, with their ties: at least one token kept)."""
    import torch

    if s.temperature != 1.0:
        scores = scores / s.temperature
    if s.top_k:
        k = min(s.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -torch.inf)
    if s.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - s.top_p)
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), -torch.inf)
    if s.min_p is not None:  # below min_p x the likeliest's probability (the kept set's, as transformers')
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < s.min_p * probs.amax(dim=-1, keepdim=True), -torch.inf)
    return scores


NOISE_ELEMENTS = 2**22  # the noise is made this many (row, token) pairs at a time (whole rows): its int64
# and float64 temporaries stay bounded beside the logits, in few launches


def noise_rows(vocab: int) -> int:
    return max(1, NOISE_ELEMENTS // max(vocab, 1))


def gumbel_processor(s: Sampling, streams: Any, width: int) -> Any:
    """A transformers LogitsProcessor that turns greedy decoding into sampling with each row's own noise
    (added in place, noise_rows(vocab) rows at a time)."""
    from transformers import LogitsProcessor

    class GumbelMax(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            step = input_ids.shape[1] - width  # the prefill's logits: step 0
            # in place: where nothing is processed `out` is transformers' own fp32 copy of the logits, which
            # it would return as the raw logits only with output_logits (never asked for here)
            out = processed(scores, s)
            keys, n = streams.to(scores.device), noise_rows(out.shape[-1])
            for at in range(0, out.shape[0], n):
                out[at : at + n] += gumbel(keys[at : at + n], step, out.shape[-1])
            return out

    return GumbelMax()


def pad_id(tok: Any) -> int:
    """The id generation pads with: the tokenizer's pad token, else its EOS, else 0."""
    return int(tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0))


def stop_tokens(tok: Any, eot: str = "", generation_config: Any = None) -> tuple[int, ...]:
    """Where a completion ends, as `generate` and TRL's GRPOTrainer end it: the tokenizer's EOS, every
    `eos_token_id` of the model's generation config (an int or a list: Llama 3.1's <|eom_id|> and
    <|end_of_text|>, Qwen2.5's <|endoftext|>...), and the chat template's end-of-turn token where it is one."""
    out = [] if tok.eos_token_id is None else [int(tok.eos_token_id)]
    listed = getattr(generation_config, "eos_token_id", None)
    for t in [listed] if isinstance(listed, int) else list(listed or []):
        if int(t) not in out:
            out.append(int(t))
    if eot:
        ids = tok(eot, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] not in out:
            out.append(int(ids[0]))
    return tuple(out)


class ModelSampler:
    """Sampling with transformers' generate on the engine's module (see the module's doc)."""

    def __init__(
        self, engine: Any, sampling: Sampling, synced: bool, batch: int, cache: str = "dynamic"
    ) -> None:
        self.engine, self.sampling, self.synced, self.batch = engine, sampling, synced, batch
        # "static": transformers' StaticCache (on a GPU, the decode step compiled and graphed)
        self.cache = cache

    def sample(self, prompts: list[list[int]], streams: list[int]) -> list[tuple[list[int], bool]]:
        import torch

        out: list[tuple[list[int], bool]] = []
        device = self.engine.device
        devices = [device] if getattr(device, "type", None) == "cuda" else []
        from transformers import GenerationConfig

        module = self.engine.ds.module
        was_training = module.training
        module.train(False)
        # only the sampling asked for: generate fills what it is not given from the model's
        # generation_config.json (a repetition penalty, min_p, suppressed tokens...), which would sample
        # from another distribution than the loss's softmax(logits / temperature)
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        published, base.generation_config = getattr(base, "generation_config", None), GenerationConfig()
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():  # (nothing draws from it)
                for at in range(0, len(prompts), self.batch):
                    rows = slice(at, at + self.batch)
                    out += self._generate(module, prompts[rows], streams[rows], device)
        finally:
            module.train(was_training)
            base.generation_config = published
        return out

    def _generate(
        self, module: Any, prompts: list[list[int]], streams: list[int], device: Any
    ) -> list[tuple[list[int], bool]]:
        import torch
        from transformers import LogitsProcessorList

        s = self.sampling
        width = max(s.width, *(len(p) for p in prompts))
        ids = torch.full((len(prompts), width), s.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left-padded: every completion starts at `width`
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        noise = gumbel_processor(s, torch.tensor(streams, dtype=torch.int64, device=device), width)
        gen = module.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
            logits_processor=LogitsProcessorList([noise]), max_new_tokens=s.max_new_tokens,
            eos_token_id=list(s.stop) or None, pad_token_id=s.pad, synced_gpus=self.synced, use_cache=True,
            **({"cache_implementation": "static"} if self.cache == "static" else {}),
        )  # fmt: skip
        out = []
        for row in gen[:, width:].tolist():
            end = next((i for i, t in enumerate(row) if t in s.stop), None)
            out.append((row[: end + 1], True) if end is not None else (row[: s.max_new_tokens], False))
        return out
