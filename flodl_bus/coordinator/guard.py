"""The divergence guards (reference §4.9.5) and the verdict they hand ElChe: trend
(default), MSF growth rate (opt-in), none."""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flodl_bus.coordinator.config import CoordinatorConfig, Policy

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

    def report(self, deltas: Sequence[float | None], k_max: int = 1) -> Verdict:
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


MSF_EMA = 0.9
MSF_FLOOR = 1e-8
MSF_SUPPRESS = 1e-3
MSF_NUDGE = 1e-2
MSF_STREAK = 3
MSF_NUDGE_FACTOR = 0.5


class MsfGuard:
    """The growth-rate guard (opt-in): acts on how fast divergence grows per step.

    ``λ = ln(D_t / D_{t-1}) / k_max`` (``k_max``: the most steps a rank ran in the
    window), smoothed by a bias-corrected EMA. Three windows in a row above 1e-3 veto
    growth; three above 1e-2 shrink the anchor by half (``NudgeDown``, which wins when
    both are due), so the anchor can come down when the windows are too long, which the
    trend guard never does. Each trigger restarts its own streak when it fires, so a
    sustained climb acts every third window, not every window. A divergence at or below
    the noise floor (1e-8) yields no rate and breaks the chain: the next window's ratio
    against ~0 would read as an explosion.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.history: deque[float] = deque(maxlen=HISTORY)
        self._prev: float | None = None
        self._ema = 0.0
        self._n = 0
        self.rate: float | None = None
        self._suppress_streak = 0
        self._nudge_streak = 0

    def report(self, deltas: Sequence[float | None], k_max: int = 1) -> Verdict:
        value = max_relative_delta(deltas)
        self.history.append(value)
        prev, self._prev = self._prev, (value if value > MSF_FLOOR else None)
        if prev is not None and value > MSF_FLOOR and k_max > 0:
            lam = math.log(value / prev) / k_max
            self._n += 1
            self._ema = MSF_EMA * self._ema + (1 - MSF_EMA) * lam
        # The smoothed rate persists through a window that yields no sample of its own.
        self.rate = self._ema / (1 - MSF_EMA**self._n) if self._n else None
        if not self.enabled:
            return STABLE
        rate = self.rate if self.rate is not None else -math.inf
        self._suppress_streak = self._suppress_streak + 1 if rate > MSF_SUPPRESS else 0
        self._nudge_streak = self._nudge_streak + 1 if rate > MSF_NUDGE else 0
        if self._nudge_streak >= MSF_STREAK:
            self._nudge_streak = 0
            return Verdict(VerdictKind.NUDGE_DOWN, MSF_NUDGE_FACTOR)
        if self._suppress_streak >= MSF_STREAK:
            self._suppress_streak = 0
            return SUPPRESS
        return STABLE

    def restore(self, history: Iterable[float]) -> None:
        self.history.clear()
        self.history.extend(float(h) for h in history)
        last = self.history[-1] if self.history else None
        self._prev = last if last is not None and last > MSF_FLOOR else None

    def state(self) -> dict[str, Any]:
        """The rate's EMA and streaks (the history travels as ``trend_history``)."""
        return {
            "ema": self._ema,
            "n": self._n,
            "suppress_streak": self._suppress_streak,
            "nudge_streak": self._nudge_streak,
        }

    def restore_state(self, state: Mapping[str, Any]) -> None:
        self._ema = float(state.get("ema", 0.0))
        self._n = int(state.get("n", 0))
        self._suppress_streak = int(state.get("suppress_streak", 0))
        self._nudge_streak = int(state.get("nudge_streak", 0))


class NoGuard:
    """``--guard none``: every window is Stable."""

    def __init__(self) -> None:
        self.history: deque[float] = deque(maxlen=HISTORY)

    def report(self, deltas: Sequence[float | None], k_max: int = 1) -> Verdict:
        self.history.append(max_relative_delta(deltas))
        return STABLE

    def restore(self, history: Iterable[float]) -> None:
        self.history.clear()
        self.history.extend(float(h) for h in history)


Guard = TrendGuard | MsfGuard | NoGuard


def make_guard(config: CoordinatorConfig) -> Guard:
    """The configured guard; sync windows never grow, so their guard never acts."""
    enabled = config.policy is not Policy.SYNC
    if config.guard == "msf":
        return MsfGuard(enabled=enabled)
    if config.guard == "none":
        return NoGuard()
    return TrendGuard(config.guard_threshold, enabled=enabled)


def merge(guard: Verdict, meta: Verdict | None) -> Verdict:
    """The meta-controller's NudgeDown overrides the guard's verdict: a pending growth
    proposal must not survive it (flodl bug: a nudge clobbered by a growth commit)."""
    if meta is None or meta.kind is not VerdictKind.NUDGE_DOWN:
        return guard
    if guard.kind is VerdictKind.NUDGE_DOWN:
        return Verdict(VerdictKind.NUDGE_DOWN, min(max(guard.factor * meta.factor, 0.1), 1.0))
    return meta
