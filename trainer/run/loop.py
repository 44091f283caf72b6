"""The training loop. Everything is built before it is called; it only calls, in order."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("trainer")


@dataclass
class TrainState:
    """The whole training state besides what DeepSpeed and the data stream hold."""

    step: int = 0
    samples: int = 0
    tokens: int = 0
    started_at: float = field(default_factory=time.time)
    wall_time: float = 0.0  # seconds trained, summed over resumed attempts
    stopped: bool = False  # ended early on a stop request (preemption signal)
    failed: str = ""  # why every rank stopped (a non-finite loss)
    # A step with a nonzero learning rate was taken: from then on LoRA's B matrices, which start at
    # zero, are nonzero (a warmup from 0 leaves them zero through its first step).
    moved: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "samples": self.samples,
            "tokens": self.tokens,
            "wall_time": self.wall_time,
            "moved": self.moved,
        }


class Evaluator:
    """Mean loss over the eval batches, averaged over ranks (all ranks call it at the same steps)."""

    def __init__(
        self,
        batches: Any,
        every: int,
        world_size: int,
        prompts: tuple[Any, list[str], int, bool] | None = None,
    ) -> None:
        self.batches, self.every, self.world_size = batches, every, world_size
        self.prompts = prompts  # (tokenizer, prompts, max new tokens, rendered by a chat template): greedy
        # samples at each eval
        self.last_step = -1
        self.extra: dict[str, Any] = {}  # a preference objective's eval rewards, margin and accuracy

    def due(self, step: int) -> bool:
        return self.batches is not None and self.every > 0 and step % self.every == 0

    def run(self, engine: Any, step: int) -> float | None:
        import torch
        import torch.distributed as dist

        if self.batches is None:
            return None
        self.last_step = step
        engine.train(False)
        if hasattr(engine.objective, "eval_start"):  # (kto: the eval set's KL, before its batches)
            engine.objective.eval_start(engine, self.batches)
        total = torch.zeros(2, dtype=torch.float64, device=engine.device)
        for batch in self.batches:  # a mean over batches (text), or over target tokens (fine-tuning)
            total[0] += engine.eval_loss(batch).double()
            total[1] += engine.eval_weight(batch)
        engine.train(True)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(total)
        if engine.objective is not None:
            self.extra = engine.objective.flush(self.world_size, "eval")
        return (total[0] / total[1].clamp(min=1)).item()

    def samples(self, engine: Any) -> list[dict[str, Any]] | None:
        """Greedy completions of train.eval_prompts (every rank), or None."""
        if not self.prompts or not self.prompts[1]:
            return None
        tok, prompts, max_new, *rendered = self.prompts
        synced = self.world_size > 1 and engine.ds.zero_optimization_stage() == 3
        from trainer.engine import complete

        return complete(engine, tok, prompts, max_new, synced, rendered=bool(rendered and rendered[0]))


def micro_steps(
    engine: Any, stream: Any, grad_accum: int, per_micro: Any, control: Any, metrics: Any, step: int
) -> tuple[Any, float, Any]:
    """A step's micro batches, forward and backward (the optimizer's update is the loop's): their summed loss, the
    seconds spent waiting for data, whether every loss was finite."""
    loss, wait, finite = 0.0, 0.0, None
    if (
        getattr(engine, "pipe", None) is not None
    ):  # pipeline stages: DeepSpeed's 1F1B schedule runs every micro batch at once
        t = time.perf_counter()
        batches = [stream.next() for _ in range(grad_accum)]
        wait += time.perf_counter() - t
        loss = control.faults.loss(engine.pipe.run(batches, per_micro), step)
        return loss, wait, control.finite(loss, None)
    for i in range(grad_accum):
        t = time.perf_counter()
        batch = stream.next()
        wait += time.perf_counter() - t
        with metrics.forward:  # this rank's own compute, no collectives (stragglers)
            micro_loss = control.faults.loss(engine.forward(batch, per_micro), step)  # tests
        micro_loss = engine.backward(micro_loss)
        finite = control.finite(micro_loss, finite)
        loss = loss + micro_loss
        if i < grad_accum - 1:
            engine.step()  # between micro batches DeepSpeed only counts; the update is below
    return loss, wait, finite


def train(
    *,
    max_steps: int,
    grad_accum: int,
    samples_per_step: int,
    tokens_per_sample: int,
    engine: Any,
    stream: Any,
    evaluator: Evaluator,
    checkpointer: Any,
    metrics: Any,
    state: TrainState,
    control: Any,
) -> TrainState:
    """Run optimizer steps until max_steps (or a stop request); evaluate and save on cadence."""
    # Everything built so far (config, data, model, engine) lives to the end: keep it out of the
    # garbage collector's full passes, which a ZeRO-3 step's many short-lived objects trigger.
    gc.collect()
    gc.freeze()
    metrics.start()
    t_attempt = time.perf_counter()
    wall0 = state.wall_time
    while state.step < max_steps:
        control.before_step(state.step + 1)  # injected faults (tests), watchdog heartbeat
        per_micro = stream.loss_denominator(grad_accum)  # fine-tuning: the step's targets, all ranks
        fed = stream.step_tokens(grad_accum)  # fine-tuning: batches are as wide as their longest row
        loss, wait, finite = micro_steps(
            engine, stream, grad_accum, per_micro, control, metrics, state.step + 1
        )
        # One collective per step, on every rank: a non-finite loss on any rank raises here, before
        # the optimizer update (the weights stay as after the previous step); stop, a timed save, and
        # whether every rank has written its part of a checkpoint in flight (then it is committed).
        agreed = control.agree(
            checkpointer.minutes_due(), finite, state.step + 1, checkpointer.write_status()
        )
        stop = agreed.stop
        lr = engine.lr  # the LR this step applies (the scheduler moves after it)
        engine.step()
        state.moved = state.moved or (lr > 0 and engine.applied)
        state.step += 1
        state.samples += samples_per_step
        fed = samples_per_step * tokens_per_sample if fed is None else fed
        state.tokens += fed
        state.wall_time = wall0 + time.perf_counter() - t_attempt
        metrics.step(state.step, loss / grad_accum, wait, engine, tokens=state.tokens, lr=lr, fed=fed)
        if evaluator.due(state.step) and not stop:  # a stop's grace period is for the save
            control.heartbeat()
            with metrics.paused():  # step time and throughput count training only
                metrics.eval(
                    state.step, evaluator.run(engine, state.step), evaluator.samples(engine), evaluator.extra
                )
        control.heartbeat()
        with metrics.paused():
            checkpointer.offer(state, force=stop, time_due=agreed.timed, agreed=agreed)
        if stop:
            control.disarm()
            log.info(f"stopping at step {state.step} on request; checkpoint saved")
            state.stopped = True
            return state
    control.heartbeat()
    if evaluator.batches is not None and evaluator.last_step != state.step:
        metrics.eval(
            state.step, evaluator.run(engine, state.step), evaluator.samples(engine), evaluator.extra
        )
    control.heartbeat()
    checkpointer.offer(state, final=True)
    control.disarm()
    return state
