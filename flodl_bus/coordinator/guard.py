"""The trend divergence guard (reference §4.9.5) and the verdict it hands ElChe."""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

HISTORY = 5
RISING = 3


class VerdictKind(enum.Enum):
    STABLE = "stable"
    SUPPRESS_GROWTH = "suppress_growth"
    NUDGE_DOWN = "nudge_down"


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    factor: float = 1.0


STABLE = Verdict(VerdictKind.STABLE)
SUPPRESS = Verdict(VerdictKind.SUPPRESS_GROWTH)


def max_relative_delta(deltas: Iterable[float | None]) -> float:
    """Worst rank's ``‖pre - post‖ / ‖post‖``; a missing value counts as 0."""
    return max((d for d in deltas if d is not None and d == d), default=0.0)


class TrendGuard:
    """Vetoes anchor growth while divergence climbs.

    Fires ``SuppressGrowth`` when the last three ``max_relative_delta`` values are strictly
    rising *and* the latest is above ``threshold``: a single spike is noise, a sustained
    climb means the windows are already too long. Never shrinks the anchor.
    """

    def __init__(self, threshold: float = 0.05, enabled: bool = True) -> None:
        self.threshold = threshold
        self.enabled = enabled
        self.history: deque[float] = deque(maxlen=HISTORY)

    def report(self, deltas: Sequence[float | None]) -> Verdict:
        value = max_relative_delta(deltas)
        self.history.append(value)
        if not self.enabled or len(self.history) < RISING:
            return STABLE
        tail = list(self.history)[-RISING:]
        rising = all(a < b for a, b in itertools.pairwise(tail))
        return SUPPRESS if rising and tail[-1] > self.threshold else STABLE

    def restore(self, history: Iterable[float]) -> None:
        self.history.clear()
        self.history.extend(float(h) for h in history)
