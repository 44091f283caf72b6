"""A thin wrapper over the DeepSpeed engine: initialize, forward/backward/step, eval. Nothing else.

DeepSpeed owns the optimizer, the LR schedule, gradient accumulation (it scales the loss by
1/grad_accum and steps only at the accumulation boundary), clipping and mixed precision, all as
written in the DeepSpeed JSON.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from trainer.model import experts, loss_of


def start_schedule(scheduler: Any) -> None:
    """Step `k` (from 1) applies the LR of DeepSpeed's scheduler iteration k - 1, as the Hugging Face
    Trainer's schedules do (step 1 at 0 under a warmup of W steps, step k at (k - 1) / W of the peak).
    DeepSpeed's schedulers start at iteration -1, whose LR (the minimum) the first step applies, and
    only move to iteration 0 (the minimum again) after it: two steps at LR 0, the peak one step late.
    One step of the scheduler here, before training, removes that; a resume loads the saved iteration
    over it."""
    if scheduler is not None:
        scheduler.step()


def resume_schedule(scheduler: Any) -> None:
    """After a checkpoint is loaded: the LR of the saved iteration under this run's schedule. The
    optimizer's state brings back the LR the saved schedule gave, so a re-planned horizon
    (optim.schedule_steps) or a rescaled peak would otherwise apply one step late; for an unchanged
    schedule this is the same value."""
    if scheduler is not None and getattr(scheduler, "last_batch_iteration", -1) >= 0:
        scheduler.step(scheduler.last_batch_iteration)


def as_one_row(batch: Any) -> Any:
    """Fine-tuning rows (micro, 3, width) -> one row (1, 3, micro x width), the rows end to end.
    flash_attention_2 keeps packed examples apart only in a batch of one row (transformers'
    _is_packed_sequence); each row starts an example, whose first label is never a target, so no
    target crosses rows, and a row's padding is a few sequences of its own."""
    return batch.transpose(0, 1).reshape(batch.shape[1], -1).unsqueeze(0)


def record_fp32_grad_norm(engine: Any) -> None:
    """DeepSpeed's fp32 stage-0 path clips but drops the norm it computed; keep it for logging. Under pipeline
    stages it clips each stage by its own norm (its pipeline grid's model-parallel group is the tensor-parallel
    one, not the stages: PP 2 trained as if unclipped, measured): the norm over every stage instead."""
    ds = engine.ds
    if ds.zero_optimization() or ds.fp16_enabled() or ds.bfloat16_enabled():
        return
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_record() -> None:
        if engine.pipe is not None:
            ds._global_grad_norm = engine.pipe.clip(ds.gradient_clipping())
            return
        ds._global_grad_norm = clip_grad_norm_(
            parameters=ds.module.parameters(), max_norm=ds.gradient_clipping(), mpu=ds.mpu
        )

    ds.clip_fp32_gradients = clip_and_record


