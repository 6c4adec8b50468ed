"""Chunk pool, final window and partition sizing (reference §4.10, §7.8)."""

from __future__ import annotations

import random

import pytest

from flodl_bus.coordinator.chunk_pool import (
    ChunkPool,
    consolidate_lone_ones,
    equal_sizes,
    final_window_alloc,
    ratio_to_sizes,
    split_ranges,
    throughput_sizes,
)


def two_span_pool() -> ChunkPool:
    return ChunkPool(0, [(0, 70), (70, 30)])


def test_chunk_pool_basic_serves_own_span_front_first() -> None:
    pool = ChunkPool.create(0, total_batches=10, batch_size=10, weights=[1, 1])
    assert pool.take_chunk(20, 0) == (0, 20)
    assert pool.take_chunk(20, 1) == (50, 20)
    assert pool.remaining() == 60
    assert pool.in_flight(0) == 20


def test_chunk_pool_exhaustion_returns_none_and_no_overlap() -> None:
    pool = ChunkPool.create(0, total_batches=10, batch_size=1, weights=[1, 1, 1])
    seen: list[int] = []
    while (got := pool.take_chunk(3, len(seen) % 3)) is not None:
        seen += range(got[0], got[0] + got[1])
    assert sorted(seen) == list(range(10))
    assert pool.remaining() == 0


def test_chunk_pool_is_epoch_done_after_every_completion() -> None:
    pool = ChunkPool.create(0, total_batches=4, batch_size=5, weights=[1, 1])
    a = pool.take_chunk(10, 0)
    b = pool.take_chunk(10, 1)
    assert a and b
    assert not pool.is_epoch_done()
    pool.mark_completed(0, 10)
    assert not pool.is_epoch_done()
    pool.mark_completed(1, 10)
    assert pool.is_epoch_done()


def test_chunk_pool_zero_total_is_trivially_done() -> None:
    pool = ChunkPool.create(0, total_batches=0, batch_size=4, weights=[1, 1])
    assert pool.is_epoch_done()
    assert pool.take_chunk(4, 0) is None


def test_chunk_pool_take_steals_largest_residue_tail_when_span_exhausted() -> None:
    pool = two_span_pool()
    assert pool.take_chunk(30, 1) == (70, 30)
    assert pool.take_chunk(20, 1) == (50, 20)
    # the owner keeps its contiguous front
    assert pool.take_chunk(100, 0) == (0, 50)


def test_a_steal_between_equal_residues_takes_from_the_lowest_rank() -> None:
    pool = ChunkPool.create(0, total_batches=12, batch_size=1, weights=[1, 1, 1])
    assert pool.take_chunk(4, 0) == (0, 4)  # rank 0's span is spent; 1 and 2 hold 4 each
    assert pool.take_chunk(1, 0) == (7, 1)  # the tail of rank 1's span, not rank 2's
    assert pool.take_chunk(1, 0) == (11, 1)  # now rank 2 holds more
    assert pool.take_chunk(9, 0) == (4, 3)


def test_chunk_pool_forfeit_reclaims_in_flight_and_serves_it_first() -> None:
    pool = two_span_pool()
    pool.take_chunk(10, 1)
    pool.take_chunk(10, 1)
    assert pool.forfeit(1) == 20
    assert not pool.has_in_flight(1)
    assert pool.take_chunk(15, 0) == (70, 10)  # reclaimed, FIFO, not merged
    assert pool.take_chunk(5, 0) == (80, 5)  # split
    assert pool.take_chunk(5, 0) == (85, 5)


def test_chunk_pool_death_after_take_reclaims_and_completes_exactly_once() -> None:
    pool = ChunkPool(0, [(0, 10), (10, 10)])
    pool.take_chunk(10, 0)
    pool.take_chunk(10, 1)
    pool.forfeit(1)
    got = pool.take_chunk(10, 0)
    assert got == (10, 10)
    pool.mark_completed(0, 20)
    assert pool.is_epoch_done()
    assert pool.completed == [20, 0]


