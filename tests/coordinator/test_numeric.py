"""The core's float sums do not depend on the Python version that runs them."""

from __future__ import annotations

import functools
import math
import operator

from flodl_bus.coordinator.elche import ElChe
from flodl_bus.coordinator.numeric import ordered_sum


def test_ordered_sum_adds_left_to_right_in_plain_doubles_on_every_version() -> None:
    # Python 3.12's sum() compensates and returns 1.0 here; 3.11's returns 0.0.
    assert ordered_sum([1e16, 1.0, -1e16]) == 0.0
    values = [0.1] * 10 + [1e-17, 3.3, -2.2]
    assert ordered_sum(values) == functools.reduce(operator.add, values, 0)


def test_ordered_sum_keeps_sums_of_ints_exact_and_an_empty_sum_zero() -> None:
    assert ordered_sum([2**60, 1, -(2**60)]) == 1
    assert ordered_sum([]) == 0


def test_elches_smoothed_step_time_has_the_bits_a_311_replay_computes() -> None:
    # The ring of a one-rank H200 run recorded under Python 3.12, whose final WriteMeta
    # held ...175 where a 3.11 replay computed ...173: a correctly rounded (compensated)
    # sum and the plain one differ here, and the core must give the plain one anywhere.
    ring = [
        12.49149766666354,
        12.134618777777304,
        12.323325333331544,
        12.656743000001647,
        13.307334857151838,
    ]
    assert math.fsum(ring) / 5 == 12.582703926985175
    e = ElChe(world_size=1)
    e._rings[0].extend(ring)  # the ring as the record left it
    assert e.smoothed_ms(0) == 12.582703926985173
