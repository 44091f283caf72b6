"""On-policy distillation (train.distill.lmbda > 0) and the teacher's own completions (train.distill.seq_kd): GKD's
steps (TRL's GKDTrainer; lmbda 1 is TRL's DistillationTrainer), over the data's prompts.

`PolicyStream` wraps the run's TrainStream. At a step's start (`loss_denominator`, where GRPO's RolloutStream
generates) it draws the step's kind from train.seed and the step's place in the data (`step_kind`): the student's
completions with probability lmbda, else the teacher's with seq_kd, else the data's rows as they are. On a generated
step it takes the step's micro batches from the data, cuts each example before its last run of targets (its last
reply: the prompt is everything before it, earlier turns included, as GKD's chat collator cuts it), samples a
completion of each prompt and makes rows of prompt + completion with the completion as the targets (the stop token
included, as TRL's completion mask), packed as the data's rows are. A completion's random stream is a function of
(train.seed, the step's place, the example's place: its row's in the epoch's order and its own in the row) only
(trainer/rl/generate.py's Gumbel-max; two examples with one prompt draw their own): a step's completions are the same
however it is split over ranks, micro batches and generate calls (on CPU in fp32), and a resumed run draws the ones
the uninterrupted run drew from nothing more than the data's position in the checkpoint. The step's targets over
every rank divide each micro batch's summed divergence (one all-reduce), as the data's rows' targets do.

The eval loss stays on the data's completions (one fixed measure across steps); TRL's DistillationTrainer evaluates
on fresh completions.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from trainer.data.pack import IGNORE
from trainer.data.step_stream import StepStream
from trainer.data.stream import Position

DATA, STUDENT, TEACHER = "the data's", "the student's", "the teacher's"


def step_kind(lmbda: float, seq_kd: bool, seed: int, epoch: int, sample: int) -> str:
    """Whose completions the step at `sample` of epoch `epoch` trains on: the student's with probability lmbda (a
    uniform from a hash of the three: the same on every rank and in a resumed run), else the teacher's with seq_kd,
    else the data's."""
    h = hashlib.blake2b(f"distill:{seed}:{epoch}:{sample}".encode(), digest_size=8).digest()
    if (int.from_bytes(h, "little") >> 11) / 2.0**53 < lmbda:
        return STUDENT
    return TEACHER if seq_kd else DATA


def prompts_of(rows: np.ndarray) -> list[list[int]]:
    """Each example of fine-tuning rows (rows, 3, width) that holds targets, in order: its tokens before its last run
    of targets (an example starts where the position ids restart at 0; padding has no targets)."""
    return [p for _, _, p in examples_of(rows)]


def examples_of(rows: np.ndarray) -> list[tuple[int, int, list[int]]]:
    """prompts_of's prompts with where each example is: (its row, its place among the row's examples)."""
    out = []
    for r, (ids, labels, pos) in enumerate(rows):
        starts = [int(s) for s in np.flatnonzero(pos == 0)]
        starts = starts if starts and starts[0] == 0 else [0, *starts]
        for k, (s, e) in enumerate(zip(starts, [*starts[1:], len(ids)], strict=True)):
            target = labels[s:e] != IGNORE
            if not target.any():
                continue
            last = int(np.flatnonzero(target)[-1])
            before = np.flatnonzero(~target[:last])
            out.append((r, k, [int(t) for t in ids[s : s + int(before[-1]) + 1]]))
    return out