def test_chunk_pool_completion_after_forfeit_clamps() -> None:
    pool = two_span_pool()
    pool.take_chunk(10, 1)
    pool.forfeit(1)
    assert pool.mark_completed(1, 10) == 0
    assert pool.completed[1] == 0
    assert pool.dispatched[1] == 0


def test_chunk_pool_rollback_take_rewinds_cursor() -> None:
    pool = two_span_pool()
    got = pool.take_chunk(10, 0)
    assert got == (0, 10)
    assert pool.rollback_take(0, *got)
    assert pool.take_chunk(10, 0) == (0, 10)
    assert pool.remaining() == 90


def test_chunk_pool_rollback_take_non_newest_reclaims_it() -> None:
    pool = two_span_pool()
    first = pool.take_chunk(10, 0)
    pool.take_chunk(10, 0)
    assert first is not None
    assert pool.rollback_take(0, *first)
    assert pool.take_chunk(10, 1) == (0, 10)  # reclaimed ranges are served first


def test_chunk_pool_rollback_take_unknown_chunk_is_noop() -> None:
    pool = two_span_pool()
    pool.take_chunk(10, 0)
    assert not pool.rollback_take(0, 40, 10)
    assert pool.remaining() == 90


def test_uncovered_ranges_tail_only_on_fresh_pool() -> None:
    assert two_span_pool().uncovered_ranges() == [(0, 100)]


def test_uncovered_ranges_excludes_completed_includes_inflight_and_tail() -> None:
    pool = two_span_pool()
    pool.take_chunk(30, 0)
    pool.mark_completed(0, 30)
    pool.take_chunk(10, 0)
    assert pool.uncovered_ranges() == [(30, 70)]


def test_uncovered_ranges_includes_reclaimed() -> None:
    pool = ChunkPool(0, [(0, 50), (50, 20), (70, 30)])
    pool.take_chunk(20, 1)
    pool.mark_completed(1, 20)
    pool.take_chunk(30, 2)
    pool.forfeit(2)
    assert pool.uncovered_ranges() == [(0, 50), (70, 30)]


def test_from_coverage_dispatches_only_holes_each_once() -> None:
    pool = ChunkPool.from_coverage(3, [(0, 50), (70, 30)], world_size=2)
    taken = []
    while (got := pool.take_chunk(20, len(taken) % 2)) is not None:
        taken.append(got)
    assert taken == [(0, 20), (20, 20), (40, 10), (70, 20), (90, 10)]
    for r in (0, 1):
        pool.mark_completed(r, pool.in_flight(r))
    assert pool.is_epoch_done()


def test_from_coverage_empty_holes_is_done() -> None:
    assert ChunkPool.from_coverage(0, [], world_size=3).is_epoch_done()


# ----------------------------------------------------------------- final window


def test_proportional_split_sums_and_has_no_lone_one() -> None:
    alloc = final_window_alloc(72, [71, 18, 15], [True, True, True])
    assert sum(alloc) == 72
    assert alloc == [49, 13, 10]


@pytest.mark.parametrize("rem", range(3, 21))
def test_tiny_proportional_windows_consolidate(rem: int) -> None:
    alloc = final_window_alloc(rem, [71, 18, 15], [True, True, True])
    assert sum(alloc) == rem
    assert 1 not in alloc


def test_fold_band_pads_slow_ranks_not_the_fastest() -> None:
    assert final_window_alloc(106, [71, 18, 15], [True, True, True]) == [71, 19, 16]


def test_dead_rank_gets_nothing_and_fastest_skips_dead() -> None:
    alloc = final_window_alloc(50, [71, 18, 15], [False, True, True])
    assert alloc[0] == 0
    assert sum(alloc) == 50
    # rank 1 is now the fastest: the crumb of the fold band goes to rank 2
    assert final_window_alloc(35, [71, 18, 15], [False, True, True]) == [0, 18, 17]


def test_single_alive_rank_takes_all() -> None:
    assert final_window_alloc(7, [3, 9], [True, False]) == [7, 0]


def test_irreducible_lone_one_is_left_for_the_fallback() -> None:
    assert final_window_alloc(1, [71, 18, 15], [True, True, True]) == [1, 0, 0]


