"""The activation levers at run time (the plan chooses them: trainer/strategy/planning/levers.py).

- **Sequence parallelism** (`strategy.sequence_parallel`): DeepSpeed's Ulysses for transformers models
  (`deepspeed.runtime.sequence_parallel.ulysses_sp`). Ranks `sp * k ... sp * k + sp - 1` form a
  sequence-parallel group (DeepSpeed's `parallel_state_sp`): they hold the same rows, each `seq_len /
  sp` of every one (`shard`), and every attention layer exchanges heads for sequence by all-to-all, so
  that each rank attends over the whole sequence for `heads / sp` of the heads (key/value heads split,
  or replicated where there are fewer than `sp`, as DeepSpeed does). The labels are shifted before the
  rows are cut, so the token after a shard's last one is its target. DeepSpeed's wrapper drops the
  attention mask and leaves sdpa causal over the whole sequence; packed rows need their examples kept
  apart and sliding windows their window, so the core attention here (`sequence_sdpa`) attends each
  example on its own from the gathered position ids (where they restart), windowed in blocks where the
  layer passes a window, without a dense n x n mask (flash_attention_2 reads packed sequences and
  windows itself); attention sinks and softcapping are refused.
- **Tiled MLP** (`model.tiled_mlp`): DeepSpeed's `TiledMLP` around every decoder layer's MLP: the
  sequence in shards of about `hidden` tokens, the MLP recomputed shard by shard in backward, its
  intermediates never kept. The shard count is fixed from the planned sequence, so that every rank runs
  as many (ZeRO-3 gathers the MLP's weights at each).
- **Checkpointed activations on the host** (`model.offload_activations`): reentrant activation
  checkpointing saves each layer's input with `save_for_backward`, which `offloaded()` moves to
  (pinned) host memory during the forward pass and back in backward.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

IGNORE = -100


class UnsupportedAttention(Exception):
    """An attention argument the sequence-parallel core cannot honour (sinks, softcapping): refused at
    the plan by the family check (ulysses_verdict) with this reason."""


def sequence_sdpa(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
    scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any,
) -> Any:  # fmt: skip
    """transformers' sdpa attention over the whole gathered sequence under Ulysses (which drops the
    model's masks: they were built for a rank's shard), rebuilt without a dense mask from what the
    layer passes: each row's examples (where the gathered position ids restart) attend causally
    within themselves in an sdpa call of their own (`is_causal`: the flash kernels, no n x n mask); a
    sliding window (`sliding_window`: Mistral, Gemma 3's local layers, Phi-3, Qwen2/3 with
    use_sliding_window; transformers' rule, a key within the last `window` positions) in blocks of
    WINDOW_BLOCK queries against their window's keys, a block x (block + window) mask a call.
    Attention sinks (`s_aux`, gpt-oss) and logit softcapping (`softcap`) are refused."""
    import torch

    if kwargs.get("s_aux") is not None:
        raise UnsupportedAttention(
            "its attention adds learned sinks (s_aux), which sequence parallelism's sdpa core does not"
        )
    if kwargs.get("softcap") is not None:
        raise UnsupportedAttention("its attention softcaps the logits, which sdpa cannot")
    if not getattr(module, "is_causal", True) or is_causal is False:
        raise UnsupportedAttention("its attention is not causal")
    window = kwargs.get("sliding_window")
    pos = kwargs.get("position_ids")
    batch, heads, n, size = query.shape
    gqa = {"enable_gqa": True} if key.shape[1] != heads else {}  # grouped key/value heads, not repeated
    parts = []  # each example's output, (tokens, heads, size), in order: one concatenation at the end
    # unbind and split, never slices: the backward of a slice writes a whole-sized gradient each time
    for b, (q, k, v) in enumerate(zip(*(x.unbind(0) for x in (query, key, value)), strict=True)):
        starts = [0] if pos is None else (pos[b if pos.shape[0] > 1 else 0] == 0).nonzero().flatten().tolist()
        bounds = sorted({0, *starts}) + [n]
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True) if e > s]
        for example in zip(*(x.split(lengths, dim=1) for x in (q, k, v)), strict=True):
            parts += _causal(*example, window, dropout, scaling, gqa)
    # (batch, sequence, heads, size), as transformers' attention functions return it
    return torch.cat(parts).view(batch, n, heads, size), None


def _causal(
    q: Any, k: Any, v: Any, window: int | None, dropout: float, scale: float | None, gqa: dict
) -> list:
    """Causal attention of one example ((heads, tokens, size)), within `window` keys back where there
    is one: its output as pieces of (tokens, heads, size). A window: blocks of WINDOW_BLOCK queries,
    each against the blocks of keys its window reaches, with one mask for the blocks of the same shape."""
    import torch
    import torch.nn.functional as F

    from trainer.strategy.planning.activations import WINDOW_BLOCK

    n, block = q.shape[1], WINDOW_BLOCK
    if window is None or window >= n:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], dropout_p=dropout, is_causal=True, scale=scale,
                                             **gqa)  # fmt: skip
        return [out[0].transpose(0, 1)]
    if gqa and q.device.type == "cuda":  # a mask: CUDA's flash kernels take none, its memory-efficient
        k, v = (x.repeat_interleave(q.shape[0] // x.shape[0], dim=0) for x in (k, v))  # ones no grouped heads
        gqa = {}
    qs, ks, vs = (x.split(block, dim=1) for x in (q, k, v))
    back = -(-(window - 1) // block)  # key blocks before a query block that its window reaches
    pieces, masks = [], {}
    for i, qb in enumerate(qs):
        first = max(0, i - back)
        kb, vb = torch.cat(ks[first : i + 1], dim=1), torch.cat(vs[first : i + 1], dim=1)
        shape = (qb.shape[1], kb.shape[1], (i - first) * block)  # queries, keys, the first query's offset
        if shape not in masks:
            qpos = torch.arange(shape[2], shape[2] + shape[0], device=q.device)[:, None]
            kpos = torch.arange(shape[1], device=q.device)[None, :]
            allowed = (kpos <= qpos) & (qpos - kpos < window)
            masks[shape] = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~allowed, float("-inf")
            )
        out = F.scaled_dot_product_attention(qb[None], kb[None], vb[None], attn_mask=masks[shape], dropout_p=dropout,
                                             scale=scale, **gqa)  # fmt: skip
        pieces.append(out[0].transpose(0, 1))
    return pieces


def register_ulysses(model: Any, sp: int, micro_batch: int, seq_len: int) -> Any:
    """Replace the model's attention kernel with DeepSpeed's Ulysses wrapper around it, for `sp` ranks
    holding `seq_len / sp` tokens of `micro_batch` rows each; returns the mpu that
    `deepspeed.initialize` takes. (DeepSpeed's `register_with_transformers`, with the packed-aware core
    for sdpa.)"""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    kernel = model.config._attn_implementation
    if kernel not in ("sdpa", "flash_attention_2", "flash_attention_3"):
        from trainer.common.errors import UserError

        raise UserError(
            f"strategy.sequence_parallel: {sp} needs sdpa or flash attention; the model runs '{kernel}': set "
            "model.attn_implementation: sdpa"
        )
    with contextlib.suppress(AssertionError):  # a second engine in one process (tests) reuses the groups
        mpu.initialize_sequence_parallel(sequence_parallel_size=sp)
    cfg = model.config.get_text_config()
    core = ALL_ATTENTION_FUNCTIONS[kernel]
    uattn = UlyssesSPAttentionHF(
        attn=sequence_sdpa if kernel == "sdpa" else core,
        batch_size=micro_batch,
        attn_head_count=cfg.num_attention_heads,
        attn_head_size=head_size(cfg),
        kv_head_count=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        num_hidden_layers=cfg.num_hidden_layers,
        process_group=mpu.get_sequence_parallel_group(),
        seq_length_is_variable=False,
        local_seq_length=seq_len // sp,
        global_seq_length=seq_len,
    )
    uattn.core_attn_implementation = kernel

    def wrapper(
        module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any
    ) -> Any:
        # the mask transformers built is for the shard's length: the core attends without one (sequence_sdpa)
        out, weights = uattn(module, query, key, value, None, *args, **kwargs)
        # Ulysses returns (batch, sequence, heads x size); transformers' attention functions return
        # (batch, sequence, heads, size), which some families read as such (GPT-2 flattens the last two)
        return out.reshape(*out.shape[:2], query.shape[1], query.shape[-1]), weights

    ALL_ATTENTION_FUNCTIONS[kernel] = wrapper
    return mpu


def head_size(cfg: Any) -> int:
    """The attention head size DeepSpeed's Ulysses is told (its shapes are fixed from it): the config's
    head_dim, else hidden / heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def shard(batch: Any, sp: int, rank: int) -> tuple[Any, Any, Any]:
    """Fine-tuning rows (micro, 3, seq) or token blocks (micro, seq) -> this rank's (input ids, position
    ids, shifted labels) for its seq/sp of every row: the labels shifted left over the whole row first,
    so that a shard's last token is trained on the next shard's first."""
    import torch

    if batch.dim() == 2:
        ids, labels = batch, batch
        pos = torch.arange(batch.shape[1], device=batch.device).expand_as(batch)
    else:
        ids, labels, pos = batch[:, 0], batch[:, 1], batch[:, 2]
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE)
    n = ids.shape[1] // sp
    cut = slice(rank * n, (rank + 1) * n)
    return ids[:, cut].contiguous(), pos[:, cut].contiguous(), shifted[:, cut].contiguous()


