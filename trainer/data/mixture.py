"""A mixture of training sources: each source's share of an epoch and the epoch's order (stream.RankSampler)."""

from __future__ import annotations

import numpy as np


def shares(total: int, weights: list[float]) -> np.ndarray:
    """`total` split by `weights` into integers (largest remainder): each source's sequences in an epoch."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    rest = total - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:rest]] += 1
    return counts


def mixture_order(sizes: list[int], weights: list[float], seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """An epoch of a mixture: as many sequences as all sources hold, each source's share by its
    weight (a source with fewer sequences than its share repeats them, each permutation whole
    before the next; one with more gives a different subset each epoch), seeded by (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch, 1])
    offsets = np.cumsum([0, *sizes[:-1]])
    parts = []
    for size, count, offset in zip(sizes, shares(sum(sizes), weights), offsets, strict=True):
        reps = -(-int(count) // size)
        perms = [rng.permutation(size) if shuffle else np.arange(size) for _ in range(reps)]
        parts.append(np.concatenate(perms)[:count] + offset)
    out = np.concatenate(parts)
    return out[rng.permutation(len(out))] if shuffle else out