def test_consolidate_examples() -> None:
    assert consolidate_lone_ones([2, 1, 0]) == [3, 0, 0]
    assert consolidate_lone_ones([1, 1, 0]) == [2, 0, 0]
    assert consolidate_lone_ones([5, 1, 1]) == [5, 2, 0]
    assert consolidate_lone_ones([0, 1, 0]) == [0, 1, 0]


def _consolidate_by_definition(alloc: list[int]) -> list[int]:
    # One move at a time, as the rule reads: the highest lone one goes to the smallest
    # other holder by (slots, rank).
    out = list(alloc)
    while True:
        ones = [r for r, a in enumerate(out) if a == 1]
        holders = [r for r, a in enumerate(out) if a >= 1]
        if not ones or len(holders) < 2:
            return out
        r = ones[-1]
        target = min((p for p in holders if p != r), key=lambda p: (out[p], p))
        out[target] += 1
        out[r] = 0


def test_consolidate_moves_as_the_one_at_a_time_rule_does() -> None:
    rng = random.Random(31)
    cases = [[1] * 1024, [1] * 1023 + [2], [0, 1] * 300, [3, 1, 1, 2, 1, 0, 1]]
    for _ in range(3000):
        n = rng.randint(1, 40)
        top = rng.choice([1, 2, 3, 9])
        cases.append(
            [rng.choice([0, 1, 1]) if rng.random() < 0.7 else rng.randint(0, top) for _ in range(n)]
        )
    for alloc in cases:
        got = consolidate_lone_ones(alloc)
        assert got == _consolidate_by_definition(alloc), alloc
        assert sum(got) == sum(alloc)


# ----------------------------------------------------------------- partition sizes


def test_partition_sync_uneven_remainder() -> None:
    assert equal_sizes(100, 3) == [34, 33, 33]
    assert equal_sizes(1000, 2) == [500, 500]
    assert equal_sizes(7, 1) == [7]


def test_partition_with_user_ratios() -> None:
    assert ratio_to_sizes(900, [3, 2, 1]) == [450, 300, 150]
    assert ratio_to_sizes(12, [1, 3]) == [3, 9]


def test_ratio_to_sizes_zero_sum_is_equal() -> None:
    assert ratio_to_sizes(10, [0, 0, 0]) == [4, 3, 3]


def test_throughput_sizes_are_proportional_to_speed() -> None:
    sizes = throughput_sizes(90, [10.0, 20.0, 40.0])
    assert sum(sizes) == 90
    assert sizes[0] > sizes[1] > sizes[2]
    assert throughput_sizes(10, [None, None]) == [5, 5]


def test_split_ranges_cuts_coalesced_ranges_in_order_into_the_asked_sizes() -> None:
    got = split_ranges([(10, 5), (0, 10), (30, 4)], [8, 0, 9, 5])
    assert got == [[(0, 8)], [], [(8, 7), (30, 2)], [(32, 2)]]
    assert split_ranges([(0, 0)], [3]) == [[]]


def test_chunk_pool_in_flight_counters_match_the_outstanding_chunks() -> None:
    # The state summary reads the kept counters: they must equal the queues after every
    # kind of change (take, partial and whole completion, rollback, forfeit, steal).
    pool = ChunkPool.create(0, 40, 1, [1.0, 2.0, 1.0])

    def check() -> None:
        want = [sum(s for _, s in pool.outstanding(r)) for r in range(3)]
        assert pool.in_flight_all() == want
        assert [pool.in_flight(r) for r in range(3)] == want

    a = pool.take_chunk(4, 0)
    pool.take_chunk(3, 0)
    b = pool.take_chunk(5, 1)
    check()
    pool.mark_completed(0, 2)  # partial head
    check()
    pool.mark_completed(0, 5)  # rest of the head and the next chunk
    check()
    assert b is not None and pool.rollback_take(1, *b)
    check()
    pool.take_chunk(6, 2)
    pool.take_chunk(6, 1)
    pool.forfeit(2)
    check()
    while pool.take_chunk(7, 0) is not None:  # reclaimed, own span, then steals
        check()
    pool.mark_completed(0, 1000)  # clamps
    check()
    assert a is not None and pool.in_flight(0) == 0