class Engine:
    def __init__(
        self,
        model: Any,
        ds_config: Mapping[str, Any],
        param_groups: list[dict[str, Any]],
        compile: bool = False,
        compile_mode: str = "default",
        one_row: bool = False,
        sequence: Any = None,
        objective: Any = None,
        vision: Any = None,
    ) -> None:
        import deepspeed

        self.ds_config = dict(ds_config)
        # sequence parallelism: (degree, rank in its group, DeepSpeed's mpu); host copies: (on, pinned)
        self.sp, self.sp_rank, mpu = (sequence or {}).get("sp", (1, 0, None))
        self.offload = (sequence or {}).get("offload", (False, False))
        # ZeRO-3's reduce-scatter averages over every rank, not the data-parallel ones (DeepSpeed 0.19.8,
        # stage3.py __avg_scatter_grads): 1/sp of the gradients (measured 0.5 at sp 2); backward scales by sp
        zero3 = self.ds_config.get("zero_optimization", {}).get("stage", 0) == 3
        self.grad_scale = self.sp if zero3 else 1
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=param_groups, config=self.ds_config, mpu=mpu
        )
        start_schedule(self.scheduler)
        # pipeline stages (trainer/model/stages.py): DeepSpeed's schedule runs a step's micro batches (`Pipeline`)
        self.pipe = Pipeline(self.ds, self) if hasattr(self.ds, "train_batch") else None
        if compile:  # torch.compile of the module, wrapped so ZeRO's hooks still run
            self.ds.compile(compile_kwargs={} if compile_mode == "default" else {"mode": compile_mode})
        self.device = self.ds.device
        self.on_backward: Any = None  # tests: called after backward, before the optimizer step
        self.saved_probe: Any = None  # tests: a context around training forward passes (SavedActivations)
        self.one_row = one_row  # flash_attention_2: fine-tuning rows as one (as_one_row)
        self.vision = vision  # a vision-language model's inputs (trainer/model/vision.py Inputs)
        self.objective = objective  # a preference objective (trainer/objectives/), None: the model's loss
        if objective is not None:
            objective.device = self.device
        self.experts = experts.router(
            model
        )  # a mixture of experts returning router logits: (aux coef, ExpertLoad)
        if self.experts is not None:  # each expert-parallel rank's load, logged
            from trainer.strategy.planning.axes import parallel_degrees

            self.experts[1].ep = parallel_degrees(self.ds_config)[1]
        # varlen attention: each micro batch's example lengths, from its position ids on the host
        self.varlen = getattr(getattr(model, "config", None), "_attn_implementation", None) == "varlen"
        record_fp32_grad_norm(self)

    def forward(self, batch: Any, num_items: float | None = None) -> Any:
        """The loss of one micro batch (kept in the graph for backward). `batch`: token blocks (text,
        every token a target), or rows of [input_ids, labels, position_ids] (fine-tuning: the labels
        mark the targets, the position ids restart at each packed example so that attention stays
        within it); `num_items`: divide the targets' summed loss by this (the step's targets over
        every rank and micro batch, divided by ranks x accumulation, since DeepSpeed averages over
        both) instead of this micro batch's target count."""
        tensor = hasattr(batch, "dim")  # (grpo's rollouts: the objective's rows carry their position ids)
        extra = varlen_lengths(batch, self.device) if self.varlen and self.sp == 1 and tensor else None
        return self._loss(batch.to(self.device, non_blocking=True), num_items, extra)

    def _loss(self, batch: Any, num_items: float | None, extra: dict[str, Any] | None = None) -> Any:
        from trainer.model.sequence import offloaded

        with offloaded(*self.offload), self.saved_probe() if self.saved_probe else contextlib.nullcontext():
            if self.objective is not None:  # preference pairs: the mean of the micro batch's pair losses
                return self.objective.loss(self.ds, batch)
            if self.vision is not None:  # a vision-language model's inputs (trainer/model/vision.py)
                batch, extra = self.vision.apply(batch, extra)
            if self.sp > 1:
                return sequence_parallel_loss(
                    self.ds, batch, num_items, self.sp, self.sp_rank, self.one_row, self.experts
                )
            return plain_loss(
                self.ds,
                as_one_row(batch) if self.one_row and batch.dim() == 3 else batch,
                num_items,
                self.experts,
                extra,
            )

    def backward(self, loss: Any) -> Any:
        """Backward of one micro batch; returns the detached loss (no device synchronisation)."""
        self.ds.backward(loss * self.grad_scale if self.grad_scale != 1 else loss)
        if self.on_backward is not None:
            self.on_backward(self)
        return loss.detach()

    def step(self) -> None:
        """DeepSpeed's step, once per micro batch: it updates only at the accumulation boundary (pipeline stages:
        once a step, the update the schedule held back)."""
        if self.pipe is not None:
            self.pipe.step()
            return
        self.ds.step()

    def backward_step(self, loss: Any) -> Any:
        """Backward, then DeepSpeed's step. Returns the detached loss."""
        out = self.backward(loss)
        self.step()
        return out

    def eval_loss(self, batch: Any, split: str = "eval") -> Any:
        """The summed loss of a batch's targets (`eval_weight`: their count); `split` train: training rows (--check)."""
        import torch

        if self.pipe is not None:  # through the stages: averaged over the data-parallel ranks
            return self.pipe.eval(batch)
        with torch.no_grad():
            if self.objective is not None:  # the pairs' losses, summed (eval_weight: the pairs)
                return self.objective.forward(self.ds, batch.to(self.device), training=False, split=split)
            experts = self.experts  # eval: the LM loss alone (no auxiliary term), no expert load counted
            self.experts = None if experts is None else (experts[0], None)
            try:
                return self._loss(batch.to(self.device, non_blocking=True), 1.0).detach()
            finally:
                self.experts = experts

    def eval_weight(self, batch: Any) -> Any:
        """What `eval_loss` of this batch counts for in a mean: its target tokens (this rank's shard's,
        under sequence parallelism); preference pairs: the pairs."""
        if self.objective is not None:
            return batch.pairs
        return target_count(batch, self.sp, self.sp_rank)

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)

    @property
    def lr(self) -> float:
        return float(self.ds.get_lr()[0])

    @property
    def applied(self) -> bool:
        """The last step updated the weights (not an fp16 step skipped for overflow, nor a micro
        step inside gradient accumulation)."""
        return bool(self.ds.was_step_applied())

    @property
    def grad_norm(self) -> float | None:
        norm = self.ds.get_global_grad_norm()
        return None if norm is None else float(norm)

    @property
    def skipped_steps(self) -> int:
        return int(getattr(self.ds, "skipped_steps", 0) or 0)

    @property
    def module(self) -> Any:
        return self.ds.module


