"""The shared shuffle (reference §4.10.1): every rank and the coordinator expand a plan to
exactly the same picks."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from flodl_bus.partition import epoch_span, make_partition, split_bounds

P = 100


def test_same_inputs_give_the_same_picks() -> None:
    a = make_partition(10, 40, P, epoch=3, seed=7, splits=2)
    b = make_partition(10, 40, P, epoch=3, seed=7, splits=2)
    assert a == b and len(a) == 40


def test_another_process_expands_a_plan_to_the_same_picks() -> None:
    # ranks and the coordinator are separate interpreters: no per-process state may leak in
    code = (
        "from flodl_bus.partition import make_partition;"
        "print(make_partition(5, 60, 1000, epoch=4, seed=11, splits=3))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == str(make_partition(5, 60, 1000, epoch=4, seed=11, splits=3))


def test_picks_are_plain_ints() -> None:
    assert all(type(p) is int for p in make_partition(0, P, P, epoch=0))


def test_different_epochs_give_different_orders() -> None:
    orders = [make_partition(0, P, P, epoch=e) for e in range(5)]
    assert len({tuple(o) for o in orders}) == 5
    # each epoch (splits=1) is still a permutation of the whole pick space
    assert all(sorted(o) == list(range(P)) for o in orders)


def test_the_seed_changes_the_order() -> None:
    assert make_partition(0, P, P, epoch=0, seed=1) != make_partition(0, P, P, epoch=0, seed=2)


@pytest.mark.parametrize(("epoch", "splits"), [(0, 1), (3, 1), (4, 3), (9, 7)])
def test_consecutive_offsets_never_overlap_and_cover_the_span(epoch: int, splits: int) -> None:
    span = [int(i) for i in epoch_span(P, epoch, splits=splits)]
    sizes = [1, 7, 13, 2, 30, 50]  # more than the span: the last chunk clamps
    chunks, offset = [], 0
    for size in sizes:
        chunks.append(make_partition(offset, size, P, epoch, splits=splits))
        offset += size
    joined = [p for chunk in chunks for p in chunk]
    assert joined == span
    assert len(set(joined)) == len(joined)


def test_splits_of_a_pass_concatenate_to_the_pass() -> None:
    splits = 7
    for pass_ in range(3):
        parts = [
            make_partition(0, P, P, epoch=pass_ * splits + s, splits=splits) for s in range(splits)
        ]
        joined = [p for part in parts for p in part]
        # pass k of a split run is the permutation a splits=1 run uses for epoch k
        assert joined == make_partition(0, P, P, epoch=pass_, splits=1)
        assert sorted(joined) == list(range(P))


def test_100_picks_in_7_splits_are_15_15_14_14_14_14_14() -> None:
    sizes = [len(make_partition(0, P, P, epoch=e, splits=7)) for e in range(7)]
    assert sizes == [15, 15, 14, 14, 14, 14, 14]
    bounds = [split_bounds(P, 7, s) for s in range(7)]
    assert bounds[0] == (0, 15) and bounds[-1] == (86, 100)
    assert all(end == nxt for (_, end), (nxt, _) in itertools.pairwise(bounds))


@pytest.mark.parametrize("splits", [0, -1])
def test_fewer_than_one_split_raises(splits: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        make_partition(0, 10, P, epoch=0, splits=splits)
    with pytest.raises(ValueError, match="at least 1"):
        split_bounds(P, splits, 0)


def test_a_plan_past_the_span_is_clamped() -> None:
    span_len = len(epoch_span(P, 1, splits=3))
    assert make_partition(span_len - 2, 10, P, epoch=1, splits=3) == [
        int(i) for i in epoch_span(P, 1, splits=3)[-2:]
    ]
    assert make_partition(span_len, 10, P, epoch=1, splits=3) == []


def test_the_cached_permutation_cannot_be_corrupted_by_a_caller() -> None:
    span = epoch_span(P, 0)
    with pytest.raises(ValueError):
        span[0] = -1
