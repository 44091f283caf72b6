"""LoRA checkpoints without the frozen base (model.lora with model.pretrained).

The base's weights never change in a LoRA run, and the pretrained model they came from is named in
the experiment, so checkpoints leave them out (DeepSpeed's `exclude_frozen_parameters`, what the
Hugging Face Trainer does for peft models): a checkpoint of a 7B model's adapters is megabytes of
adapter state, not 14 GB of base weights again at every save. What makes that safe:

- every checkpoint records a digest of the frozen weights as the engine held them (`digest`); a
  resume builds the model from model.pretrained as the run did and refuses, naming the path, when
  the digest differs (a changed or replaced pretrained model would otherwise resume silently wrong);
- export (and `consolidated_state_dict`) takes the frozen weights from model.pretrained, rounded to
  the precision the run trained in, exactly what the engine held.

A base built from a config (no model.pretrained: random weights nobody can name) is saved as
before. Resharding to another stage or world size loaded the frozen weights from the built model
already (DeepSpeed's universal format holds only what the optimizer trains).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

KEY = "frozen_weights"  # in trainer_state.json: {"omitted": true, "pretrained": ..., "digest": ...}
CHUNK = 1 << 24  # elements per step of the digest (bounds its temporary int64 copy)


def omitted(exp: Any) -> bool:
    """Whether this experiment's checkpoints leave the frozen base out."""
    return not exp.model.checkpoints_hold_frozen


def digest(module: Any, zero3: bool) -> str:
    """A digest of the frozen parameters' values as this engine holds them ("<dtype>:<16 hex>"), the
    same on every rank and at every stage and world size: per parameter, the sum and the sum of squares of its bytes
    read as int16 (exact integers, independent of the order and of ZeRO-3's partitioning and zero
    padding; at ZeRO-3 each rank sums its partitions and the sums are all-reduced). Every rank calls
    it (a collective at ZeRO-3)."""
    import torch

    names, sums, dtypes = [], [], set()
    for name, p in module.named_parameters():
        if p.requires_grad:
            continue
        local = p.ds_tensor if zero3 and hasattr(p, "ds_tensor") else p
        dtypes.add(str(local.dtype).removeprefix("torch."))
        bits = local.detach().reshape(-1).view(torch.int16)
        s1 = torch.zeros((), dtype=torch.int64, device=bits.device)
        s2 = torch.zeros((), dtype=torch.int64, device=bits.device)
        for i in range(0, bits.numel(), CHUNK):
            x = bits[i : i + CHUNK].to(torch.int64)
            s1 += x.sum()
            s2 += (x * x).sum()
        names.append(name)
        sums.append(torch.stack([s1, s2]).cpu())
    if not sums:
        return ""
    table = torch.stack(sums)
    if zero3:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            # on the GPU where the backend is NCCL (offloaded partitions were summed on the CPU)
            on = (
                torch.device("cuda", torch.cuda.current_device())
                if dist.get_backend() == "nccl"
                else table.device
            )
            table = table.to(on)
            dist.all_reduce(table)
    rows = dict(zip(names, table.cpu().tolist(), strict=True))
    return f"{'+'.join(sorted(dtypes))}:{hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]}"


def leave_out_aliases(ds: Any) -> None:
    """DeepSpeed's `exclude_frozen_parameters` drops the frozen parameters that named_parameters()
    lists, but not a state-dict key that is another name of one: a tied LM head (`lm_head.weight`
    is the embedding, vocabulary x hidden) would still be saved. Drop every name of a frozen
    parameter from the engine's module state when frozen weights are excluded."""
    names = {n for n, p in ds.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    original = ds.module_state_dict

    def module_state_dict(*args: Any, **kwargs: Any) -> Any:
        sd = original(*args, **kwargs)
        if kwargs.get("exclude_frozen_parameters"):
            for name in names & set(sd):
                del sd[name]
        return sd

    ds.module_state_dict = module_state_dict


def record(exp: Any, value: str) -> dict[str, Any]:
    return {"omitted": True, "pretrained": exp.model.pretrained, "digest": value}


def saved(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """The checkpoint's record, where its frozen weights were left out."""
    rec = (state or {}).get(KEY)
    return rec if rec and rec.get("omitted") else None


def mismatch(ckpt: Path, rec: dict[str, Any], pretrained: str | None, current: str) -> str | None:
    """Why this job's frozen weights cannot continue `ckpt`'s run, or None."""
    if current == rec["digest"]:
        return None
    held, holds = rec["digest"].partition(":")[0], current.partition(":")[0]
    if held != holds:
        return (
            f"{ckpt} was trained with its frozen weights in {held}, this job holds them in {holds}: resume at "
            "the run's precision (train.precision; 'auto' is bf16 on a GPU that has it, fp32 on CPU)"
        )
    return (
        f"{ckpt} was trained on frozen weights from model.pretrained={rec['pretrained']} (digest {rec['digest']}), "
        f"which its checkpoints leave out; this job's model.pretrained={pretrained} gives other weights "
        f"(digest {current}). Point model.pretrained at the model the run started from, unchanged"
    )


def base_state(ckpt: Path, exp: Any) -> dict[str, Any]:
    """The frozen weights of an `omitted` checkpoint, from model.pretrained with the run's adapters
    applied (the engine's parameter names), in fp32, rounded through bf16/fp16 where the run
    trained in it (what the engine held). For export; checks the digest first."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint import read_state
    from trainer.errors import UserError
    from trainer.model import adapters

    rec = saved(read_state(ckpt))
    ds_config = json.loads((ckpt / "ds_config.json").read_text())
    dtype = next(
        (
            t
            for key, t in (("bf16", torch.bfloat16), ("fp16", torch.float16))
            if ds_config.get(key, {}).get("enabled")
        ),
        torch.float32,
    )
    base = AutoModelForCausalLM.from_pretrained(exp.model.pretrained, dtype=torch.float32)
    module = adapters.apply(base, exp.model.lora).to(dtype)
    if rec is not None:
        problem = mismatch(ckpt, rec, exp.model.pretrained, digest(module, zero3=False))
        if problem:
            raise UserError(problem)
    return {k: v.float() for k, v in module.state_dict().items() if "lora_" not in k}
