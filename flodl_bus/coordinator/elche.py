"""ElChe: per-rank window budgets and the anchor (reference §4.9).

``anchor`` is how many batches the slowest rank runs per window; faster ranks get
proportionally more so every rank reaches the reduce at about the same wall time.
Anchor growth is only *proposed* by a window report; the reduce's verdict (divergence
guard) commits it, vetoes it, or discards it and shrinks the anchor.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from flodl_bus.coordinator.guard import Verdict, VerdictKind
from flodl_bus.coordinator.numeric import ordered_sum
from flodl_bus.coordinator.tracked import Tracked

MAX_SPEED_RATIO = 64.0
TRUST_WINDOW = 5
COUNTS_HISTORY = 10
COHORT_BAND = 0.15
DOMINANCE_MARGIN = 0.10
DEAD_ZONE = 0.05
GROWTH_STEP_CAP = 2.0
WARMUP_MARGIN = 2.0
REARM_AFTER = 5
DEAD_WINDOW_ESCAPE = 5
#: not yet computed (``ElChe._smoothed``; None is a value there: no reading)
_UNSET: Final = object()
STABLE_AFTER = 5
MATURE_AFTER = 20


@dataclass(frozen=True, slots=True)
class WindowReport:
    """What one window looked like: per-rank ms per batch (None = no data)."""

    ms_per_batch: tuple[float | None, ...]
    #: wall time of the reduce itself
    reduce_ms: float = 0.0
    #: per rank, the window's first batch beyond a marginal one (the pipeline fill)
    fill_ms: tuple[float, ...] = ()


def _elect(cohort: list[int], ms: Sequence[float | None], cur: int | None) -> int:
    """flodl's election inside the slow cohort (``cohort`` in rank order): the current
    anchor stays unless the slowest other member is slower than it by more than
    ``DOMINANCE_MARGIN`` (two near-equal ranks never swap on noise); with no current
    anchor in the cohort, its lowest rank."""
    if len(cohort) == 1:
        return cohort[0]
    if cur is None or cur not in cohort:
        return min(cohort)
    cur_ms = ms[cur] or 0.0
    # The last of equally slow challengers, as flodl's ``max_by`` picks.
    challenger = max((r for r in cohort if r != cur), key=lambda r: (ms[r] or 0.0, r))
    if (ms[challenger] or 0.0) > cur_ms * (1 + DOMINANCE_MARGIN):
        return challenger
    return cur


def slowest_by_spec(scores: Sequence[float]) -> int | None:
    """The rank whose device scores lowest (``worker.device_spec``), the lowest rank of
    equal scores, as flodl's ``spec_prior::slowest_rank``; None for no scores."""
    if not scores:
        return None
    return min(range(len(scores)), key=lambda r: (scores[r], r))


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


