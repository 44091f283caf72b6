"""The stream of a GRPO run: each step's prompts, their completions, rewards and advantages, as micro batches
for the objective (trainer/objectives/grpo.py). The loop sees a stream like any other: `loss_denominator` at
the start of a step generates and scores the step's completions (every rank together: the rewards are
gathered for the advantages and the normalisers), `next` hands out its micro batches.

A step takes the next world x P prompts of the epoch's global order (P = micro_batch_size x grad_accum / G a
rank: the order and the position are a TrainStream's, so a run resumes at the same prompt on any world size)
and samples G completions of each, each completion from its own random stream (train.seed, the epoch, the
prompt's place in the epoch's order, its index in the group; trainer/rl/generate.py): a step's completions
are the same however it is split over ranks, micro batches and generate calls, and a resumed run draws the
ones the uninterrupted run drew. With num_iterations > 1 a generation serves that many
optimizer steps (a resume between them generates anew from the resumed weights, as TRL does, and says so).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainer.common.errors import UserError
from trainer.data.pack import IGNORE
from trainer.data.prompts import PROMPT, lengths
from trainer.data.stream import Position, RankSampler, step_start

log = logging.getLogger("trainer")


@dataclass
class Rollout:
    """A micro batch of completions: rows of [input_ids, labels, position_ids] (the prompt's labels IGNORE,
    the completion's its tokens), each completion's advantage, the old and the reference's per-token
    log-probs (None: the current ones detached; no reference), whether each completion counts (masked when
    truncated), and the normaliser of this micro batch's loss."""

    rows: Any
    advantages: Any
    old: Any = None
    ref: Any = None
    counts: Any = None
    normaliser: float = 1.0

    def to(self, device: Any, non_blocking: bool = False) -> Rollout:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Rollout(move(self.rows), move(self.advantages), move(self.old), move(self.ref), move(self.counts),
                       self.normaliser)  # fmt: skip

    def __iter__(self) -> Any:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class Scored:
    """A step's completions on this rank, scored."""

    prompts: list[int]  # the prompts' indices in the data
    completions: list[tuple[list[int], bool]]  # G a prompt, in order: (token ids, ended)
    rewards: Any  # (completions, functions), NaN for None
    advantages: Any = None
    zero_std: Any = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)  # the completions decoded (the completions log)
    logged: dict[str, list[Any]] = field(default_factory=dict)  # the reward functions' log_extra columns


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def group_seed(seed: int, epoch: int, place: int) -> int:
    """The sampling seed of the group of the prompt at `place` in epoch `epoch`'s order."""
    return _hash63(f"{seed}:{epoch}:{place}")


def row_stream(group: int, index: int) -> int:
    """The random stream of a group's completion `index` (generate.gumbel's key, 63 bits)."""
    return _hash63(f"{group}:{index}")


