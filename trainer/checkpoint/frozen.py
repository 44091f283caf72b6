"""The frozen weights of a LoRA run (model.lora): a digest that guards them, and checkpoints without
them where model.pretrained holds them.

The base's weights never change in a LoRA run. Where they come from a pretrained model named in the
experiment, checkpoints leave them out (DeepSpeed's `exclude_frozen_parameters`, what the Hugging
Face Trainer does for peft models): a checkpoint of a 7B model's adapters is megabytes of adapter
state, not 14 GB of base weights again at every save. What makes that safe:

- every LoRA checkpoint records a digest of the frozen weights' values as the engine held them
  (`digest`; the same at every ZeRO stage and world size); the engine takes it before training and
  again at every save, and stops if they changed; a resume compares it after loading, on every rank,
  and refuses, naming the path, when it differs: a pretrained model changed at the same path, or a
  resharded resume that did not bring a config base's frozen weights along (DeepSpeed's universal
  format holds only what the optimizer trains);
- a resume loads the module non-strictly only for the frozen weights (`strict_but_frozen`): any other
  missing or unexpected key is an error;
- export (and `consolidated_state_dict`) builds the base from model.pretrained as training does, in
  the precision the run trained in, exactly what the engine held, and checks the digest.

A base built from a config (no model.pretrained: seeded random weights nobody can name) stays in
the checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from trainer.common.errors import UserError

KEY = "frozen_weights"  # in trainer_state.json: {"omitted": ..., "pretrained": ..., "digest": ...}
CHUNK = 1 << 22  # elements per step of the digest (bounds its temporary copies to ~100 MB)


def omitted(exp: Any) -> bool:
    """Whether this experiment's checkpoints leave the frozen base out."""
    return not exp.model.checkpoints_hold_frozen


def guarded(exp: Any) -> bool:
    """Whether this experiment's frozen weights are digested and checked (every LoRA run)."""
    return exp.model.lora is not None


