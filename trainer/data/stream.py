"""Per-rank, resumable batches. The data order is global and independent of the world size: epoch e
is a seeded permutation of the blocks; micro step i takes blocks [i*W*B, (i+1)*W*B) of it (W ranks,
micro batch B), and rank r takes its B-slice. The position in the data is therefore one number,
global samples consumed in the epoch, which carries over when a run resumes on another number of
ranks."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.common.errors import UserError
from trainer.config import DataSection
from trainer.data.cache import Data
from trainer.data.image_rows import ImageRows, collate_images, image_tokens
from trainer.data.mixture import mixture_order, shares
from trainer.data.pack import IGNORE, as_rows


class RankSampler:
    """Yields this rank's sample indices for one epoch, from global sample `start` on.

    The global order of an epoch is a permutation seeded by (seed, epoch); each micro step takes
    the next world*micro samples of it and rank r takes its micro-slice. An epoch yields whole
    optimizer steps only (world x micro x accum samples): the rows dropped at its end are n mod the
    global batch, so a run whose ranks change and whose accumulation keeps the global batch (an
    elastic shrink from 4 x 1 to 2 x 2) trains the same rows in the same steps."""

    def __init__(
        self,
        n: int,
        rank: int,
        world: int,
        micro: int,
        seed: int,
        shuffle: bool,
        mixture: tuple[list[int], list[float]] | None = None,
        lengths: np.ndarray | None = None,
        accum: int = 1,
    ) -> None:
        self.accum = accum  # micro steps an optimizer step (train.grad_accum)
        self.n, self.rank, self.world, self.micro, self.seed, self.shuffle = (
            n,
            rank,
            world,
            micro,
            seed,
            shuffle,
        )
        self.mixture = mixture  # (sequences per source, in the data's order; weights)
        self.lengths = lengths  # data.group_by_length: each row's length, to order by within groups
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def order(self, epoch: int) -> np.ndarray:
        if self.mixture is not None:
            out = mixture_order(*self.mixture, self.seed, epoch, self.shuffle)
        elif not self.shuffle:
            out = np.arange(self.n)
        else:
            out = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return out if self.lengths is None else grouped(out, self.lengths)

    @property
    def global_batch(self) -> int:
        """Samples a micro step takes over every rank."""
        return self.world * self.micro

    @property
    def usable(self) -> int:
        """Samples of an epoch trained: whole optimizer steps (global batch x accumulation)."""
        step = self.global_batch * self.accum
        return self.n // step * step

    def steps_per_epoch(self) -> int:
        """Micro steps an epoch."""
        return self.usable // self.global_batch

    def __iter__(self) -> Iterator[int]:
        rest = self.order(self.epoch)[self.start : self.usable]
        steps = len(rest) // self.global_batch
        mine = rest[: steps * self.global_batch].reshape(steps, self.world, self.micro)[:, self.rank, :]
        return iter(mine.reshape(-1).tolist())

    def __len__(self) -> int:
        return (max(0, self.usable - self.start) // self.global_batch) * self.micro


GROUP = 1024  # data.group_by_length: rows ordered by length within each run of this many


def grouped(order: np.ndarray, lengths: np.ndarray, group: int = GROUP) -> np.ndarray:
    """data.group_by_length: each run of `group` rows of the epoch's order sorted by length, longest
    first (stable), so that a micro batch's rows are alike in length. Fixed runs, not a multiple of
    the global batch: the order stays independent of the world size."""
    out = order.copy()
    for at in range(0, len(out), group):
        part = out[at : at + group]
        out[at : at + group] = part[np.argsort(-np.asarray(lengths)[part], kind="stable")]
    return out


def micro_widths(
    rows: np.ndarray, lengths: np.ndarray, world: int, micro: int, multiple: int = 1
) -> np.ndarray:
    """The width of each micro batch of `rows` (whole global batches in order): its longest row, up to
    a multiple of `multiple` (_collate)."""
    steps = len(rows) // (world * micro)
    lens = np.asarray(lengths)[rows[: steps * world * micro]].reshape(steps, world, micro)
    return -(-lens.max(axis=2) // multiple) * multiple


def padding_shares(
    sampler: RankSampler, lengths: np.ndarray, seq_len: int, multiple: int = 1
) -> tuple[float, float]:
    """The padding share of the first epoch's batches were every row seq_len wide, and as fed (each
    micro batch as wide as its longest row; data.group_by_length orders for it)."""
    rows = sampler.order(0)[: sampler.steps_per_epoch() * sampler.global_batch]
    real = int(np.asarray(lengths)[rows].sum())
    widths = np.minimum(micro_widths(rows, lengths, sampler.world, sampler.micro, multiple), seq_len)
    fed = int(widths.sum()) * sampler.micro
    return 1 - real / max(1, len(rows) * seq_len), 1 - real / max(fed, 1)


class _Rows:
    """Map-style dataset over the memory-mapped blocks; `__getitems__` fetches a batch in one take."""

    def __init__(self, blocks: np.ndarray) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.blocks[int(i)])

    def __getitems__(self, idx: list[int]) -> np.ndarray:
        return self.blocks[np.asarray(idx, dtype=np.int64)]


class _PairRows(_Rows):
    """Preference pairs (pairs, 2, 3, seq_len): each item is the pair's two rows and its index (the
    key of its reference log-probs)."""

    def __getitem__(self, i: int) -> Any:
        return np.asarray(self.blocks[int(i)])[None], np.asarray([int(i)])

    def __getitems__(self, idx: list[int]) -> Any:
        at = np.asarray(idx, dtype=np.int64)
        return self.blocks[at], at


@dataclass
class Pairs:
    """A micro batch of preference pairs: every chosen row, then every rejected one, as fine-tuning
    rows (2 x pairs, 3, width); and the pairs' indices in the data."""

    rows: Any
    index: Any

    def to(self, device: Any, non_blocking: bool = False) -> Pairs:
        return Pairs(self.rows.to(device, non_blocking=non_blocking), self.index)

    def pin_memory(self) -> Pairs:
        return Pairs(self.rows.pin_memory(), self.index)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.rows)

    @property
    def pairs(self) -> int:
        return len(self.index)


