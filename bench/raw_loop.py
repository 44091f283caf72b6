"""A minimal hand-written DeepSpeed training loop: the reference that `bench/bench.py compare` puts
bin/train against. Same model config, DeepSpeed JSON, seed and data order as bin/train, and nothing
else: no checks, no metrics beyond a loss read every `log_every` steps (the sync any logging loop
has), no checkpoints.

    deepspeed --num_gpus N bench/raw_loop.py --spec SPEC.json

SPEC.json (written by bench/compare.py): ds_config, model_config, seed, data (a packed dataset directory),
micro, grad_accum, steps, log_every, loader settings, compile, chunked_loss, out (a JSON file rank 0
writes). With chunked_loss the model gets trainer/model/loss.py's forward, the one piece of ours it
imports: the loss is part of the model being measured, not of the loop.
"""

import argparse
import contextlib
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

if os.environ.get("TRAINER_CPU") == "1":  # bench.py --cpu: the deepspeed launcher made the GPUs
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # visible again; hide them before torch sees them

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def digest(module: torch.nn.Module) -> str:
    """sha256 of every parameter (gathered under ZeRO-3), in name order: the digest bin/train's test
    reports carry (trainer/run/consistency.py), written out here so that the reference imports nothing of ours."""
    params = list(module.named_parameters())
    ctx = contextlib.nullcontext()
    if params and hasattr(params[0][1], "ds_id"):
        ctx = deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
    h = hashlib.sha256()
    with ctx, torch.no_grad():
        for name, p in params:
            h.update(name.encode())
            h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def init_distributed(cuda: bool) -> tuple[int, int]:
    """This rank's device and process group: (rank, world size)."""
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not cuda:
        # Like bin/train, skip the shared-memory all-reduce op DeepSpeed's CPU backend JIT-compiles
        # at init (40 s on a fresh machine): only inference tensor parallelism uses it, so the
        # training step is the same without it, and the benchmark measures steps.
        import deepspeed.comm.torch as _  # noqa: F401  (as _: a bare import would make deepspeed local)

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size()


def build_engine(spec: dict, ds_config: dict) -> tuple:
    """The model: same config, same seed on every rank; built partitioned at ZeRO-3. Returns the
    engine and the HfDeepSpeedConfig (None below ZeRO-3), which must stay alive while the model lives."""
    seed_all(spec["seed"])
    zero3 = ds_config.get("zero_optimization", {}).get("stage") == 3
    keep = HfDeepSpeedConfig(ds_config) if zero3 else None
    attn = {"attn_implementation": spec["attn_implementation"]} if spec.get("attn_implementation") else {}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec["model_config"]), **attn)
    if spec.get("chunked_loss"):
        # model.chunked_loss is part of the model under test, not of the loop: the same loss here.
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from trainer.model.loss import attach

        attach(model, zero3=zero3)
    decay = [q for q in model.parameters() if len(getattr(q, "ds_shape", q.shape)) >= 2]
    no_decay = [q for q in model.parameters() if len(getattr(q, "ds_shape", q.shape)) < 2]
    groups = [
        {"params": decay, "weight_decay": spec["weight_decay"]},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)
    if scheduler is not None:  # as bin/train does (trainer/engine.py: start_schedule)
        scheduler.step()
    if spec.get("compile"):
        mode = spec.get("compile_mode", "default")
        engine.compile(compile_kwargs={} if mode == "default" else {"mode": mode})
    return engine, keep


class Sampler(torch.utils.data.Sampler):
    """This rank's micro batches of the epoch set last (a DistributedSampler with set_epoch, as
    a hand-written loop has, so that persistent workers live across epochs)."""

    epoch = 0

    def __init__(self, seed: int, n: int, world: int, rank: int, micro: int) -> None:
        self.seed, self.n, self.world, self.rank, self.micro = seed, n, world, rank, micro

    def __iter__(self):
        n, world, micro = self.n, self.world, self.micro
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        steps = n // (world * micro)
        return iter(
            order[: steps * world * micro].reshape(steps, world, micro)[:, self.rank, :].reshape(-1).tolist()
        )

    def __len__(self) -> int:
        return self.n // (self.world * self.micro) * self.micro


def make_loader(spec: dict, rank: int, world: int, cuda: bool) -> tuple[DataLoader, Sampler]:
    """The data: each epoch a seeded permutation of the packed blocks; each micro step takes the
    next world x micro blocks, and this rank its slice."""
    train = np.load(spec["data"], mmap_mode="r")  # the packed blocks bin/train's data cache holds
    micro, n = spec["micro"], len(train)
    sampler = Sampler(spec["seed"], n, world, rank, micro)
    workers = spec["num_workers"]
    loader = DataLoader(
        range(n),
        batch_size=micro,
        sampler=sampler,
        collate_fn=lambda idx: torch.from_numpy(train[np.asarray(idx)].astype(np.int64)),
        num_workers=workers,
        pin_memory=cuda and spec["pin_memory"],
        persistent_workers=workers > 0 and spec.get("persistent_workers", True),
        # its own generator: a default DataLoader draws from the global RNG (dropout) per iterator
        generator=torch.Generator().manual_seed(0),
    )
    return loader, sampler


def train_steps(
    engine: deepspeed.DeepSpeedEngine, loader: DataLoader, sampler: Sampler, spec: dict
) -> list[dict]:
    """spec["steps"] optimizer steps: each log_every steps (and the last) the loss is read, and the
    mean step time of the interval since the previous read kept."""
    epoch, it = 0, iter(loader)
    times, t = [], time.perf_counter()
    for step in range(1, spec["steps"] + 1):
        for _ in range(spec["grad_accum"]):
            try:
                batch = next(it)
            except StopIteration:
                epoch += 1
                sampler.epoch = epoch
                it = iter(loader)
                batch = next(it)
            batch = batch.to(engine.device, non_blocking=True)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
        if step % spec["log_every"] == 0 or step == spec["steps"]:
            value = loss.item()
            now = time.perf_counter()
            times.append(
                {
                    "step": step,
                    "step_time_s": (now - t) / (step - (times[-1]["step"] if times else 0)),
                    "loss": value,
                }
            )
            t = now
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    spec = json.loads(Path(p.parse_args().spec).read_text())
    cuda = torch.cuda.is_available()
    rank, world = init_distributed(cuda)
    engine, keep = build_engine(spec, spec["ds_config"])  # keep: alive as long as the model
    seed_all(spec["seed"] + 1 + rank)  # dropout differs per rank
    loader, sampler = make_loader(spec, rank, world, cuda)
    times = train_steps(engine, loader, sampler, spec)
    final = digest(engine.module)
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump({"intervals": times, "param_digest": final}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
