"""Explicit entry ids: strictly increasing whatever the wall clock does."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from flodl_bus.bus.ids import IdClock, format_id, parse_id


@given(st.lists(st.integers(min_value=0, max_value=10**13), min_size=1, max_size=200))
def test_ids_strictly_increase_even_when_the_clock_steps_back(clock: list[int]) -> None:
    c = IdClock()
    ids = [c.next(now) for now in clock]
    assert all(a < b for a, b in itertools.pairwise(ids))
    assert all(eid[0] >= now for eid, now in zip(ids, clock))
    assert ids[-1][0] == max(clock)


def test_raise_floor_lifts_the_next_id_above_a_stream_top() -> None:
    c = IdClock()
    c.raise_floor((5000, 7))
    assert c.next(10) == (5000, 8)
    c.raise_floor((1, 0))  # never lowers
    assert c.next(10) == (5000, 9)
    assert c.next(6000) == (6000, 0)


def test_ids_round_trip_through_text() -> None:
    assert parse_id(b"1712-3") == (1712, 3)
    assert parse_id(format_id((9, 0))) == (9, 0)
    assert parse_id("42") == (42, 0)