def tile_mlps(model: Any, tokens: int) -> int:
    """Wrap every decoder layer's `mlp` in DeepSpeed's TiledMLP: shards of about `hidden` of the
    `tokens` a rank's row holds (the same count on every rank). Returns how many MLPs it wrapped."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    config = getattr(model, "config", None)
    hidden = config.get_text_config().hidden_size if config is not None else tokens
    shards = max(1, math.ceil(tokens / hidden))
    wrapped = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "mlp" or not hasattr(module, "forward"):
            continue
        forward = type(module).forward
        params = [p for p in module.parameters()]

        def tiled(x: Any, _m: Any = module, _f: Any = forward, _p: Any = params) -> Any:
            # a shard of a batch's sequences is not contiguous; GPT-2's Conv1D views its input
            return TiledMLP.apply(lambda self, h: _f(self, h.contiguous()), _m, x, shards, _p)

        module.forward = tiled
        wrapped += 1
    if not wrapped:
        from trainer.common.errors import UserError

        raise UserError(
            f"model.tiled_mlp: {type(model).__name__} has no decoder layers with an `mlp` module to tile; set it "
            "to false"
        )
    return wrapped


@contextlib.contextmanager
def offloaded(on: bool, pin: bool) -> Iterator[None]:
    """Around a forward pass with reentrant checkpointing: what it saves for backward (each layer's
    input) is kept in host memory (`pin`: page-locked, for the copies back to the GPU)."""
    if not on:
        yield
        return
    import torch

    with torch.autograd.graph.save_on_cpu(pin_memory=pin):
        yield


def ulysses_verdict(config: Any, kernel: str, cache_dir: Any = None) -> str | None:
    """Why this model family cannot run DeepSpeed's Ulysses (None: it can), checked in this process on
    a small model of the family (packing.shrunk) and cached beside the packing verdicts: its attention
    layers must call transformers' attention functions (which Ulysses replaces) and pass them the position
    ids (Ulysses gathers them); the logits must then be those of the model's own attention."""
    import hashlib
    import json
    from pathlib import Path

    import transformers

    from trainer.common.files import write_atomic
    from trainer.model.vision import is_vision

    if is_vision(
        getattr(config, "model_type", None)
    ):  # (its small model would be its whole text model: shrunk
        # shrinks the top config only; an 11B Llama 3.2 Vision's took 18.5 GB to build)
        return (f"model type '{config.model_type}' is a vision-language model: sequence parallelism with its images "
                "is not verified")  # fmt: skip
    fields = {k: v for k, v in config.to_diff_dict().items() if not k.startswith("_")}
    key = json.dumps(["ulysses-2", kernel, transformers.__version__, fields], sort_keys=True, default=str)
    path = None
    if cache_dir is not None:
        path = (
            Path(cache_dir).expanduser() / "packing" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
        )
        with contextlib.suppress(OSError, ValueError):
            return json.loads(path.read_text())["problem"]
    problem = _ulysses_problem(config, kernel)
    if path is not None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({"problem": problem}))
    return problem