class RolloutStream:
    """See the module's doc. `attach` gives it the sampler and the objective once the engine exists."""

    def __init__(self, data: Any, section: Any, rl: Any, *, rank: int, world: int, micro: int, accum: int,
                 seed: int, seq_len: int, tokenizer: Any) -> None:  # fmt: skip
        self.rl, self.rank, self.world = rl, rank, world
        self.micro, self.accum, self.seed = micro, accum, seed
        self.group = rl.num_generations
        self.per_rank = micro * accum // self.group  # prompts a rank a step
        self.prompts = np.asarray(data.train)
        self.columns = data.columns or [{} for _ in range(len(self.prompts))]
        self.tok = tokenizer
        from trainer.rl.rewards import GIVEN

        clash = sorted({k for row in self.columns[:1] for k in row} & set(GIVEN))
        if clash:
            raise UserError(f"data.train: the column(s) {', '.join(clash)} have the names of what TRL's reward functions "
                            f"are given ({', '.join(GIVEN)}); rename them in the data")  # fmt: skip
        self.prompts, self.columns, self.left_out = fitting(
            self.prompts, self.columns, rl.max_new_tokens, seq_len
        )
        self.sampler = RankSampler(len(self.prompts), rank, world, self.per_rank, seed, section.shuffle)
        self.longest = int(lengths(self.prompts).max())
        if self.sampler.steps_per_epoch() == 0:
            raise UserError(f"data.train: {len(self.prompts)} prompts are fewer than a step's {world * self.per_rank} "
                            f"({world} rank(s) x {self.per_rank}); add prompts or lower the batch")  # fmt: skip
        self.position = Position()
        self.record: list[str] | None = None
        self.sample_fn: Any = None  # generate.Sampler
        self.objective: Any = None
        self.rewards: list[Any] = []
        self.queue: list[Rollout] = []
        self.left = 0  # optimizer steps the current generation still serves (num_iterations)
        self.current: list[Rollout] = []
        self.fed = 0
        from trainer.rl.rewards import TrainerState

        self.state = TrainerState(0, 0.0, 0)
        self.steps_done: Any = lambda: (
            0
        )  # the run's optimizer steps so far (trainer_state; rl.prepare sets it)
        self.max_steps = 0
        self.log_metric: Any = lambda name, value: None

    def attach(self, sampler: Any, objective: Any, rewards: list[Any]) -> None:
        self.sample_fn, self.objective, self.rewards = sampler, objective, rewards

    # ------------------------------------------------------------------ what the loop and checkpoints read
    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch()

    def seek(self, position: Position) -> None:
        self.position = step_start(position, self.sampler)
        if self.rl.num_iterations > 1:
            log.warning("warning: train.rl.num_iterations > 1: the resumed run generates its next completions from "
                        "the resumed weights (the interrupted generation's remaining steps are not replayed)")  # fmt: skip
        self.left, self.current = 0, []

    def padding(self) -> None:
        return None

    def tokens_by_source(self) -> None:
        return None

    def step_tokens(self, micro_steps: int) -> int | None:
        return self.fed

    def loss_denominator(self, micro_steps: int) -> float | None:
        """A step begins: generate and score (every rank) unless the current generation serves it again."""
        if self.left == 0:
            self.current = self._generate_step()
            self.left = self.rl.num_iterations
        self.left -= 1
        self.queue = list(self.current)
        self.fed = int(sum(r.rows.shape[0] * r.rows.shape[2] for r in self.current)) * self.world
        return None

    def next(self) -> Rollout:
        batch = self.queue.pop(0)
        if self.record is not None:
            from trainer.data.stream import row_digest

            self.record += [row_digest(row) for row in batch.rows]
        return batch

    # ------------------------------------------------------------------ one step's generation
    def _take(self) -> tuple[list[int], list[int], int]:
        """This rank's next prompts (indices in the data), their places in the epoch's order, the epoch."""
        gb = self.sampler.global_batch
        self.position = step_start(self.position, self.sampler)
        order = self.sampler.order(self.position.epoch)
        start = self.position.sample + self.rank * self.per_rank
        places = list(range(start, start + self.per_rank))
        epoch = self.position.epoch
        self.position.sample += gb
        return [int(order[p]) for p in places], places, epoch

    def _generate_step(self) -> list[Rollout]:
        from trainer.rl.rewards import TrainerState

        t0 = time.perf_counter()
        rounds, kept = 0, None
        pos = self.position
        self.state = TrainerState(int(self.steps_done()), pos.epoch + pos.sample / max(self.sampler.usable, 1),
                                  self.max_steps)  # fmt: skip
        while True:
            indices, places, epoch = self._take()  # (the epoch after a rollover: as a resumed run sees it)
            scored = self._score(indices, [group_seed(self.seed, epoch, p) for p in places])
            kept = scored if kept is None else _merge(kept, scored)
            rounds += 1
            if not self.rl.dynamic_sampling:
                break
            enough = _all_min(sum(_spread(kept, self.group, self.rl.weights())), self.world) >= self.per_rank
            if enough or rounds >= self.rl.max_resamples:
                break
        kept = _select(kept, self.group, self.per_rank, self.rl.dynamic_sampling, self.rl.weights())
        kept.seconds = time.perf_counter() - t0
        rollouts = self.objective.rollouts(self, kept)
        kept.extra["rounds"] = rounds
        self.objective.count_generation(kept, self.rewards)
        return rollouts

    def _score(self, indices: list[int], seeds: list[int]) -> Scored:
        # every group of this rank's step at once: the sampler cuts them into generate calls
        rows = [[int(t) for t in self.prompts[i] if t != IGNORE] for i in indices]
        streams = [row_stream(s, j) for s in seeds for j in range(self.group)]
        completions = self.sample_fn.sample([p for p in rows for _ in range(self.group)], streams)
        texts = [
            self.tok.decode(c, skip_special_tokens=True) for c, _ in completions
        ]  # (TRL's: no EOS, no EOT)
        prompts = [self.columns_prompt(i) for i in indices for _ in range(self.group)]
        prompt_ids = [p for p in rows for _ in range(self.group)]
        parsed = parse_responses(self.tok, prompt_ids, [c for c, _ in completions], texts, chat=not isinstance(
            prompts[0], str) if prompts else False)  # fmt: skip
        columns = {k: [self.columns[i].get(k) for i in indices for _ in range(self.group)]
                   for k in (self.columns[indices[0]] if indices else {}) if k != PROMPT}  # fmt: skip
        where = (
            f"rows {', '.join(str(i) for i in indices[:5])}{' ...' if len(indices) > 5 else ''} of data.train"
        )
        rewards, logged = scored_by(self.rewards, prompts, texts, completions, columns, self.state, where,
                                    self.log_metric, parsed)  # fmt: skip
        return Scored(list(indices), completions, rewards, texts=texts, logged=logged)

    def columns_prompt(self, i: int) -> Any:
        """The row's prompt as the data gives it (the reward functions' `prompts`: a string or the messages)."""
        return self.columns[i][PROMPT]


