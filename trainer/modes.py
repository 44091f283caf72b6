"""The one-off modes of bin/train, each run after everything is built:

- `--check`: the consistency checks, one training step and a checkpoint round trip (multi-node
  bring-up);
- `--overfit-batch`: train on one fixed batch, a quick proof that the pipeline learns (the loss
  must approach zero);
- `--profile`: a torch.profiler trace of a few steps after warm-up, and the top operators;
- `--dry-run`: build everything (process group, data, model, engine, a checkpoint to resume) and
  take no step.

`--overfit-batch` and `--profile` write into `<run_dir>/overfit-batch` and `<run_dir>/profile`,
start from fresh weights, evaluate nothing and save no checkpoint, so they never disturb a run.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger("trainer")

MODES = ("check", "overfit_batch", "profile", "dry_run")
SUBDIR = {"overfit_batch": "overfit-batch", "profile": "profile"}  # modes that get their own run dir


class FixedBatch:
    """--overfit-batch: this rank's first micro batch, at every micro step."""

    def __init__(self, stream: Any) -> None:
        self.sampler = stream.sampler
        self.steps_per_epoch = stream.steps_per_epoch
        self.record = stream.record
        self.batch = stream.next()
        self.position = stream.position

    def next(self) -> Any:
        if self.record is not None:
            from trainer.checks import row_digest

            self.record += [row_digest(row) for row in self.batch]
        return self.batch


def overfit_verdict(first: float | None, last: float | None, sequences: int) -> str:
    if first is None or last is None:
        return "overfit-batch: no loss was logged"
    ok = last < 0.1 * first
    return f"overfit-batch: loss {first:.4f} -> {last:.4f} on one fixed batch of {sequences} sequences" + (
        ": the pipeline learns"
        if ok
        else "; it should approach zero: check optim.lr, the labels and the data before a long run"
    )


def profile(run: Any, state: Any, *, run_dir: Path, rank: int, device: Any, warmup: int, active: int) -> Path:
    """Run `warmup` steps, then `active` steps under torch.profiler; every rank writes its Chrome
    trace (`trace_rank00000.json`, open in chrome://tracing or Perfetto); rank 0 prints the top
    operators by self time, and the time by kind of work (`time_by_kind`): on a GPU, kernel time
    against the wall time of the traced steps, so that a device waiting for the host shows."""
    import time

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    run(state.step + warmup)
    cuda = getattr(device, "type", None) == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities, record_shapes=True) as prof:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run(state.step + active)
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    path = Path(run_dir) / f"trace_rank{rank:05d}.json"
    prof.export_chrome_trace(str(path))
    if rank == 0:
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        averages = prof.key_averages()  # grouping every event of the trace: once
        log.info(f"profile: steps {state.step - active + 1}-{state.step}; top operators by self time:")
        log.info(averages.table(sort_by=sort, row_limit=15))
        try:  # a summary of the table above: never worth losing the trace over
            log.info(time_by_kind(averages, cuda, wall))
        except Exception as e:  # noqa: BLE001 (profiler event fields differ between torch versions)
            log.warning(f"profile: no time by kind ({type(e).__name__}: {e})")
        log.info(
            f"profile: trace written to {path} (one per rank; open in chrome://tracing or ui.perfetto.dev)"
        )
    return path


# What a kernel or operator does, from its name: the first pattern that matches (lower case).
KINDS = (
    ("communication", ("nccl", "gloo", "all_reduce", "allreduce", "all_gather", "reduce_scatter", "c10d")),
    ("optimizer", ("adam", "multi_tensor_apply", "optimizer", "_foreach")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")),
    ("matmul", ("gemm", "xmma", "cutlass", "cublas", "nvjet", "triton_tem", "aten::mm", "aten::addmm", "aten::bmm")),
    ("copies", ("memcpy", "memset", "aten::copy_", "aten::cat", "aten::_to_copy", "aten::contiguous")),
)  # fmt: skip
OTHER = "elementwise and reductions"


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pats in KINDS if any(p in low for p in pats)), OTHER)


def time_by_kind(averages: Any, cuda: bool, wall: float) -> str:
    """One line: the share of device kernel time (CPU: operator self time) per kind of work, and on
    a GPU how busy its kernels kept it during the traced steps (`wall` seconds)."""
    from torch.autograd import DeviceType

    spent: dict[str, float] = {}
    for e in averages:
        if cuda:
            if e.device_type != DeviceType.CUDA:
                continue  # kernels only: an operator's device time is its kernels' again
            us = e.self_device_time_total or e.device_time_total
        else:
            us = e.self_cpu_time_total
        kind = kind_of(e.key)
        spent[kind] = spent.get(kind, 0.0) + us
    total = sum(spent.values())
    if total <= 0:
        return "profile: no timed work recorded"
    shares = ", ".join(
        f"{k} {v / total:.0%}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v / total >= 0.005
    )
    if cuda:
        busy = total / 1e6 / max(wall, 1e-9)
        return (
            f"profile: GPU kernels {total / 1e6:.3f} s in {wall:.3f} s of traced steps (busy {busy:.0%}"
            + ("; the GPU waits for the host: launch overhead, syncs, data" if busy < 0.9 else "")
            + f"); by kind: {shares}"
        )
    return f"profile: CPU operator time by kind: {shares}"


def check(
    exp: Any, engine: Any, stream: Any, data: Any, state: Any, env: Any, hosts: list[str], layout: Any
) -> int:
    """--check: the preflight passed; now one training step, the post-step checks, and a checkpoint
    round trip (save, take another step, load: the loss on a fixed batch must come back exactly)."""
    import torch

    from trainer import checks
    from trainer.checkpoint import Found, Store, read_state

    engine.backward_step(engine.forward(stream.next()))
    state.step = 1
    for line in checks.after_first_step(engine, env.world_size, hosts):
        log.info(line)
    probe = torch.from_numpy(data.train[: stream.sampler.micro].astype("int64"))

    def probe_loss() -> float:
        engine.train(False)
        loss = float(engine.eval_loss(probe))
        engine.train(True)
        return loss

    scratch = Path(exp.run_dir) / ".check"
    store = Store(
        scratch / "checkpoints", engine=engine, stream=stream, exp=exp, rank=env.rank,
        world_size=env.world_size, layout=layout,
    )  # fmt: skip
    saved = store.save(state)
    before = probe_loss()
    engine.backward_step(engine.forward(stream.next()))  # move the weights away
    moved = probe_loss()
    store.load(Found(saved, read_state(saved)), state)
    after = probe_loss()
    store.barrier()
    if env.rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    if after != before:
        raise checks.CheckFailed(
            f"checkpoint round trip changed the loss on a fixed batch: {before!r} before saving, {after!r} after "
            f"loading (and {moved!r} in between)"
        )
    moved_note = "" if moved != before else " (unchanged: the learning rate is 0 at this step)"
    log.info(
        f"check: checkpoint round trip ok: loss on a fixed batch {before!r} at save, {moved!r} after another "
        f"step{moved_note}, {after!r} after loading"
    )
    log.info("check passed")
    return 0


def probe_logits(directory: str, engine: Any, data: Any, rank: int) -> None:
    """Tests: the engine's logits on the first two training sequences (compared with an export)."""
    import torch

    ids = torch.from_numpy(data.train[:2].astype("int64"))
    engine.train(False)
    with torch.no_grad():
        logits = engine.ds(input_ids=ids.to(engine.device)).logits.float().cpu()
    engine.train(True)
    if rank == 0:
        torch.save({"input_ids": ids, "logits": logits}, Path(directory) / "probe.pt")