class Pipeline:
    """The engine under pipeline stages (trainer/model/stages.py): DeepSpeed's 1F1B schedule runs a step's micro batches
    at once (`run`), its optimizer step held back until the loop's agreement (`step`: a non-finite loss on any rank
    stops before the update, as without stages)."""

    def __init__(self, ds: Any, engine: Any) -> None:
        from deepspeed.runtime.pipe import schedule

        self.ds, self.engine, self.held = ds, engine, False
        if ds.autotp_size() > 1:  # tensor parallelism inside the stages (3D)
            from trainer.model.stages import after_initialize

            after_initialize(ds)
        # the schedule's instructions run through the class's table (its methods unbound): this engine's own table
        table = dict(type(ds)._INSTRUCTION_MAP)
        self._update = table[schedule.OptimizerStep]
        table[schedule.OptimizerStep] = self._hold
        ds._INSTRUCTION_MAP = table

    def _hold(self, ds: Any, lr_kwargs: Any = None) -> None:
        self.held = True

    def step(self) -> None:
        if self.held:
            self.held = False
            self._update(self.ds)

    @staticmethod
    def feed(batches: list[Any]) -> Any:
        """Micro batches as the pipeline takes them: ((input ids, position ids), labels)."""
        import torch

        for b in batches:
            if b.dim() == 3:  # fine-tuning rows: [input_ids, labels, position_ids]
                yield (b[:, 0], b[:, 2]), b[:, 1]
            else:  # token blocks: every token a target
                yield (b, torch.arange(b.shape[1]).expand_as(b)), b

    def run(self, batches: list[Any], num_items: float | None) -> Any:
        """A step's micro batches through the stages: the loss every rank logs (the mean over micro batches and
        data-parallel ranks of each micro batch's summed target loss over `num_items`; DeepSpeed broadcasts it from
        the last stage), x the micro batches (the loop's sum of micro losses)."""
        # (token blocks: every token of a block a target)
        self.ds.module.loss_fn.num_items = float(target_count(batches[0]) if num_items is None else num_items)
        loss = self.ds.train_batch(self.feed(batches))
        if self.engine.on_backward is not None:  # (tests) the reduced gradients, before the held update
            self.ds._force_grad_boundary = True
            try:
                self.engine.on_backward(self.engine)
            finally:
                self.ds._force_grad_boundary = False
        return loss * len(batches)

    def eval(self, batch: Any) -> Any:
        self.ds.module.loss_fn.num_items = 1.0  # the sum (Evaluator divides by the targets)
        # (DeepSpeed broadcasts the last stage's loss as a tensor of one element, which that stage holds as a scalar)
        return self.ds.eval_batch(self.feed([batch]), num_micro_batches=1).detach().reshape(())

    def greedy(self, ids: Any, max_new_tokens: int) -> list[int]:
        """`max_new_tokens` greedy tokens after `ids` (1 x n) through the stages: each the argmax of the last stage's
        logits over the whole sequence again (no cache between stages), sent to every stage of the pipeline. Every
        rank calls it as often (DeepSpeed's eval_batch holds a barrier over the world): no stop at the end token."""
        import torch
        import torch.distributed as dist

        grid, last = self.ds.grid, self.ds.num_stages - 1
        new: list[int] = []
        for _ in range(max_new_tokens):
            seq = torch.cat([ids, ids.new_tensor([new])], dim=1)
            row = torch.stack([seq, seq, torch.arange(seq.shape[1], device=seq.device)[None]], dim=1)
            self.ds.total_loss = None  # (DeepSpeed sums each forward's output there: the logits, here)
            _, logits = self.ds.eval_batch(self.feed([row]), return_logits=True, compute_loss=False,
                                           reduce_output=None, num_micro_batches=1)  # fmt: skip
            token = logits[0, -1].argmax().reshape(1) if self.ds.is_last_stage() else ids.new_zeros(1)
            dist.broadcast(token, grid.stage_to_global(last), group=grid.get_pipe_parallel_group())
            new.append(int(token))
        self.ds.total_loss = None
        return new

    def clip(self, max_norm: float) -> Any:
        """The gradients' norm over every stage (a tied weight's second copy counted once) and, inside a stage,
        over its tensor-parallel shards (a weight every shard holds whole counted once), clipped to `max_norm`."""
        import torch
        import torch.distributed as dist
        from deepspeed.runtime.utils import is_model_parallel_parameter

        params = [p for p in self.ds.module.parameters() if p.grad is not None]
        first = self.ds.grid.get_slice_parallel_rank() == 0
        own = [
            p.grad.detach().float().norm() ** 2
            for p in params
            if not getattr(p, "ds_pipe_replicated", False) and (first or is_model_parallel_parameter(p))
        ]
        total = torch.stack(own).sum() if own else torch.zeros((), device=self.ds.device)
        dist.all_reduce(
            total, group=self.ds.grid.get_model_parallel_group()
        )  # (a pipeline's stages x slices)
        norm = total.sqrt()
        coef = max_norm / (norm + 1e-6)
        if max_norm > 0 and coef < 1:
            for p in params:
                p.grad.detach().mul_(coef)
        return norm