def _ulysses_problem(config: Any, kernel: str) -> str | None:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from trainer.model.packing import VOCAB, shrunk

    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(shrunk(config), attn_implementation=kernel).float().eval()
    except Exception as e:  # noqa: BLE001 (a family without this kernel)
        return f"a small model of it could not be built with {kernel} attention ({type(e).__name__}: {str(e)[:150]})"
    # two rows longer than the small model's sliding window (packing.shrunk: 6): one example, and two
    # packed; the reference is each example alone through the model's own attention and masks
    n, first = 16, 9
    ids = torch.randint(3, VOCAB, (2, n), generator=torch.Generator().manual_seed(0))
    pos = torch.stack([torch.arange(n), torch.cat([torch.arange(first), torch.arange(n - first)])])
    try:
        with torch.no_grad():
            alone = [
                model(input_ids=x[None], use_cache=False).logits[0]
                for x in (ids[0], ids[1, :first], ids[1, first:])
            ]
    except Exception as e:  # noqa: BLE001 (a family whose small model does not run: unchecked, so refused)
        return f"a small model of it did not run to check it ({type(e).__name__}: {str(e)[:150]})"
    want = torch.stack([alone[0], torch.cat(alone[1:])])
    core, seen, sizes = ALL_ATTENTION_FUNCTIONS[kernel], [], set()
    run_core = sequence_sdpa if kernel == "sdpa" else core

    def as_ulysses(module: Any, q: Any, k: Any, v: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append("position_ids" in kwargs)
        sizes.update((q.shape[-1], k.shape[-1], v.shape[-1]))
        return run_core(module, q, k, v, None, *args, **kwargs)  # as at run time: the mask dropped

    ALL_ATTENTION_FUNCTIONS[kernel] = as_ulysses
    try:
        with torch.no_grad():
            got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    except UnsupportedAttention as e:
        return str(e)
    except Exception as e:  # noqa: BLE001
        return f"its attention layers fail through a replaced attention function ({type(e).__name__}: {str(e)[:150]})"
    finally:
        ALL_ATTENTION_FUNCTIONS[kernel] = core
    if not seen:
        return "its attention layers do not call transformers' attention functions, which Ulysses replaces"
    if not all(seen):
        return "its attention layers do not pass the position ids, which Ulysses gathers across the ranks"
    told = head_size(model.config.get_text_config())
    if sizes != {told}:
        return (
            f"its attention's query, key and value heads are of size {sorted(sizes)} where DeepSpeed's Ulysses "
            f"splits heads of one size ({told}, from its config; multi-head latent attention differs)"
        )
    mixing = _mixing_outside_attention(model, ids, pos, kernel)
    if mixing is not None:
        return mixing
    if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
        worst = ((got - want).abs().max() / want.abs().max()).item()
        return (
            f"its logits under the sequence-parallel attention (the model's masks dropped, as at run time) differ "
            f"from its own by {worst:.1e} relative (an attention rule the core does not apply)"
        )
    return None


def _mixing_outside_attention(model: Any, ids: Any, pos: Any, kernel: str) -> str | None:
    """Ulysses splits only the attention: anything else that mixes positions (a recurrent or
    convolutional layer of a hybrid) would see a rank's shard alone. With attention made position-wise
    (each token its own value), the first token must reach no other position's logits."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def local(module: Any, q: Any, k: Any, v: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        out = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # (batch, heads, sequence, size)
        return out.transpose(1, 2).contiguous(), None

    other = ids.clone()
    other[:, 0] = (ids[:, 0] + 1) % model.config.get_text_config().vocab_size
    core = ALL_ATTENTION_FUNCTIONS[kernel]
    ALL_ATTENTION_FUNCTIONS[kernel] = local
    try:
        with torch.no_grad():
            a = model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, 1:]
            b = model(input_ids=other, position_ids=pos, use_cache=False).logits[:, 1:]
    except Exception as e:  # noqa: BLE001
        return f"a small model of it did not run to check it ({type(e).__name__}: {str(e)[:150]})"
    finally:
        ALL_ATTENTION_FUNCTIONS[kernel] = core
    if not torch.allclose(a, b, atol=1e-5, rtol=1e-4):  # MoE layers batch tokens by expert: rounding only
        return (
            "layers other than its attention mix positions (recurrent or convolutional layers), which would see "
            "one rank's shard of the sequence alone"
        )
    return None