def rows_of(examples: list[tuple[list[int], list[int]]], multiple: int, seq_len: int, pad: int,
            pack: bool = False) -> Any:  # fmt: skip
    """Rows (rows, 3, width) of (prompt, completion) pairs, each at most seq_len tokens: the completion's tokens the
    targets, positions from 0 at each example, right-padded (pad, IGNORE, positions of their own) to the longest
    row rounded up to `multiple` (0: seq_len wide), as the data's rows are laid; one example a row, or with `pack`
    as many as fit in seq_len, in order (the data's packing)."""
    import torch

    rows: list[list[tuple[list[int], list[int]]]] = []
    for p, c in examples:
        if pack and rows and sum(len(a) + len(b) for a, b in rows[-1]) + len(p) + len(c) <= seq_len:
            rows[-1].append((p, c))
        else:
            rows.append([(p, c)])
    longest = max(sum(len(p) + len(c) for p, c in row) for row in rows)
    width = seq_len if not multiple else min(seq_len, -(-longest // multiple) * multiple)
    out = np.full((len(rows), 3, width), IGNORE, dtype=np.int64)
    out[:, 0] = pad
    for r, row in enumerate(rows):
        at = 0
        for p, c in row:
            n = len(p) + len(c)
            out[r, 0, at : at + n] = p + c
            out[r, 1, at + len(p) : at + n] = c
            out[r, 2, at : at + n] = np.arange(n)
            at += n
        out[r, 2, at:] = np.arange(width - at)
    return torch.from_numpy(out)


class PolicyStream(StepStream):
    """See the module's doc. `attach` gives it the student's sampler (and the teacher's, with seq_kd) once the
    engine exists; everything else is its TrainStream's (the position, the checkpoint's, the eval's)."""

    def __init__(self, inner: Any, settings: Any, *, seed: int, seq_len: int, pack: bool = False) -> None:
        super().__init__(inner)
        self.d, self.seed, self.seq_len, self.pack = settings, seed, seq_len, pack
        self.capped = False  # (said once: a step's longest prompt left less than max_new_tokens in seq_len)
        self.samplers: dict[str, Any] = {}
        self.fed = 0
        self.counts = {DATA: 0, STUDENT: 0, TEACHER: 0, "completions": 0, "tokens": 0}  # since the last log

    def attach(self, student: Any, teacher: Any = None) -> None:
        self.samplers = {STUDENT: student, TEACHER: teacher}

    def step_tokens(self, micro_steps: int) -> int | None:
        return self.fed if self.queue is not None else self.inner.step_tokens(micro_steps)

    def loss_denominator(self, micro_steps: int) -> float | None:
        """A step begins: its kind drawn; on a generated step its completions sampled (every rank together) and the
        step's targets over every rank counted."""
        from trainer.data.stream import step_start
        from trainer.rl.rollout import all_reduce

        sampler = self.inner.sampler
        start = step_start(self.inner.position, sampler)  # (as the stream rolls over: a resumed run's place)
        epoch, sample = start.epoch, start.sample
        kind = step_kind(self.d.lmbda, self.d.seq_kd, self.seed, epoch, sample)
        self.counts[kind] += 1
        self.queue = None
        if kind == DATA:
            return self.inner.loss_denominator(micro_steps)
        batches = [self.inner.next() for _ in range(micro_steps)]
        # each row's place in the epoch's order (TrainStream's: a micro step takes the next world x micro rows, a
        # rank its micro of them): an example's random stream is its place's, the same however the step is split
        first = [sample + i * sampler.global_batch + sampler.rank * sampler.micro for i in range(micro_steps)]
        self.queue, made = self._generated(
            batches, first, self.samplers[kind], f"{self.seed}:{epoch}:{sample}:{kind}"
        )
        targets = sum(int((b[:, 1] != IGNORE).sum()) for b in self.queue)
        fed = sum(int(b.shape[0] * b.shape[2]) for b in self.queue)
        targets, self.fed, made = all_reduce(
            [targets, fed, made], "sum"
        )  # (made: examples; a row may pack several)
        self.counts["completions"] += made
        self.counts["tokens"] += targets  # (a completion is all targets)
        return max(targets, 1) / (sampler.world * micro_steps)

    def flush(self) -> dict[str, Any]:
        """The logged interval's metrics (the same on every rank: the kinds are drawn alike, the counts all-reduced):
        the share of its steps on the student's completions, on the teacher's (seq_kd), and their mean length."""
        c, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        steps = c[DATA] + c[STUDENT] + c[TEACHER]
        if not steps:  # (nothing drawn in the interval: no share to say)
            return {}
        out = {"on_policy": c[STUDENT] / steps}
        if self.d.seq_kd:
            out["teacher_completions"] = c[TEACHER] / steps
        if c["completions"]:
            out["completion_length"] = c["tokens"] / c["completions"]
        return out

    def _generated(
        self, batches: list[Any], first: list[int], sampler: Any, key: str
    ) -> tuple[list[Any], int]:
        """The micro batches `batches` (whose first rows are at `first` in the epoch's order) with each example's last
        reply replaced by `sampler`'s completion of what comes before it; and how many examples they hold."""
        from trainer.rl.rollout import _hash63, all_reduce, row_stream

        per = [examples_of(b.numpy()) for b in batches]
        prompts = [p for ex in per for _, _, p in ex]
        group = _hash63(key)
        streams = [row_stream(group, _hash63(f"{at + r}:{k}")) for ex, at in zip(per, first, strict=True)
                   for r, k, _ in ex]  # fmt: skip
        s = sampler.sampling
        chunk = self.d.generation.batch or max(len(prompts), 1)
        # every call of the step padded alike (the longest prompt of every rank), as many calls a rank (ZeRO-3's
        # synced generation runs every rank's forward together), and no completion past data.seq_len
        longest, calls = all_reduce(
            [max((len(p) for p in prompts), default=0), -(-len(prompts) // chunk)], "max"
        )
        new = min(s.max_new_tokens, self.seq_len - longest)
        if new < s.max_new_tokens and not self.capped and self.inner.sampler.rank == 0:
            import logging

            logging.getLogger("trainer").warning(
                f"warning: train.distill.generation.max_new_tokens {s.max_new_tokens}: a step's longest prompt "
                f"({longest} tokens) leaves {max(new, 0)} within data.seq_len {self.seq_len}: that step's completions "
                "are at most as long (said once; raise data.seq_len for more)"
            )
            self.capped = True
        done: list[Any] = []
        if new > 0:
            sampler.sampling = dataclasses.replace(s, width=longest + 1, max_new_tokens=new)
            try:
                for at in range(0, calls * chunk, chunk):
                    got = sampler.sample(
                        prompts[at : at + chunk] or [[s.pad]], streams[at : at + chunk] or [0]
                    )
                    done += got[: len(prompts[at : at + chunk])]
            finally:
                sampler.sampling = s
        completions = iter([c for c, _ in done] or [[] for _ in prompts])
        out = []
        for ex in per:
            examples = [(p, next(completions)[: self.seq_len - len(p)]) for _, _, p in ex]
            out.append(rows_of(examples, self.inner.multiple, self.seq_len, s.pad, self.pack))
        return out, len(prompts)


class PromptRows:
    """The stream under PolicyStream for prompt-only data (data.train.kind prompt: the cache's prompts, rendered as
    GRPO's are, with the chat template's generation prompt): a rank's micro batches in the data's global order as
    TrainStream takes them, each prompt a row whose one target is a pad token after it: the reply every step
    replaces (lmbda 1 or seq_kd: no step trains on the data's rows)."""

    def __init__(self, data: Any, section: Any, *, rank: int, world: int, micro: int, accum: int, seed: int,
                 pad: int) -> None:  # fmt: skip
        from trainer.common.errors import UserError
        from trainer.data.stream import RankSampler

        self.prompts, self.pad, self.micro = np.asarray(data.train), pad, micro
        self.sampler = RankSampler(len(self.prompts), rank, world, micro, seed, section.shuffle, accum=accum)
        if self.sampler.steps_per_epoch() == 0:
            raise UserError(f"data.train: {len(self.prompts)} prompts are fewer than one step's global batch ({world} "
                            f"ranks x train.micro_batch_size {micro} x train.grad_accum {accum}); lower the micro "
                            "batch or add prompts")  # fmt: skip
        self.position, self.multiple = Position(), 1
        self.record: list[str] | None = None
        self._it: Any = None

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch()

    def seek(self, position: Position) -> None:
        from trainer.data.stream import step_start

        self.position, self._it = step_start(position, self.sampler), None

    def next(self) -> Any:
        if self._it is None:
            self.sampler.set_epoch(self.position.epoch, self.position.sample)
            self._it = iter(self.sampler)
        at = [i for _, i in zip(range(self.micro), self._it, strict=False)]
        if not at:
            self.position = Position(self.position.epoch + 1, 0)
            self._it = None
            return self.next()
        self.position.sample += self.sampler.global_batch
        prompts = [[int(t) for t in self.prompts[i] if t != IGNORE] for i in at]
        rows = rows_of([(p, [self.pad]) for p in prompts], 1, max(len(p) for p in prompts) + 1, self.pad)
        if self.record is not None:
            from trainer.data.stream import row_digest

            self.record += [row_digest(r) for r in rows]
        return rows

    def tokens_by_source(self) -> None:
        return None

    def padding(self) -> None:
        return None

    def step_tokens(self, micro_steps: int) -> None:
        return None

    def loss_denominator(self, micro_steps: int) -> None:
        return None


class _Holder:
    """What ModelSampler reads of an engine (its module and device), for the teacher."""

    def __init__(self, module: Any, device: Any) -> None:
        self.ds, self.device = type("DS", (), {"module": module})(), device


def prepare(exp: Any, env: Any, engine: Any, data: Any, stream: PolicyStream) -> list[str]:
    """The samplers of the student (and, with seq_kd, of the teacher), wired to the stream; the banner's line."""
    from trainer.common.errors import UserError
    from trainer.objectives import distill
    from trainer.rl.generate import ModelSampler, Sampling, pad_id, stop_tokens

    d, tok = exp.train.distill, data.tokenizer
    ds = engine.ds
    from trainer.strategy.planning.axes import parallel_degrees

    if (
        getattr(engine, "pipe", None) is not None
        or getattr(engine, "sp", 1) > 1
        or parallel_degrees(getattr(engine, "ds_config", None))[0] > 1
    ):
        raise UserError("train.distill.lmbda: generation under pipeline stages, sequence or tensor parallelism is not "
                        "verified; set strategy.pipeline_stages, sequence_parallel and tensor_parallel to 1")  # fmt: skip
    eot = ""
    chat = exp.data.kind == "chat" or (data.finetune or {}).get("chat")
    if chat and d.generation.stop_at_end_of_turn:  # a reply ends at the turn's end
        from trainer.data.examples import chat_profile

        eot = chat_profile(exp.data, tok).eot
    g = d.generation
    temperature = g.temperature or d.temperature

    def sampling(model: Any) -> Any:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return Sampling(max_new_tokens=g.max_new_tokens, temperature=temperature, top_p=g.top_p, top_k=g.top_k,
                        min_p=g.min_p, pad=pad_id(tok), stop=tuple(t for t in stop_tokens(tok, eot, getattr(
                            base, "generation_config", None)) if t < data.vocab_size))  # fmt: skip

    stage3 = ds.zero_optimization_stage() == 3
    student = ModelSampler(engine, sampling(ds.module), env.world_size > 1 and stage3, batch=1 << 30)
    teacher = None
    teach = getattr(engine, "teacher", None)
    if d.seq_kd:
        sharded = hasattr(teach, "inference_engine")
        if not sharded and not getattr(teach, "is_loaded_in_4bit", False):
            distill.place(teach, engine.device, distill.compute_dtype(_precision(ds)))
        teacher = ModelSampler(_Holder(teach, engine.device), sampling(teach), env.world_size > 1 and sharded,
                               batch=1 << 30)  # fmt: skip
    stream.attach(student, teacher)
    s = student.sampling
    calls = f"{g.batch} prompt(s)" if g.batch else "all of a rank's prompts of the step"
    stops = ", ".join(repr(tok.decode([t])) for t in s.stop) or "none"
    whose = f"the student's completions on a share {d.lmbda:g} of the steps" if d.lmbda else ""
    rest = "the teacher's" if d.seq_kd else "the data's"
    return [
        f"objective: distill on {whose + ', ' if whose else ''}{rest} on the others"
        if d.lmbda < 1
        else "objective: distill on the student's completions (on-policy) at every step",
        f"generation: each example's last reply sampled anew from its prompt, at most {g.max_new_tokens} new tokens "
        f"(temperature {temperature:g}, top_p {g.top_p:g}, top_k {g.top_k or 'off'}), stopping at {stops}; "
        f"{calls} a generate call",
    ]


def _precision(ds: Any) -> str:
    return "bf16" if ds.bfloat16_enabled() else "fp16" if ds.fp16_enabled() else "fp32"