def complete(
    engine: Any, tok: Any, prompts: list[str], max_new_tokens: int, synced: bool, rendered: bool = False
) -> list[dict[str, Any]]:
    """Greedy completions of `prompts` by `engine` (every rank calls it; `synced`: ZeRO-3 on several ranks,
    whose gathers need every rank in every forward until all are done). Each: the prompt, the
    completion up to the end-of-sequence token, and whether it reached one. A prompt begins as the
    training rows began: text with the tokenizer's BOS (data/pack.py), a chat prompt (`rendered` by the
    template) with what the template rendered and nothing more (data/chat.py tokenizes the rendering
    without special tokens: a template without BOS trains rows without it)."""
    import torch

    from trainer.data.tokenizer import special_edges

    eos = tok.eos_token_id
    bos = [] if rendered else special_edges(tok)[0]
    out = []
    engine.ds.train(False)
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([ids if ids[: len(bos)] == bos else bos + ids], device=engine.device)
            if getattr(engine, "pipe", None) is not None:  # stages: the whole model is no rank's
                said, engine.ds.module.unapplied = engine.ds.module.unapplied, []  # (said once a run)
                if said and engine.ds.global_rank == 0:
                    logging.getLogger("trainer").warning(f"warning: train.eval_prompts under pipeline stages: greedy samples without the "
                                f"generation_config's {', '.join(said)} (transformers' generate applies them)")  # fmt: skip
                new = engine.pipe.greedy(ids, max_new_tokens)
            else:
                gen = engine.ds.module.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                    synced_gpus=synced, pad_token_id=eos, eos_token_id=eos,
                )  # fmt: skip
                new = gen[0, ids.shape[1] :].tolist()
            ended = eos is not None and eos in new
            out.append(
                {
                    "prompt": prompt,
                    "completion": tok.decode(new[: new.index(eos)] if ended else new),
                    "ended": ended,
                }
            )
    engine.ds.train(True)
    return out