class ElChe:
    def __init__(
        self,
        world_size: int,
        anchor: int = 10,
        overhead_target: float = 0.05,
        max_anchor: int = 1000,
        min_anchor: int | None = None,
        max_batch_diff: int | None = None,
        window_cap: int | None = None,
        growth: bool = True,
        speed_hints: Sequence[float] | None = None,
        device_scores: Sequence[float] | None = None,
        dead_zone_keeps_five_percent: bool = True,
        flodl_election: bool = True,
    ) -> None:
        if world_size < 1:
            raise ValueError("ElChe needs at least one rank")
        if anchor < 1:
            raise ValueError("anchor must be positive")
        self.world_size = world_size
        self.max_anchor = max(1, max_anchor)
        self.anchor = min(anchor, self.max_anchor)
        if min_anchor is None:
            self.min_anchor = self.anchor
        else:
            # A floor above the starting anchor lifts it (flodl's with_min_anchor).
            self.min_anchor = min(max(1, min_anchor), self.max_anchor)
            self.anchor = max(self.anchor, self.min_anchor)
        self.overhead_target = min(max(overhead_target, 0.01), 0.5)
        self.max_batch_diff = max_batch_diff
        self._dead_zone_inclusive = dead_zone_keeps_five_percent
        #: flodl's election (sticky with a margin inside the slow cohort), ring clearing
        #: after ``TRUST_WINDOW`` empty reports and the hinted anchor's pin; False: the
        #: rules of records made before them (lowest index of the cohort)
        self._flodl_election = flodl_election
        self.window_cap = window_cap
        self.growth = growth
        #: bumped whenever ``counts`` is replaced, so callers can cache sums over it
        self.generation = 0
        self._counts: list[int] = Tracked([self.anchor] * world_size)
        self.calibrations = 0
        self.anchor_rank: int | None = None
        self.pending_anchor: int | None = None
        self.window_cap_binding = False
        self.growth_armed = True
        self._stable_streak = 0
        self._rings: list[deque[float]] = [deque(maxlen=TRUST_WINDOW) for _ in range(world_size)]
        #: ``smoothed_ms`` per rank since the rings last changed (a bridge reads every
        #: rank's, once per chunk it sizes: summed afresh, that was O(N) sums a chunk)
        self._smoothed: dict[int, float | None] = {}
        self._smoothed_all: list[float | None] | None = None
        self._zero_windows = [0] * world_size
        self._history: deque[tuple[int, ...]] = deque(maxlen=COUNTS_HISTORY)
        #: per-rank ms of callback time the next report's recompute takes off the counts
        self._slack: list[float] | None = None
        #: the slack of the window being planned (every recompute until the next report)
        self._active_slack: list[float] | None = None
        if speed_hints is not None:
            # Before any measurement, a hinted faster rank starts with a larger window,
            # as a measured one would (the first calibration replaces it).
            slowest = min(speed_hints)
            self._counts = Tracked(
                max(1, _round_half_up(self.anchor * min(s / slowest, MAX_SPEED_RATIO)))
                for s in speed_hints
            )
            if flodl_election:
                # The user named the slow rank (flodl's with_speed_ratio): it anchors
                # until the Stable phase may elect another from measurements.
                self.anchor_rank = list(speed_hints).index(slowest)
        if speed_hints is None and device_scores is not None and len(device_scores) == world_size:
            # Before any timing, the slowest device by spec anchors (flodl's
            # with_device_indices): a prior only, as a hinted rank is, so elections
            # from the Stable phase on may move it. Hints, the user's word, outrank
            # it; scores that miss a rank give none.
            self.anchor_rank = slowest_by_spec(device_scores)
        self._apply_window_cap()

    # ------------------------------------------------------------------ queries
    @property
    def counts(self) -> list[int]:
        """Per-rank window budgets (batches). Treat as read-only; assign a new list."""
        return self._counts

    @counts.setter
    def counts(self, value: list[int]) -> None:
        # Tracked, as every per-rank list the state summary shows (its copy: the
        # caller's list stays the caller's).
        self._counts = Tracked(value)
        self.generation += 1

    @property
    def calibrated(self) -> bool:
        return self.calibrations > 0

    @property
    def phase(self) -> str:
        if self.calibrations >= MATURE_AFTER:
            return "mature"
        if self.calibrations >= STABLE_AFTER:
            return "stable"
        if self.calibrations >= 1:
            return "warmup"
        return "probe"

    def smoothed_ms(self, rank: int) -> float | None:
        got = self._smoothed.get(rank, _UNSET)
        if got is _UNSET:
            ring = self._rings[rank]
            got = self._smoothed[rank] = ordered_sum(ring) / len(ring) if ring else None
        return got  # type: ignore[return-value]

    def smoothed_all(self) -> list[float | None]:
        """``smoothed_ms`` of every rank, in rank order (kept until the rings change:
        read whole by every chunk a bridge sizes). Not to be changed by the caller."""
        if self._smoothed_all is None:
            self._smoothed_all = [self.smoothed_ms(r) for r in range(self.world_size)]
        return self._smoothed_all

    def _rings_changed(self) -> None:
        self._smoothed.clear()
        self._smoothed_all = None

    def recent_batch_share(self) -> list[float]:
        snaps = list(self._history) or [tuple(self.counts)]
        shares = [0.0] * self.world_size
        for snap in snaps:
            total = sum(snap)
            for r in range(self.world_size):
                shares[r] += (snap[r] / total if total else 1.0 / self.world_size) / len(snaps)
        return shares

    def fastest(self, alive: Sequence[bool]) -> int | None:
        """Alive rank with the lowest smoothed ms per batch (ties -> lowest rank)."""
        best: tuple[float, int] | None = None
        for r in range(self.world_size):
            ms = self.smoothed_ms(r)
            if alive[r] and ms is not None and (best is None or ms < best[0]):
                best = (ms, r)
        return best[1] if best else None

    def clamp_total(self, remaining: int) -> list[int]:
        """Counts scaled down to fit ``remaining`` batches, keeping their order (each >= 1)."""
        total = sum(self.counts)
        if total <= remaining or remaining <= 0:
            return list(self.counts)
        scaled = [max(1, c * remaining // total) for c in self.counts]
        while sum(scaled) > remaining and max(scaled) > 1:
            scaled[scaled.index(max(scaled))] -= 1
        return scaled

    # ------------------------------------------------------------------ updates
    def forget(self, rank: int) -> None:
        """A dead rank's timing leaves the cohort: otherwise its stale (often slowest)
        ms keeps it the anchor, and live ranks get counts scaled to a ghost."""
        self._rings[rank].clear()
        self._rings_changed()
        if self.anchor_rank == rank:
            self.anchor_rank = None
            self._elect_anchor_rank()
        if self.calibrations:
            self._recompute(first=False)

    def report_window(self, report: WindowReport) -> None:
        """Fold one window's timing in; recompute counts and maybe propose growth."""
        self._active_slack, self._slack = self._slack, None
        readings = report.ms_per_batch[: self.world_size]
        valid = [ms is not None and ms > 0 and math.isfinite(ms) for ms in readings]
        if self._flodl_election and not any(valid):
            return  # a window with no reading at all is no report (flodl's report_window)
        seen = False
        self._rings_changed()  # the rings change below
        for r, ms in enumerate(readings):
            if valid[r]:
                self._rings[r].append(ms)  # type: ignore[arg-type]
                self._zero_windows[r] = 0
                seen = True
            else:
                self._zero_windows[r] += 1
                if self._flodl_election and self._zero_windows[r] >= TRUST_WINDOW:
                    # A rank silent for a whole trust window stops steering the counts
                    # with what it measured before; it starts afresh when it reports.
                    self._rings[r].clear()
        if not seen:
            return
        # Election and growth read the phase this report starts in (flodl advances it
        # after the report): Stable's rules apply from the 6th calibration on.
        phase = self.phase
        first = self.calibrations == 0
        self.calibrations += 1
        self._elect_anchor_rank(phase)
        # Proposed before the recompute, as flodl does: the window cap it checks is the
        # one the window just closed ran under.
        self.pending_anchor = self._growth_proposal(report, phase)
        self._recompute(first=first)

    def apply_verdict(self, verdict: Verdict, relax_up: bool = False) -> None:
        """Commit (Stable), veto (SuppressGrowth) or discard-and-shrink (NudgeDown).

        ``relax_up``: a Stable verdict also grows the anchor by one (flodl's opt-in
        ``elche_relax_up``, which the caller grants to cpu-async only)."""
        if verdict.kind is VerdictKind.STABLE:
            self._stable_streak += 1
            if not self.growth_armed and self._stable_streak >= REARM_AFTER:
                self.growth_armed = True
            if self.pending_anchor is not None and self.pending_anchor != self.anchor:
                self.anchor = self.pending_anchor
                self._recompute(first=False)
            if relax_up:
                self.relax_anchor_up()
        else:
            self._stable_streak = 0
            self.growth_armed = False
            if verdict.kind is VerdictKind.NUDGE_DOWN:
                self.pending_anchor = None
                self.nudge_anchor_down(verdict.factor)
        self.pending_anchor = None

    def nudge_anchor_down(self, factor: float) -> None:
        if not math.isfinite(factor):
            return
        f = min(max(factor, 0.1), 1.0)
        self.anchor = max(1, min(self.anchor, math.ceil(self.anchor * f)))
        if self._slow_ms() is not None:
            self._recompute(first=False)

    def relax_anchor_up(self) -> None:
        """One more batch per window, up to ``max_anchor`` (reference §4.9.4).

        The upward twin of ``nudge_anchor_down``: while the guard keeps saying Stable,
        async windows lengthen and the reduce is paid less often. With a
        ``max_batch_diff`` the step is refused when it would put the fastest rank more
        than that many batches ahead of the slowest (for speed ratio R the anchor then
        stops near ``max_batch_diff / (R - 1)``), as the throttle would hold it anyway.
        """
        if self.anchor >= self.max_anchor:
            return
        if self.max_batch_diff is not None:
            known = [ms for r in range(self.world_size) if (ms := self.smoothed_ms(r))]
            if known:
                new_anchor = self.anchor + 1
                fast = max(1, _round_half_up(new_anchor * max(known) / min(known)))
                if fast - new_anchor > self.max_batch_diff:
                    return
        self.anchor += 1
        # Uncalibrated counts (equal, or speed hints) stay until the first measurement.
        if self._slow_ms() is not None:
            self._recompute(first=False)

    def stage_slack(self, slack_ms: Sequence[float]) -> None:
        """The next report shortens each rank's window by its ms of callback time."""
        if len(slack_ms) == self.world_size:
            self._slack = list(slack_ms)

    # ------------------------------------------------------------------ internals
    def _slow_ms(self) -> float | None:
        return self.smoothed_ms(self.anchor_rank) if self.anchor_rank is not None else None

    def _elect_anchor_rank(self, phase: str | None = None) -> None:
        ms = [self.smoothed_ms(r) for r in range(self.world_size)]
        known = [(m, r) for r, m in enumerate(ms) if m is not None]
        if not known:
            return
        cur = self.anchor_rank
        if cur is not None and self._zero_windows[cur] >= DEAD_WINDOW_ESCAPE:
            cur = None
        if cur is not None and (phase or self.phase) not in ("stable", "mature"):
            return
        slowest = max(m for m, _ in known)
        cohort = [r for m, r in known if m >= slowest * (1 - COHORT_BAND)]
        if not self._flodl_election:
            if cur is not None:
                cur_ms = ms[cur]
                if cur_ms is not None and slowest <= cur_ms * (1 + DOMINANCE_MARGIN):
                    return
            self.anchor_rank = min(cohort)
            return
        self.anchor_rank = _elect(cohort, ms, cur)

    def _recompute(self, first: bool) -> None:
        slow = self._slow_ms()
        slack = self._active_slack
        new = []
        for r in range(self.world_size):
            ms = self.smoothed_ms(r)
            if r == self.anchor_rank or ms is None or slow is None:
                target = self.anchor
            else:
                target = max(1, _round_half_up(self.anchor * min(slow / ms, MAX_SPEED_RATIO)))
            old = self.counts[r]
            slacked = False
            if slack is not None and slack[r] > 0 and ms is not None:
                # Callback time the rank will spend at the epoch's end: its window is
                # shortened so the others do not wait for it (no dead zone here).
                target = max(1, target - math.ceil(slack[r] / ms))
                slacked = True
            if not first:
                if not slacked and self._in_dead_zone(target, old):
                    target = old
                elif self.max_batch_diff is not None:
                    d = self.max_batch_diff
                    target = max(min(max(target, old - d), old + d), 1)
            new.append(target)
        self.counts = new
        self._apply_window_cap()
        self._history.append(tuple(self.counts))

    def _in_dead_zone(self, target: int, old: int) -> bool:
        if self._dead_zone_inclusive:
            return abs(target - old) <= DEAD_ZONE * old
        return old > 0 and abs(target - old) / old < DEAD_ZONE

    def _apply_window_cap(self) -> None:
        cap = self.window_cap
        total = sum(self.counts)
        if cap is None or total <= cap:
            self.window_cap_binding = False
            return
        self.window_cap_binding = True
        scaled = [max(1, c * cap // total) for c in self.counts]
        if self._flodl_election:
            # flodl: the remainder goes to the last of the largest counts
            fastest = max(range(self.world_size), key=lambda r: (self.counts[r], r))
        else:
            fastest = min(range(self.world_size), key=lambda r: (-self.counts[r], r))
        while sum(scaled) < cap:
            scaled[fastest] += 1
        # Ones lifted from zero can put the sum above the cap (flodl lets it): a window
        # never outgrows the epoch here.
        while sum(scaled) > cap and max(scaled) > 1:
            scaled[scaled.index(max(scaled))] -= 1
        self.counts = scaled

    def _growth_proposal(self, report: WindowReport, phase: str) -> int | None:
        if phase == "probe":
            return None  # one sample is a reading, not a trend
        if not self.growth or not self.growth_armed or self.window_cap_binding:
            return None
        marginal = self._slow_ms()
        if marginal is None:
            return None
        # The anchor (slowest) rank's fill: it never waits on the allocation, so its
        # fixed cost per window is what a longer window amortizes.
        b = self.anchor_rank
        fill = report.fill_ms[b] if b is not None and b < len(report.fill_ms) else 0.0
        cost = max(report.reduce_ms, 0.0) + max(fill, 0.0)
        denom = self.anchor * marginal + cost
        if denom <= 0:
            return None
        overhead = cost / denom
        margin = WARMUP_MARGIN if phase == "warmup" else 1.0
        if overhead <= margin * self.overhead_target:
            return None
        step = min(overhead / self.overhead_target, GROWTH_STEP_CAP)
        proposal = min(max(math.ceil(self.anchor * step), self.min_anchor), self.max_anchor)
        return proposal if proposal > self.anchor else None

    # ------------------------------------------------------------------ persistence
    def state(self) -> dict[str, Any]:
        return {
            "anchor": self.anchor,
            "counts": list(self.counts),
            "smoothed_ms": [self.smoothed_ms(r) for r in range(self.world_size)],
            "rings": [list(r) for r in self._rings],
            "phase": self.phase,
            "calibrations": self.calibrations,
            "anchor_rank": self.anchor_rank,
            # What the next windows' growth and elections read (absent in older metas).
            "growth_armed": self.growth_armed,
            "stable_streak": self._stable_streak,
            "zero_windows": list(self._zero_windows),
            "history": [list(h) for h in self._history],
            "slack": None if self._slack is None else list(self._slack),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        self.anchor = min(int(state["anchor"]), self.max_anchor)
        counts = [int(c) for c in state["counts"]]
        if len(counts) == self.world_size:
            self.counts = counts
        self._rings_changed()
        for r, ring in enumerate(state.get("rings", [])[: self.world_size]):
            self._rings[r].clear()
            self._rings[r].extend(float(x) for x in ring)
        self.calibrations = int(state.get("calibrations", 0))
        ar = state.get("anchor_rank")
        self.anchor_rank = int(ar) if ar is not None else None
        self.growth_armed = bool(state.get("growth_armed", self.growth_armed))
        self._stable_streak = int(state.get("stable_streak", 0))
        zeros = [int(z) for z in state.get("zero_windows", [])]
        if len(zeros) == self.world_size:
            self._zero_windows = zeros
        self._history.clear()
        self._history.extend(tuple(int(c) for c in h) for h in state.get("history", []))
        slack = state.get("slack")
        self._slack = None if slack is None else [float(x) for x in slack]
        self._apply_window_cap()