def frozen_names(module: Any) -> set[str]:
    """Every state-dict name of a frozen parameter (a tied weight's second name too)."""
    return {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _sums(t: Any) -> list[int]:
    """Exact integer sums over the value's fp32 bits read as int16 (the same for a bf16 weight and its
    fp32 copy): of x, of x squared and of x weighted by its position (which a permutation changes)."""
    import torch

    flat = t.detach().reshape(-1)
    s = torch.zeros(3, dtype=torch.int64, device=flat.device)
    for i in range(0, flat.numel(), CHUNK):
        x = flat[i : i + CHUNK].float().view(torch.int16).to(torch.int64)
        w = (torch.arange(2 * i, 2 * i + x.numel(), device=x.device) * 31 + 7) % 4093
        s += torch.stack([x.sum(), (x * x).sum(), (x * w).sum()])
    return s.cpu().tolist()


def digest(module: Any, zero3: bool) -> str:
    """ "<dtypes>:<16 hex>": a digest of the frozen parameters' values, whatever dtype holds them, the
    same on every rank that holds the same weights and at every stage and world size (ZeRO-3 gathers
    each parameter whole, NVMe-offloaded ones included, so partitions and their padding play no
    part); the dtypes the engine holds them in, for the error message. Every rank calls it (ZeRO-3's
    gathers are collectives)."""
    rows, dtypes = {}, set()
    for name, p in module.named_parameters():
        if p.requires_grad:
            continue
        if zero3 and hasattr(p, "ds_id"):
            import deepspeed

            gather: Any = deepspeed.zero.GatheredParameters([p], modifier_rank=None)
        else:
            gather = contextlib.nullcontext()
        with gather:
            dtypes.add(str(p.dtype).removeprefix("torch."))
            rows[name] = _sums(p)
        state = getattr(p, "quant_state", None)  # a 4-bit weight's values are its block scales too
        while state is not None:
            rows[name] = [*rows[name], *_sums(state.absmax)]
            state = getattr(state, "state2", None)
    if not rows:
        return ""
    value = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    return f"{'+'.join(sorted(dtypes))}:{value}"


def engine_digest(ds: Any) -> str:
    """`digest` of a DeepSpeed engine's frozen weights; every rank."""
    return digest(ds.module, zero3=ds.zero_optimization_stage() == 3)


def unchanged(taken: str | None, now: str, rank: int, step: int) -> str:
    """A save's check, every rank: `now` (the frozen weights' digest at the save of `step`) holds the
    values of the digest `taken` before the first step (None: none taken yet), which it returns; raises
    if not. A dtype that changed with the values kept is no change: bitsandbytes casts a quantized
    layer's bias to its compute dtype in place at the first forward (compute_dtype fp32 under bf16)."""
    if taken is not None and now.partition(":")[2] != taken.partition(":")[2]:
        raise RuntimeError(
            f"the frozen weights changed during training (digest {taken} -> {now}) on rank "
            f"{rank}: something wrote to parameters that have no gradient; not saving step {step}"
        )
    return taken if taken is not None else now


def leave_out_aliases(ds: Any) -> None:
    """DeepSpeed's `exclude_frozen_parameters` drops the frozen parameters that named_parameters()
    lists, but not a state-dict key that is another name of one: a tied LM head (`lm_head.weight`
    is the embedding, vocabulary x hidden) would still be saved. Drop every name of a frozen
    parameter from the engine's module state when frozen weights are excluded."""
    original = ds.module_state_dict
    if getattr(original, "leaves_out_aliases", False):  # another Store on this engine (--check) did
        return
    names = frozen_names(ds.module)

    def module_state_dict(*args: Any, **kwargs: Any) -> Any:
        sd = original(*args, **kwargs)
        if kwargs.get("exclude_frozen_parameters"):
            for name in [k for k in sd if of_frozen(k, names)]:
                del sd[name]
        return sd

    module_state_dict.leaves_out_aliases = True  # type: ignore[attr-defined]
    ds.module_state_dict = module_state_dict


def of_frozen(key: str, names: set[str]) -> bool:
    """A state-dict key that is a frozen parameter, or a quantized frozen weight's state that
    bitsandbytes saves beside it (`....weight.absmax`, `....weight.quant_state.bitsandbytes__nf4`;
    8-bit: `....SCB`, `....weight_format`)."""
    if key in names:
        return True
    parts = key.split(".")
    if parts[-1] in ("SCB", "weight_format") and ".".join([*parts[:-1], "weight"]) in names:
        return True  # LLM.int8's row scales and layout, saved beside the layer's weight
    return any(".".join(parts[:i]) in names for i in range(len(parts) - 1, 0, -1))


def record(exp: Any, value: str) -> dict[str, Any]:
    return {"omitted": omitted(exp), "pretrained": exp.model.pretrained, "digest": value}


def saved(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """The checkpoint's record of its frozen weights (LoRA checkpoints), or None."""
    rec = (state or {}).get(KEY)
    return rec if rec and rec.get("digest") else None


def mismatch(ckpt: Path, rec: dict[str, Any], current: str, fix: str) -> str | None:
    """Why frozen weights with digest `current` are not those `ckpt`'s run trained on, or None."""
    held, _, value = rec["digest"].partition(":")
    holds, _, now = current.partition(":")
    if value == now:
        return None
    if held != holds:
        return (
            f"{ckpt} was trained with its frozen weights in {held}, this job holds them in {holds} (other values): "
            "resume at the run's precision (train.precision; 'auto' is bf16 on a GPU that has it, fp32 on CPU)"
        )
    where = (
        f"from model.pretrained={rec['pretrained']}, which its checkpoints leave out"
        if rec.get("omitted")
        else "saved in it (a config's base); this job's were not restored from it"
    )
    return (
        f"{ckpt} was trained on frozen weights {where}: digest {rec['digest']}, this job's {current}. {fix}"
    )


RESUME_FIX = (
    "Restore the weights at model.pretrained as they were when the run started (pin model.revision for a "
    "hub model), or start a new run_dir"
)


def resumed_problem(
    ckpt: Path, rec: dict[str, Any] | None, current: str, gather: Callable[[list[int]], list[list[int]]]
) -> str | None:
    """After a resume's load, every rank (`gather`: the Store's, a collective): why this job's frozen
    weights (digest `current`) are not those `ckpt`'s run trained on (`rec`: its record) on some
    rank, the same verdict on every rank; or None."""
    problem = mismatch(ckpt, rec, current, RESUME_FIX) if rec else None
    bad = [r for r, (flag,) in enumerate(gather([int(problem is not None)])) if flag]
    if not bad:
        return None
    # every rank stops, with rank 0's words where it has them
    return problem or (
        f"{ckpt}: rank(s) {bad} hold other frozen weights than the run trained on ({RESUME_FIX.lower()})"
    )


def strict_but_frozen(names: Iterable[str], where: Path) -> Callable[..., None]:
    """DeepSpeed's `custom_load_fn` for a checkpoint without the frozen weights: a module load that
    lets exactly those be missing (they stay as built) and refuses any other difference."""
    allowed = set(names)

    def load(src: Any, dst: Any) -> None:
        missing, unexpected = dst.load_state_dict(src, strict=False)
        others = sorted(k for k in missing if not of_frozen(k, allowed))
        if others or unexpected:
            raise UserError(
                f"{where}: the saved module does not fit this job's model: missing {others[:5]}, unexpected "
                f"{sorted(unexpected)[:5]} (another peft version or model.lora?); resume with the run's model.lora and peft"
            )

    return load


def base_state(ckpt: Path, exp: Any, rec: dict[str, Any]) -> dict[str, Any]:
    """The frozen weights of an `omitted` checkpoint (`rec`: its record), built from model.pretrained
    as training built them (model.build, the run's precision, adapters applied: the engine's
    parameter names), in fp32 (a quantized base's weights dequantized). For export; checks the digest
    first."""
    import torch

    from trainer import data, model

    ds = json.loads((ckpt / "ds_config.json").read_text())
    precision = {k: ds[k] for k in ("bf16", "fp16") if k in ds}
    tok = data.load_tokenizer(exp.data.tokenizer)
    module = model.build(
        exp.model,
        vocab_size=len(tok),
        eos_id=tok.eos_token_id,
        seq_len=exp.data.seq_len,
        ds_config={**precision, "zero_optimization": {"stage": 0}},
    )
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if precision.get(key, {}).get("enabled"):  # as DeepSpeed casts the parameters
            for p in module.parameters():
                if p.is_floating_point():  # (LLM.int8's weights stay int8, as module.to(dtype) keeps them)
                    p.data = p.data.to(dtype)
    fix = (f"Restore the weights at {exp.model.pretrained}, or give their new place with --set model.pretrained=PATH "
           "(checked against this digest; the checkpoint's own files are not edited)")  # fmt: skip
    problem = mismatch(ckpt, rec, digest(module, zero3=False), fix)
    if problem:
        raise UserError(problem)
    # model.lora.quantization: a quantized weight's values are what the forward computes with (packed
    # values dequantized, as bitsandbytes does); its quantization state is no weight of the model
    deq = {}
    lora = exp.model.lora
    if lora is not None and lora.quantization in ("4bit", "8bit"):
        from trainer.model.quantized import dequantized

        deq = dequantized(module, torch.float32)
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    names |= {n for n, _ in module.named_buffers(remove_duplicate=False)}
    return {
        k: deq.get(k, v).float() for k, v in module.state_dict().items() if "lora_" not in k and k in names
    }
