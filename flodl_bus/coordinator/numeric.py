"""Float sums that give the same bits under every Python version.

Python 3.12 made the built-in ``sum()`` of floats compensated (Neumaier); 3.11 adds in
plain double precision, left to right. The core's decisions and its recorded state
(ElChe's smoothed step times, throughput shares, metric averages) go through such sums,
so a record made under one version diverged in the last bit when replayed under the
other. ``ordered_sum`` is the plain left-to-right sum on every version (3.11's result).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable


def ordered_sum(values: Iterable[float]) -> float:
    # Start from the int 0, as sum() does: an empty sum is 0 and 0 + x is x exactly.
    return functools.reduce(operator.add, values, 0)  # type: ignore[no-any-return]