def _collate(rows: Any, multiple: int = 1) -> Any:
    """A batch as the model takes it. Fine-tuning rows are cut to the longest row's last target
    (cache.row_lengths), up to a multiple of `multiple` (under torch.compile: fewer shapes to compile).
    Preference pairs become `Pairs` (their chosen rows, then their rejected ones)."""
    import torch

    if isinstance(rows, tuple):  # _PairRows: (rows (pairs, 2, 3, seq_len), indices)
        arr, index = rows
        arr = np.asarray(arr)
        flat = arr.transpose(1, 0, 2, 3).reshape(-1, *arr.shape[2:])
        if (
            multiple
        ):  # cut to the longest row's last token (a response's tail after its targets kept: a reward
            # model's score is read there, trainer/objectives/reward.py); padding restarts its positions at 0
            restart = flat[:, 2, 1:] == 0
            real = np.where(restart.any(axis=1), np.argmax(restart, axis=1) + 1, flat.shape[2])
            flat = flat[:, :, : min(flat.shape[2], -(-int(real.max()) // multiple) * multiple)]
        return Pairs(torch.from_numpy(np.ascontiguousarray(flat).astype(np.int64, copy=False)),
                     torch.from_numpy(np.asarray(index, dtype=np.int64)))  # fmt: skip
    if isinstance(rows, list) and rows and isinstance(rows[0], tuple):  # _PairRows item by item
        return _collate(
            (np.concatenate([r for r, _ in rows]), np.concatenate([i for _, i in rows])), multiple
        )
    arr = np.asarray(rows) if not isinstance(rows, np.ndarray) else rows
    if arr.ndim == 2 and arr[:, -1].min() < 0:  # the padded last block of text (pack.fill_blocks)
        arr = as_rows(arr)
    elif arr.ndim == 3 and multiple:  # 0: seq_len wide (sequence parallelism, tiled MLPs)
        has = arr[:, 1, :] != IGNORE
        width = int(arr.shape[2] - np.argmax(has.any(axis=0)[::-1])) if has.any() else 1
        arr = arr[:, :, : -(-width // multiple) * multiple]
    return torch.from_numpy(np.ascontiguousarray(arr).astype(np.int64, copy=False))


def auto_workers(cores_per_rank: int, device_type: str) -> int:
    """data.num_workers: auto. A batch is one fancy index into memory-mapped blocks (tens of
    microseconds), so a worker process only overlaps that copy with the step. On CPU the step's
    threads use every core of the rank and a worker would take one from them: none (measured in
    BENCHMARKS.md: Data wait). On a GPU the cores are free while the kernels run: one per two cores,
    at most 4, never more than PyTorch's suggested maximum (the cores)."""
    if device_type == "cpu":
        return 0
    return max(1, min(4, cores_per_rank // 2))


def resolve_workers(setting: int | str, device_type: str) -> int:
    """data.num_workers as set, or for auto from this node's cores per rank."""
    if setting != "auto":
        return int(setting)
    from trainer.cluster.dist import cpu_cores, detect

    return auto_workers(max(1, cpu_cores() // max(1, detect().local_world_size)), device_type)


def make_loader(
    ds: Any, sampler: RankSampler, section: DataSection, device_type: str, multiple: int = 1,
    images: Any = None, image_tokens: tuple[int, ...] = (),
) -> Any:  # fmt: skip
    import functools

    import torch
    from torch.utils.data import DataLoader

    workers = resolve_workers(section.num_workers, device_type)
    collate = (
        functools.partial(collate_images, multiple=multiple, image_tokens=image_tokens)
        if images is not None
        else functools.partial(_collate, multiple=multiple)
    )
    return DataLoader(
        ImageRows(ds, images) if images is not None else _PairRows(ds) if ds.ndim == 4 else _Rows(ds),
        batch_size=sampler.micro,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        pin_memory=section.pin_memory and device_type == "cuda",
        persistent_workers=section.persistent_workers and workers > 0,
        collate_fn=collate,
        # Own generator: creating an iterator must not draw from the global RNG (exact resume).
        generator=torch.Generator().manual_seed(0),
        multiprocessing_context="fork" if workers > 0 else None,
    )


@dataclass
class Position:
    """Where training is in the data: the epoch and global samples consumed in it."""

    epoch: int = 0
    sample: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "sample": self.sample}


def step_start(position: Position, sampler: Any) -> Position:
    """Where the step from `position` begins: the next epoch's start where less than a micro step of every rank is
    left of this one (an epoch yields whole optimizer steps only: `RankSampler.usable`)."""
    if position.sample + sampler.global_batch > sampler.usable:
        return Position(position.epoch + 1, 0)
    return Position(position.epoch, position.sample)


def row_digest(row: Any) -> str:
    """A fed row's digest, as a stream records it (`record`: the samples in consistency's debug report)."""
    return hashlib.blake2b(row.numpy().tobytes(), digest_size=8).hexdigest()


class TrainStream:
    """Endless micro batches for this rank, across epochs; knows its position for checkpoints."""

    def __init__(
        self,
        data: Data,
        section: DataSection,
        *,
        rank: int,
        world: int,
        micro: int,
        seed: int,
        device_type: str,
        width_multiple: int = 1,
        accum: int = 1,
    ) -> None:
        mix = data.mixture
        self.multiple = width_multiple  # fine-tuning batches: widths rounded up to this (_collate)
        self.sampler = RankSampler(
            len(data.train), rank, world, micro, seed, section.shuffle,
            mixture=([m["sequences"] for m in mix], [m["weight"] for m in mix]) if mix else None,
            lengths=data.lengths if section.group_by_length else None, accum=accum,
        )  # fmt: skip
        self.lengths = data.lengths  # fine-tuning rows: each batch is as wide as its longest row
        self.sources = [m["source"] for m in mix] if mix else None
        self.seq_len = data.seq_len
        if self.sampler.steps_per_epoch() == 0:
            raise UserError(
                f"data.train: {len(data.train)} sequences are fewer than one step's global batch ({world} ranks x "
                f"train.micro_batch_size {micro} x train.grad_accum {accum}); lower the micro batch or add data"
            )
        self.loader = make_loader(data.train, self.sampler, section, device_type, width_multiple,
                                  data.images, image_tokens(data))  # fmt: skip
        self.targets = data.targets  # fine-tuning rows: target tokens per row (cache), for the step's loss
        self.rows_per_sample = 2 if data.pairs else 1  # preference pairs: a chosen and a rejected row
        self._orders: dict[int, np.ndarray] = {}
        self.position = Position()
        self._it: Iterator[Any] | None = None
        self.record: list[str] | None = None  # digests of consumed rows, when a test asks for them

    def seek(self, position: Position) -> None:
        """Continue from `position` (global samples in the epoch; any world size; a finished epoch: the next)."""
        self.position = step_start(position, self.sampler)
        self._it = None

    def next(self) -> Any:
        if self._it is None:
            self.sampler.set_epoch(self.position.epoch, self.position.sample)
            self._it = iter(self.loader)
        try:
            batch = next(self._it)
        except StopIteration:
            self.position = Position(self.position.epoch + 1, 0)
            self.sampler.set_epoch(self.position.epoch, 0)
            self._it = iter(self.loader)
            batch = next(self._it)
        self.position.sample += self.sampler.global_batch
        if self.record is not None:
            self.record += [row_digest(row) for row in batch]
        return batch

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch()

    def tokens_by_source(self) -> dict[str, int] | None:
        """A mixture: tokens (sequences x seq_len) of each source trained so far, all ranks (from the
        position: every epoch takes each source's share; the current one is counted up to here)."""
        if self.sources is None:
            return None
        sizes, weights = self.sampler.mixture
        ends = np.cumsum(sizes)
        epoch, sample = self.position.epoch, self.position.sample
        counts = epoch * shares(self.sampler.n, weights)
        if epoch not in self._orders:
            self._orders = {epoch: self.sampler.order(epoch)}
        seen = np.searchsorted(ends, self._orders[epoch][:sample], side="right")
        counts = counts + np.bincount(seen, minlength=len(sizes))
        return {name: int(c) * self.seq_len for name, c in zip(self.sources, counts, strict=True)}

    def _ahead(self, micro_steps: int) -> Iterator[np.ndarray]:
        """The rows of every rank in each of the next `micro_steps` micro batches (global batches in
        order; known without communication: the order is global)."""
        gb, n = self.sampler.global_batch, self.sampler.usable
        epoch, sample = self.position.epoch, self.position.sample
        for _ in range(micro_steps):
            if sample + gb > n:  # as next(): an epoch yields whole optimizer steps only
                epoch, sample = epoch + 1, 0
            if epoch not in self._orders:
                self._orders = {epoch: self.sampler.order(epoch)}
            yield self._orders[epoch][sample : sample + gb]
            sample += gb

    def step_tokens(self, micro_steps: int) -> int | None:
        """Fine-tuning rows: the tokens every rank feeds the model in the next step (each micro batch as
        wide as its longest row), for throughput and MFU; None for token blocks (all seq_len wide)."""
        if self.lengths is None or not self.multiple:
            return None
        w, m, k = self.sampler.world, self.sampler.micro, self.multiple
        rows_per = m * self.rows_per_sample  # preference: each pair is two rows as wide
        return sum(int(np.minimum(micro_widths(rows, self.lengths, w, m, k), self.seq_len).sum()) * rows_per
                   for rows in self._ahead(micro_steps))  # fmt: skip

    def padding(self) -> tuple[float, float] | None:
        """Fine-tuning rows: the padding share of the first epoch (padding_shares)."""
        if self.lengths is None:
            return None
        return padding_shares(self.sampler, self.lengths, self.seq_len, self.multiple or self.seq_len)

    def loss_denominator(self, micro_steps: int) -> float | None:
        """Fine-tuning rows: the target tokens of the next `micro_steps` micro batches of every rank
        (known here without communication: the order is global), divided by ranks x micro steps.
        A micro batch's loss is its targets' summed loss over this, so that after DeepSpeed's mean
        over micro steps and ranks a step's loss and gradients are the mean over every target token
        of the step, however the global batch is split. None for token blocks without a padded last
        one (pack.fill_blocks): every micro batch has the same number of targets, its mean is that."""
        if self.targets is None:
            return None
        total = sum(int(self.targets[rows].sum()) for rows in self._ahead(micro_steps))
        return max(total, 1) / (self.sampler.world * micro_steps)


def eval_batches(
    data: Data, section: DataSection, *, rank: int, world: int, micro: int, limit: int, device_type: str,
    width_multiple: int = 1,
) -> Any:  # fmt: skip
    """A fixed, unshuffled loader over the eval set, sharded like training; at most `limit` batches."""
    if data.eval is None:
        return None
    sampler = RankSampler(len(data.eval), rank, world, micro, 0, shuffle=False)
    if sampler.steps_per_epoch() == 0 and not width_multiple:
        return None  # seq_len-wide batches of the micro batch's size (sequence parallelism): none there
    if sampler.steps_per_epoch() == 0:
        # Fewer eval sequences than one global batch: evaluate one smaller batch per rank instead.
        micro = max(1, len(data.eval) // world)
        sampler = RankSampler(len(data.eval), rank, world, micro, 0, shuffle=False)
        if sampler.steps_per_epoch() == 0:
            return None
    loader = make_loader(
        data.eval,
        sampler,
        section.model_copy(update={"persistent_workers": False, "num_workers": 0}),
        device_type,
        width_multiple,
        data.eval_images,
        image_tokens(data),
    )
    return _Limited(loader, limit)


class _Limited:
    def __init__(self, loader: Any, limit: int) -> None:
        self.loader, self.limit = loader, limit

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.loader):
            if i >= self.limit:
                return
            yield batch
