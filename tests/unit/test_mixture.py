"""Mixtures of several training sources (data.train as a list with weights): an epoch's order is
deterministic for the seed, each source's share is its weight's, every source is used whole before
it repeats, and the tokens seen per source follow from the position alone (so they resume)."""

import numpy as np
import pytest

from trainer.data.stream import RankSampler, mixture_order, shares


def test_shares_add_up_and_follow_the_weights():
    assert shares(100, [1, 1, 2]).tolist() == [25, 25, 50]
    assert shares(10, [1, 1, 1]).sum() == 10
    assert shares(7, [3, 1]).tolist() == [5, 2]


def test_an_epoch_of_a_mixture():
    sizes, weights = [300, 1000, 50], [1.0, 1.0, 2.0]
    n = sum(sizes)
    order = mixture_order(sizes, weights, seed=7, epoch=0, shuffle=True)
    assert len(order) == n
    source = np.searchsorted(np.cumsum(sizes), order, side="right")
    got = np.bincount(source, minlength=3) / n
    want = np.asarray(weights) / sum(weights)
    assert np.all(np.abs(got - want) <= 0.02), (got, want)  # within 2% of the weights (exact here)
    # the small source (50 sequences, 675 draws) repeats its permutations whole
    small = order[source == 2] - 1300
    assert sorted(np.bincount(small).tolist()) == [13] * 25 + [14] * 25
    # the large one gives a subset without repeats, a different one next epoch
    large = order[source == 1]
    assert len(set(large.tolist())) == len(large)
    nxt = mixture_order(sizes, weights, seed=7, epoch=1, shuffle=True)
    assert not np.array_equal(order, nxt)
    assert np.array_equal(
        order, mixture_order(sizes, weights, seed=7, epoch=0, shuffle=True)
    )  # deterministic
    assert not np.array_equal(order, mixture_order(sizes, weights, seed=8, epoch=0, shuffle=True))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_take_disjoint_slices_of_the_same_global_order(world):
    sizes, weights = [40, 24], [1.0, 3.0]
    mine = [
        list(RankSampler(64, r, world, 2, seed=3, shuffle=True, mixture=(sizes, weights)))
        for r in range(world)
    ]
    order = mixture_order(sizes, weights, 3, 0, True)
    steps = 64 // (world * 2)
    for r in range(world):
        want = order[: steps * world * 2].reshape(steps, world, 2)[:, r, :].reshape(-1).tolist()
        assert mine[r] == want
