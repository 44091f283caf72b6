"""The family matrix's two-rank half, one process per rank (torchrun --nproc_per_node 2), every family
in turn (tests/dist/test_family_matrix.py runs it once): for helpers.MATRIX's tiny models on two
fine-tuning rows (one example; two packed), against one rank computing both rows with the model's
own attention and masks (bin/train's loss functions, trainer/engine.py, normalised by the targets):

- sequence parallel 2: the project's Ulysses attention (trainer/model/sequence.py: the masks dropped,
  each example and window kept by its core), each rank half of every row, gradients summed over the
  group; or the family check's refusal (ulysses_verdict);
- ZeRO-3 on 2 ranks: DeepSpeed's engine, each rank one row, the gathered gradients after backward;
- pipeline stages 2 (trainer/model/stages.py): DeepSpeed's pipeline engine, each row a micro batch through both
  stages, the stages' gradients by the model's names.

Rank 0 writes {family: {"sp": {...} or {"refused": why}, "zero3": {...}}} to argv[1] as JSON."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers import MATRIX, matrix_config, matrix_rows  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from trainer.engine import plain_loss, sequence_parallel_loss  # noqa: E402
from trainer.model import sequence  # noqa: E402

ATTENTION = {"gpt_oss": "eager"}  # no sdpa path for its sinks in transformers


def build(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    kernel = ATTENTION.get(model_type, "sdpa")
    return (
        AutoModelForCausalLM.from_config(matrix_config(model_type), attn_implementation=kernel)
        .float()
        .train()
    )


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(loss: float, got: dict, ref_loss: float, ref: dict) -> dict:
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))[:5]
    worst = max(((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30)).item() for k in ref)
    return {"loss": abs(loss - ref_loss) / abs(ref_loss), "grads": worst, "params": len(ref)}


def sequence_parallel(model_type: str, rows: torch.Tensor, targets: float, ref: tuple, rank: int) -> dict:
    problem = sequence.ulysses_verdict(matrix_config(model_type), "sdpa")
    if problem is not None:
        return {"refused": problem}
    model = build(model_type)
    core = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        sequence.register_ulysses(model, 2, rows.shape[0], rows.shape[-1])
        loss = sequence_parallel_loss(model, rows, targets, 2, rank, False)
        loss.backward()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = core
    total = loss.detach().clone()
    dist.all_reduce(total)  # the shards' summed losses over the step's targets
    g = grads(model)
    for t in g.values():
        dist.all_reduce(t)  # the sequence group's gradients add up (DeepSpeed does so with its mpu)
    return compare(total.item(), g, *ref)


def zero3(model_type: str, rows: torch.Tensor, targets: float, ref: tuple, rank: int) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    model = build(model_type)
    names = [n for n, p in model.named_parameters()]
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "steps_per_print": 10**9}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    # each rank one row; the step's targets over ranks x micro steps, as TrainStream.loss_denominator
    loss = plain_loss(engine, rows[rank : rank + 1], targets / 2)
    engine.backward(loss)
    g = {n: safe_get_full_grad(p).detach().clone() for n, p in zip(names, engine.module.parameters(), strict=True)
         if p.requires_grad and safe_get_full_grad(p) is not None}  # fmt: skip
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    engine.destroy()
    return compare(mean.item() / 2, g, *ref)


def pipeline(model_type: str, rows: torch.Tensor, targets: float, ref: tuple, rank: int) -> dict:
    """Two pipeline stages (trainer/model/stages.py) through DeepSpeed's pipeline engine, each row a micro batch:
    the first stage's ranks send hidden states, the last computes the loss; the gradients by the model's names."""
    import deepspeed

    from trainer.engine import Pipeline
    from trainer.model.stages import items, model_names, pipeline

    model = build(model_type)
    if getattr(model.config.get_text_config(), "output_router_logits", False):
        return {"refused": "router logits"}
    parts = [0, len(items(model)[0]) // 2, len(items(model)[0])]
    module = pipeline(model, 2, parts)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "train_batch_size": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10**9}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
    pipe = Pipeline(engine, type("Stub", (), {"on_backward": None})())
    loss = pipe.run([rows[:1], rows[1:]], targets / 2) / 2  # (the micro losses' mean, summed back over 2)
    names = model_names(engine.module)
    mine = {
        names[n]: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None
    }
    every: list = [None, None]
    dist.all_gather_object(every, mine)
    engine.destroy()
    from deepspeed.utils import groups

    groups.mpu = None  # (the pipeline's grid, which DeepSpeed keeps for the next engine of this process)
    return compare(loss.item(), {k: v for part in every for k, v in part.items()}, *ref)


def main() -> None:
    from trainer.cluster import dist as trainer_dist

    trainer_dist.setup(600.0)  # as bin/train starts a rank (gloo; no JIT build of DeepSpeed's shm op)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    rows = matrix_rows()
    targets = float((rows[:, 1, 1:] != -100).sum())
    out = {}
    for model_type in sys.argv[2:] or MATRIX:
        reference = build(model_type)
        loss = plain_loss(reference, rows, targets)  # one rank, both rows, the model's own attention
        loss.backward()
        ref = (loss.item(), grads(reference))
        out[model_type] = {"sp": sequence_parallel(model_type, rows, targets, ref, rank),
                           "zero3": zero3(model_type, rows, targets, ref, rank),
                           "pp": pipeline(model_type, rows, targets, ref, rank)}  # fmt: skip
        if rank == 0:
            print(model_type, json.dumps(out[model_type]), flush=True)
    if rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