def fitting(prompts: Any, columns: list[Any], max_new: int, seq_len: int) -> tuple[Any, list[Any], int]:
    """One rule for long prompts: a prompt that leaves fewer than max_new_tokens within data.seq_len is left out
    with its columns and counted (the cache has left out those of seq_len or more); the run stops only where none is
    left. (the prompts, their columns, how many were left out)"""
    fits = lengths(prompts) + max_new <= seq_len
    if not fits.any():
        raise UserError(f"train.rl.max_new_tokens {max_new}: every prompt and its completion would exceed "
                        f"data.seq_len {seq_len}; lower max_new_tokens or raise seq_len")  # fmt: skip
    if fits.all():
        return prompts, columns, 0
    return prompts[fits], [c for c, f in zip(columns, fits, strict=True) if f], int((~fits).sum())


def parse_responses(tok: Any, prompt_ids: list[list[int]], ids: list[list[int]], texts: list[str],
                    chat: bool) -> list[dict[str, Any]] | None:  # fmt: skip
    """Chat completions as TRL 1.16 gives them to reward functions where the tokenizer ships a response template
    (`response_template`, or the legacy `response_schema`: Gemma 4's repositories ship one): the tokenizer's
    `parse_response` of each completion's ids after its prompt's (`{"role", "content", "reasoning_content"...}`;
    trl.chat_template_utils.parse_response: the content without a trailing EOS, "" where none, the decoded text where
    parsing fails); None where the tokenizer has neither, or the prompts are strings."""
    template = getattr(tok, "response_template", None) is not None
    if not chat or not (template or getattr(tok, "response_schema", None) is not None):
        return None
    out = []
    for prefix, c, text in zip(prompt_ids, ids, texts, strict=True):
        try:
            parsed = tok.parse_response(c, prefix=prefix) if template else tok.parse_response(c)
            if parsed is None:
                raise ValueError("parse_response returned None")
            parsed = dict(parsed)
            if isinstance(parsed.get("content"), str) and tok.eos_token:
                parsed["content"] = parsed["content"].removesuffix(tok.eos_token)
            parsed["content"] = parsed.get("content") or ""
        except (ValueError, TypeError):
            parsed = {"role": "assistant", "content": text}
        out.append(parsed)
    return out


