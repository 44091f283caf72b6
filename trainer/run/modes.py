"""What bin/train does with a built Run (trainer/run/build.py): train, or one of the one-off modes.

- train (the default): the loop to train.max_steps, with evaluation, checkpoints, wandb; an
  out-of-memory or a non-finite loss ends it through a small handler each;
- `--check`: the consistency checks, one step and a checkpoint round trip (multi-node bring-up);
- `--overfit-batch`: train on one fixed batch, a quick proof that the pipeline learns (loss -> 0);
- `--profile`: a torch.profiler trace of a few steps after warm-up, and the top operators;
- `--dry-run`: build everything (process group, data, model, engine, a checkpoint to resume), no step.

`--overfit-batch` and `--profile` write into `<run_dir>/overfit-batch` and `<run_dir>/profile`,
start from fresh weights, evaluate nothing and save no checkpoint, so they never disturb a run.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from trainer.run.attempt import start, start_wandb, steps, training
from trainer.run.build import Run
from trainer.run.profile import profile

log = logging.getLogger("trainer")

MODES = ("check", "overfit_batch", "profile", "dry_run")  # the one-off modes, as argparse names them
SUBDIR = {"overfit_batch": "overfit-batch", "profile": "profile"}  # modes that get their own run dir


class FixedBatch:
    """--overfit-batch: this rank's first micro batch, at every micro step."""

    def __init__(self, stream: Any) -> None:
        self.sampler = stream.sampler
        self.steps_per_epoch = stream.steps_per_epoch
        self.record = stream.record
        # the fixed batches' target tokens over every rank (as training's loss_denominator counts them)
        targets = getattr(stream, "targets", None)
        self.targets = None if targets is None else int(targets[next(stream._ahead(1))].sum())
        self.batch = stream.next()
        self.position = stream.position
        self._stream = stream

    def __getattr__(self, name: str) -> Any:  # the rest as the stream has it (the banner's padding())
        if "_stream" not in self.__dict__ or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["_stream"], name)

    def loss_denominator(self, micro_steps: int) -> float | None:
        """As training's (stream.loss_denominator): the step's target tokens over every rank, divided by
        ranks x micro steps; every micro step is the same batch. So the loss is the mean over the
        targets (under sequence parallelism too: not over positions), a rank whose batch has no target
        adds 0 (not NaN). None for token blocks (every micro batch as many targets)."""
        start = getattr(self._stream, "step_start", None)  # (kto: the step's KL over its micro batches)
        if start is not None:
            start([self.batch] * micro_steps)
        if self.targets is None:
            return None
        return max(self.targets * micro_steps, 1) / (self.sampler.world * micro_steps)

    def step_tokens(self, micro_steps: int) -> int | None:
        """Fine-tuning rows: this rank's batch as fed, counted for every rank (the ranks' batches differ
        in width; --overfit-batch does not gather them)."""
        rows = getattr(self.batch, "rows", self.batch)  # (preference pairs: their rows)
        if rows.dim() != 3:
            return None
        return int(rows.shape[0] * rows.shape[-1]) * self.sampler.world * micro_steps

    def next(self) -> Any:
        if self.record is not None:
            from trainer.data.stream import row_digest

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


# What a kernel or operator does, from its name: the first pattern that matches (lower case).
def train(run: Run) -> int:
    """The default mode: train to train.max_steps (or a stop request), then report."""
    start(run, checks=False)
    start_wandb(run)
    return training(run, lambda: steps(run, run.exp.train.max_steps))


# ----------------------------------------------------------------------------- the one-off modes


def overfit_batch(run: Run) -> int:
    """--overfit-batch: train.max_steps steps on this rank's first micro batch."""
    if hasattr(run.stream, "samplers"):  # distill's generated steps (trainer/objectives/on_policy.py)
        from trainer.common.errors import UserError

        raise UserError("--overfit-batch repeats one batch of the data, and train.distill.lmbda or seq_kd samples new "
                        "completions at every step: set lmbda: 0 and seq_kd: false to overfit the data's batch")  # fmt: skip
    run.stream = FixedBatch(run.stream)
    start(run, checks=False)
    return training(
        run,
        lambda: steps(run, run.exp.train.max_steps),
        verdict=lambda first, last: overfit_verdict(first, last, run.samples_per_step),
    )


def dry_run(run: Run) -> int:
    start(run, checks=False)
    log.info(
        f"dry run: everything is built{' and the checkpoint loaded' if run.resume else ''}; no step taken"
    )
    return 0


def check_run(run: Run) -> int:
    """--check: the preflight; one training step and the post-step checks; a checkpoint round trip
    (save, take another step, load: the loss on a fixed batch must come back exactly)."""
    import numpy as np
    import torch

    from trainer.checkpoint import Found, Store, read_state, restore
    from trainer.data.stream import _collate
    from trainer.run import consistency

    start(run, checks=True)
    engine, stream, state, env = run.engine, run.stream, run.state, run.env

    def one_step() -> None:  # every micro batch of an optimizer step (DeepSpeed updates at the last)
        per_micro = stream.loss_denominator(run.exp.train.grad_accum)  # as training normalises it
        for _ in range(run.exp.train.grad_accum):
            engine.backward_step(engine.forward(stream.next(), per_micro))

    lr = engine.lr  # the first step's (a warmup from 0: the adapter's B matrices stay zero)
    one_step()
    state.step, state.moved = 1, lr > 0 and engine.applied
    for line in consistency.after_first_step(engine, env.world_size, run.hosts):
        log.info(line)
    rows = np.asarray(run.data.train[: stream.sampler.micro])
    probe = (
        _collate((rows, np.arange(len(rows)))) if rows.ndim == 4 else torch.from_numpy(rows.astype("int64"))
    )

    def probe_loss() -> float:  # the mean over the batch's targets (eval_loss sums them)
        engine.train(False)
        loss = float(engine.eval_loss(probe, split="train")) / max(1.0, float(engine.eval_weight(probe)))
        engine.train(True)
        return loss

    scratch = Path(run.exp.run_dir) / ".check"
    store = Store(
        scratch / "checkpoints", engine=engine, stream=stream, exp=run.exp, rank=env.rank,
        world_size=env.world_size, layout=run.layout, faults=run.faults,
    )  # fmt: skip
    saved = store.save(state)
    before = probe_loss()
    one_step()  # move the weights away
    moved = probe_loss()
    restore.load(store, Found(saved, read_state(saved)), state)
    after = probe_loss()
    store.barrier()
    if env.rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    if after != before:
        raise consistency.CheckFailed(
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


RUN = {
    "train": train,
    "check": check_run,
    "overfit_batch": overfit_batch,
    "profile": profile,
    "dry_run": dry_run,
}