def _with_router(out: Any, experts: Any, targets: Any, num_items: float | None) -> Any:
    """The forward's loss, its router's auxiliary term weighted as the main loss (experts.router_loss),
    its expert load counted."""
    loss = loss_of(out)
    if experts is None:
        return loss
    from trainer.model.experts import router_loss

    if experts[1] is None:  # eval: transformers' loss less its auxiliary term
        aux = getattr(out, "aux_loss", None)
        return loss if aux is None else loss - experts[0] * aux.to(loss.dtype)
    experts[1].update(out)
    return router_loss(loss, out, experts[0], targets, num_items)


def sequence_parallel_loss(
    ds: Any, batch: Any, num_items: float | None, sp: int, rank: int, one_row: bool, experts: Any = None
) -> Any:
    """This rank's seq/sp of every row (trainer/model/sequence.py: shard): its targets' summed loss
    over `num_items` (the step's targets of the data-parallel ranks; DeepSpeed sums the sequence
    group's gradients and averages over the data-parallel ranks)."""
    from trainer.model.sequence import shard

    if one_row and batch.dim() == 3:
        batch = as_one_row(batch)
    ids, pos, shifted = shard(batch, sp, rank)
    if num_items is None:  # token blocks: every micro batch holds as many targets
        num_items = float(batch.shape[0] * (batch.shape[-1] - 1))
    out = ds(input_ids=ids, position_ids=pos, labels=shifted, shift_labels=shifted, use_cache=False,
             num_items_in_batch=num_items)  # fmt: skip
    return _with_router(out, experts, (shifted != -100).sum(), num_items)


def varlen_lengths(batch: Any, device: Any) -> dict[str, Any] | None:
    """varlen attention's keyword arguments for a fine-tuning batch (rows of [input_ids, labels,
    position_ids]): the cumulative lengths of its examples, rows end to end, and the longest, computed
    from the position ids where the batch is (the host: no device synchronisation). None for token
    blocks (every row one sequence: the attention's own cached lengths)."""
    if batch.dim() != 3:
        return None
    from trainer.model.varlen import lengths_from_positions

    cu, longest = lengths_from_positions(batch[:, 2])
    cu = cu.to(device, non_blocking=True)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def plain_loss(
    ds: Any, batch: Any, num_items: float | None, experts: Any = None, extra: dict[str, Any] | None = None
) -> Any:
    """The loss of one micro batch (see Engine.forward); `extra`: keyword arguments for the attention
    (varlen_lengths)."""
    # use_cache=False: a training forward builds no key/value cache (transformers would by default:
    # a copy of every layer's keys and values per step, ~3% of a tiny step on CPU)
    if batch.dim() == 2:  # every token a target: their mean, unless a padded block is in the data
        extra = {} if num_items is None else {"num_items_in_batch": num_items}
        out = ds(input_ids=batch, labels=batch, use_cache=False, **extra)
    else:
        extra = dict(extra or {})
        pos = extra.pop("position_ids", batch[:, 2])  # a vision-language model's own (multimodal RoPE)
        out = ds(input_ids=batch[:, 0], labels=batch[:, 1], position_ids=pos, use_cache=False,
                 num_items_in_batch=num_items, **extra)  # fmt: skip
    return _with_router(out, experts, target_count(batch) if experts is not None else 0, num_items)


def target_count(batch: Any, sp: int = 1, rank: int = 0) -> Any:
    """The target tokens of a batch (of this rank's shard of it, under sequence parallelism)."""
    from trainer.data.pack import IGNORE

    if sp > 1:
        from trainer.model.sequence import shard

        return (shard(batch, sp, rank)[2] != IGNORE).sum()
    if batch.dim() == 2:
        return batch.shape[0] * (batch.shape[1] - 1)
    return (batch[:, 1, 1:] != IGNORE).sum()
