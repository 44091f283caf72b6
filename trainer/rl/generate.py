"""Generation for online RL: completions of prompts from the weights being trained.

The seam (`Sampler`): `sample(prompts, seed)` takes prompts as token ids and returns each one's completion
(token ids, at most max_new_tokens, up to and including the stop token where it ended) and whether it ended.
`ModelSampler` runs transformers' `generate` on the engine's own module, in eval mode without gradients: the
policy is the trained weights at every step, at every ZeRO stage (ZeRO-3 gathers each layer for every
forward; `synced_gpus` keeps the ranks in lockstep until every rank's completions have ended), with LoRA and
QLoRA (peft's model, bitsandbytes' layers). Prompts are left-padded, so that every completion starts at the
same position; sampling stops at EOS or the chat template's end-of-turn token.

Each group is sampled with its own seed (trainer/rl/rollout.py: train.seed, the epoch, the prompt's place in
the epoch's order) inside a forked RNG: a resumed run generates the same completions from the same weights,
and the training RNG (dropout) is untouched. Only the sampling asked for applies: the model's published
generation_config (a repetition penalty, min_p...) is set aside while sampling.

An inference engine (vLLM, SGLang) would implement `Sampler` over its own copy of the weights: after each
optimizer step the trained weights (gathered, and with LoRA the adapters merged or passed as an adapter)
are pushed to it -- NCCL broadcast from rank 0 or a shared-memory handle on one node -- before the next
`sample`; the loss then needs the log-probs of its completions under the trained weights, which the
objective computes itself (docs/rl.md).
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
    stop: tuple[int, ...] = ()  # token ids that end a completion (EOS, the end-of-turn token)
    pad: int = 0


class Sampler(Protocol):
    def sample(self, prompts: list[list[int]], seed: int) -> list[tuple[list[int], bool]]: ...


def stop_tokens(tok: Any, eot: str = "") -> tuple[int, ...]:
    """EOS, and the chat template's end-of-turn token where it is one token."""
    out = [] if tok.eos_token_id is None else [int(tok.eos_token_id)]
    if eot:
        ids = tok(eot, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] not in out:
            out.append(int(ids[0]))
    return tuple(out)


class ModelSampler:
    """Sampling with transformers' generate on the engine's module (see the module's doc)."""

    def __init__(self, engine: Any, sampling: Sampling, synced: bool, batch: int) -> None:
        self.engine, self.sampling, self.synced, self.batch = engine, sampling, synced, batch

    def sample(self, prompts: list[list[int]], seed: int) -> list[tuple[list[int], bool]]:
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
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(seed)
                for at in range(0, len(prompts), self.batch):
                    out += self._generate(module, prompts[at : at + self.batch], device)
        finally:
            module.train(was_training)
            base.generation_config = published
        return out

    def _generate(self, module: Any, prompts: list[list[int]], device: Any) -> list[tuple[list[int], bool]]:
        import torch

        s = self.sampling
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), s.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left-padded: every completion starts at `width`
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        gen = module.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=s.temperature,
            top_p=s.top_p, top_k=s.top_k or None, max_new_tokens=s.max_new_tokens, eos_token_id=list(s.stop) or None,
            pad_token_id=s.pad, synced_gpus=self.synced, use_cache=True,
        )  # fmt: skip
        out = []
        for row in gen[:, width:].tolist():
            end = next((i for i, t in enumerate(row) if t in s.stop), None)
            out.append((row[: end + 1], True) if end is not None else (row[: s.max_new_tokens], False))
        return out