def scored_by(rewards: list[Any], prompts: list[Any], texts: list[str], completions: list[Any],
              columns: dict[str, list[Any]], state: Any, where: str, log_metric: Any,
              parsed: list[dict[str, Any]] | None = None) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """The completions' rewards (completions, functions), NaN for None, as TRL's reward functions get them
    (trainer/rl/rewards.py), and the columns they logged with log_extra. `parsed`: the chat completions as the
    tokenizer's response template parses them (parse_responses), else one assistant message of the text."""
    import torch

    from trainer.rl.rewards import Batch, score

    chat = bool(prompts) and not isinstance(prompts[0], str)  # TRL's: one assistant message for chat prompts
    given = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
    if chat and parsed is not None:
        given = [[p] for p in parsed]
    logged: dict[str, list[Any]] = {}
    batch = Batch(prompts, given, [list(c) for c, _ in completions], columns, state, where,
                  log_extra=lambda column, values: logged.__setitem__(str(column), list(values)),
                  log_metric=log_metric)  # fmt: skip
    values = torch.tensor(score(rewards, batch), dtype=torch.float64).T.reshape(
        len(completions), len(rewards)
    )
    unscored = torch.isnan(values).all(dim=1).nonzero().flatten().tolist()
    if unscored:  # (TRL warns, naming the first such row: they train on advantage 0)
        i = unscored[0]
        log.warning(f"warning: every reward function returned None for {len(unscored)} of {len(completions)} "
                    f"completions ({where}), e.g. prompt {str(prompts[i])[:200]!r}, completion {texts[i][:200]!r}: "
                    "they train on an advantage of 0; make at least one function score each completion")  # fmt: skip
    return values, {k: v for k, v in logged.items() if len(v) == len(completions)}  # (one value a completion)


def _merge(a: Scored, b: Scored) -> Scored:
    import torch

    logged = {k: a.logged[k] + b.logged[k] for k in a.logged if k in b.logged}
    return Scored(a.prompts + b.prompts, a.completions + b.completions, torch.cat([a.rewards, b.rewards]),
                  texts=a.texts + b.texts, logged=logged)  # fmt: skip


def _spread(s: Scored, group: int, weights: list[float]) -> list[bool]:
    """Whether each group's combined rewards differ (the advantages' own test: a group whose rewards are all
    equal, None counted as missing, has advantages 0 and no learning signal)."""
    import torch

    from trainer.rl.rewards import combined

    r = combined(s.rewards, torch.tensor(weights, dtype=s.rewards.dtype)).reshape(-1, group)
    missing = torch.isnan(r)
    hi = torch.where(missing, -torch.inf, r).amax(dim=1)
    lo = torch.where(missing, torch.inf, r).amin(dim=1)
    return (hi > lo).tolist()


def _all_min(value: int, world: int) -> int:
    return all_reduce([value], "min")[0] if world > 1 else value


def all_reduce(values: list[int], op: str) -> list[int]:
    """Whole numbers reduced over every rank (op: sum, max or min), in one collective; as they are in one process."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return [int(v) for v in t.tolist()]


def _select(s: Scored, group: int, keep: int, dynamic: bool, weights: list[float]) -> Scored:
    """The step's groups: the first `keep` (with dynamic sampling, the first `keep` whose rewards differ,
    then, where too few did, the first of the others)."""
    n = len(s.prompts)
    order = list(range(n))
    if dynamic:
        spread = _spread(s, group, weights)
        order = [i for i in range(n) if spread[i]] + [i for i in range(n) if not spread[i]]
    chosen = sorted(order[:keep]) if dynamic else order[:keep]
    rows = [g * group + j for g in chosen for j in range(group)]
    return Scored([s.prompts[g] for g in chosen], [s.completions[i] for i in rows], s.rewards[rows],
                  texts=[s.texts[i] for i in rows] if s.texts else [],
                  logged={k: [v[i] for i in rows] for k, v in s.logged.items()})  # fmt: skip
