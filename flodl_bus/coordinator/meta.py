"""The LR-aware meta-controller (reference §4.9.6): shrink the anchor when training
enters a phase that wants shorter windows.

Divergence collapses at an LR drop (the replicas stop moving apart), which the guards
read as "windows can grow"; but after a drop the model is fine-tuning and long windows
waste it. Two detectors, silent while ElChe is still probing:

* a sharp LR drop: the ranks' LR fell more than 30 % below the recent mean (base 0.5);
* convergence: the last K guard verdicts all vetoed or shrank growth (K and base by
  ElChe phase: warmup 5 / 0.3, stable 3 / 0.5, mature 2 / 0.7).

A detector's factor is ``base - (1 - base) * trend``, ``trend`` the anchor's relative
distance above its recent mean (a freshly grown anchor comes down further), clamped to
[0.1, 0.95]; both firing multiply. Each detector's window restarts after it fires, so
one drop is one nudge.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from flodl_bus.coordinator.guard import Verdict, VerdictKind

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
        """One closed window: the live ranks' last LRs, ElChe's anchor and phase, the
        guard's verdict. Returns a NudgeDown, or None."""
        self.fired = ()
        known = [lr for lr in lrs if lr is not None]
        lr = sum(known) / len(known) if known else None
        prev_lrs = list(self.lrs)
        if lr is not None:
            self.lrs.append(lr)
        self.verdicts.append(guard.kind)
        mean_anchor = sum(self.anchors) / len(self.anchors) if self.anchors else float(anchor)
        self.anchors.append(anchor)
        if not self.enabled or phase == "probe":
            return None
        trend = (anchor - mean_anchor) / mean_anchor if mean_anchor > 0 else 0.0
        factors: list[float] = []
        fired: list[str] = []
        if lr is not None and prev_lrs:
            mean_lr = sum(prev_lrs) / len(prev_lrs)
            if mean_lr > 0 and lr < (1 - LR_DROP) * mean_lr:
                factors.append(_clamp(LR_DROP_BASE - (1 - LR_DROP_BASE) * trend))
                fired.append("lr_drop")
                self.lrs.clear()
                self.lrs.append(lr)
        k, base = CONVERGENCE.get(phase, (0, 0.0))
        tail = list(self.verdicts)[-k:] if k else []
        if k and len(tail) == k and all(v is not VerdictKind.STABLE for v in tail):
            factors.append(_clamp(base - (1 - base) * trend))
            fired.append("convergence")
            self.verdicts.clear()
        if not factors:
            return None
        self.fired = tuple(fired)
        factor = 1.0
        for f in factors:
            factor *= f
        return Verdict(VerdictKind.NUDGE_DOWN, _clamp(factor))

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
