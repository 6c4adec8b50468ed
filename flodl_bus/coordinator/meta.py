"""The LR-aware meta-controller (reference §4.9.6): shrink the anchor when training
enters a phase that wants shorter windows.

Divergence collapses at an LR drop (the replicas stop moving apart), which the guards
read as "windows can grow"; but after a drop the model is fine-tuning and long windows
waste it. Each closed window it records the LR (the lowest live rank's that reported
one; nothing is recorded before any did), the anchor and the guard's verdict, in windows
of 3, 5 and 5. Two detectors, silent while ElChe is still probing:

* an LR cliff: the LR fell more than 30 % since the previous window (base 0.5); a
  gradual decay never trips it, and one drop is one nudge;
* convergence: the last K guard verdicts all vetoed or shrank growth (K and base by
  ElChe phase: warmup 5 / 0.3, stable 3 / 0.5, mature 2 / 0.7); it fires again every
  window the vetoes go on.

A detector's factor is ``base - (1 - base) * trend``, ``trend`` the anchor's relative
distance from the mean of the anchor window (which includes it): a freshly grown anchor
comes down further, one already shrinking less. Clamped to [0.1, 0.95]; both firing
multiply, clamped again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from flodl_bus.coordinator.guard import Verdict, VerdictKind
from flodl_bus.coordinator.numeric import ordered_sum

LR_WINDOW = 3
ANCHOR_WINDOW = 5
GUARD_WINDOW = 5
LR_DROP = 0.3
LR_DROP_BASE = 0.5
#: ElChe phase -> (K verdicts in a row, base factor); probe is silent
CONVERGENCE = {"warmup": (5, 0.3), "stable": (3, 0.5), "mature": (2, 0.7)}
FACTOR_MIN = 0.1
FACTOR_MAX = 0.95


def _clamp(f: float) -> float:
    return min(max(f, FACTOR_MIN), FACTOR_MAX)


class MetaController:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.lrs: deque[float] = deque(maxlen=LR_WINDOW)
        self.anchors: deque[int] = deque(maxlen=ANCHOR_WINDOW)
        self.verdicts: deque[VerdictKind] = deque(maxlen=GUARD_WINDOW)
        #: which detectors fired at the last observation (for the record and tests)
        self.fired: tuple[str, ...] = ()

    def observe(
        self, lrs: Sequence[float | None], anchor: int, guard: Verdict, phase: str
    ) -> Verdict | None:
        """One closed window: the ranks' last LRs (None: dead or not reported), ElChe's
        anchor and phase, the guard's verdict. Returns a NudgeDown, or None."""
        self.fired = ()
        lr = next((x for x in lrs if x is not None), None)
        if not self.enabled or lr is None:
            return None
        self.lrs.append(lr)
        self.anchors.append(anchor)
        self.verdicts.append(guard.kind)
        if phase == "probe":
            return None
        trend = self.anchor_trend()
        factors: list[float] = []
        fired: list[str] = []
        if self._lr_cliff():
            factors.append(_clamp(LR_DROP_BASE - (1 - LR_DROP_BASE) * trend))
            fired.append("lr_drop")
        k, base = CONVERGENCE.get(phase, (0, 0.0))
        tail = list(self.verdicts)[-k:] if k else []
        if k and len(tail) == k and all(v is not VerdictKind.STABLE for v in tail):
            factors.append(_clamp(base - (1 - base) * trend))
            fired.append("convergence")
        if not factors:
            return None
        self.fired = tuple(fired)
        factor = 1.0
        for f in factors:
            factor *= f
        return Verdict(VerdictKind.NUDGE_DOWN, _clamp(factor))

    def anchor_trend(self) -> float:
        """``(anchor - mean) / mean`` over the anchor window, this window's included."""
        if len(self.anchors) < 2:
            return 0.0
        mean = ordered_sum(self.anchors) / len(self.anchors)
        return (self.anchors[-1] - mean) / mean if mean > 0 else 0.0

    def _lr_cliff(self) -> bool:
        if len(self.lrs) < 2:
            return False
        prev, now = self.lrs[-2], self.lrs[-1]
        return prev > 0 and now < prev and (prev - now) / prev > LR_DROP

    def state(self) -> dict[str, Any]:
        return {
            "lrs": list(self.lrs),
            "anchors": list(self.anchors),
            "verdicts": [v.value for v in self.verdicts],
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        self.lrs.clear()
        self.lrs.extend(float(x) for x in state.get("lrs", []))
        self.anchors.clear()
        self.anchors.extend(int(x) for x in state.get("anchors", []))
        self.verdicts.clear()
        self.verdicts.extend(VerdictKind(v) for v in state.get("verdicts", []))
