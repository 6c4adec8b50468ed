"""Sizing a rank's intra-op threads to the work, during its first steps.

A rank's default share of the host's cores (``worker.host.thread_share``) is right for a
model whose ops are large enough to split, and wrong for one whose ops are not: a small
model's parallel regions are a few microseconds of work each, their threads spin at
every region's end, and on a 16-core host a world of one trained digits at 15 threads in
1.48 s against 1.04 s at 4 (the plain loop 0.78 s at 15), two ranks' averaging rounds
took 13 ms at 7 threads each against 4 ms at 5 (issue 27). The right count depends on the
model, the batch and the host, so the rank measures it: the first steps run at each
candidate count in turn, and the rank keeps the one whose steps were fastest, the
smallest of those within ``TIE`` of it (fewer threads leave more of the host to the
control plane and the other ranks). A count ``STOP`` times slower than the best so far
ends the sweep early: a model whose ops do split slows at each halving, and its long
steps should not be spent at counts that are slower still. Short steps (the best under
``STOP_MIN_MS``) never stop the sweep: the whole of it costs them little, and a count
can be slower than both its neighbours (on the 16-core host 8 threads often were, 4
out of 7 once, 3.8x), so a stop there kept 15 or 7 threads where 1 was the fastest.

The sweep times each count at another moment of the run, and a host drifts between them
(a neighbour's burst, the clock, the run's own first epochs): on the 16-core host the
same digits run kept 1, 4 or 15 threads from one start to the next, and a run that kept
4 or 15 trained 20-90% slower than one that kept 1. So when the fastest count is not the
fewest that came close (within ``RUNOFF``), the two are timed again in a run-off, in
short alternating blocks, so that a drift or a burst lands on both; the pick is then
made on the run-off's steps alone, the fewer threads kept unless the other count was
faster by more than ``RUNOFF_TIE``.

``ThreadTuner`` is the decision alone (sans-IO): it is fed each step's time and says which
count to set next; the training loop calls ``torch.set_num_threads``. The steps it times
train as any other: only their thread count differs. A count timed is the step's own
time (compute and data), never a wait between steps, so a round or a plan boundary in the
middle of the sweep does not bias it.

The chosen count changes a CPU run's numerics as any thread count does (a sum split
differently rounds differently), and the choice follows timing: a run that must be
repeatable bit for bit pins its threads (``FLODL_NUM_THREADS``, a launcher's
``OMP_NUM_THREADS``) or runs in lockstep, and then nothing is tuned.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Final

#: steps of the run before the first timed one (allocator, lazy init, the first plan)
WARM_STEPS: Final = 10
#: steps after each change of count before its timing starts (the team re-forms)
SETTLE_STEPS: Final = 3
#: steps timed at each candidate count (their median is the count's figure)
TIMED_STEPS: Final = 8
#: a count within this share of the fastest one counts as fast as it
TIE: Final = 0.03
#: a count this many times slower than the fastest so far ends the sweep: a model whose
#: ops do split (compute-bound) slows at every halving, and its steps may be long
STOP: Final = 1.5
#: a sweep whose best median is under this many ms goes on to the end whatever it meets
STOP_MIN_MS: Final = 3.0
#: the fewest threads whose sweep median is within this factor of the fastest's meets it
#: in a run-off (when they differ)
RUNOFF: Final = 1.25
#: blocks at each of the two counts in a run-off, alternating (each block settles, then
#: times ``TIMED_STEPS // 2`` steps)
RUNOFF_BLOCKS: Final = 3
#: the run-off keeps the fewer threads unless the other count's steps were faster by more
#: than this share: its medians are of a dozen steps each, and on the 16-core host a
#: world of one still kept 4 threads in one run of six, to train 1.5-1.9x slower a step
#: than at 1; a model whose ops do split is faster by far more than this at more threads
RUNOFF_TIE: Final = 0.10


def candidates(share: int) -> list[int]:
    """The counts tried, from the share down: the share, then the powers of two below it
    (15 -> 15, 8, 4, 2, 1)."""
    below = [1 << k for k in range(share.bit_length()) if 1 << k < share]
    return [share, *reversed(below)]


@dataclass
class ThreadTuner:
    """Times ``TIMED_STEPS`` steps at each candidate count, then (where two counts came
    close) runs the two off against each other, then settles on one."""

    share: int
    warm_steps: int = WARM_STEPS
    settle_steps: int = SETTLE_STEPS
    timed_steps: int = TIMED_STEPS
    runoff_blocks: int = RUNOFF_BLOCKS
    #: median step (ms) per count tried, in the order tried
    medians: dict[int, float] = field(default_factory=dict)
    #: median step (ms) of the run-off's two counts (empty: there was none)
    runoff: dict[int, float] = field(default_factory=dict)
    #: the count kept, once the sweep is over
    chosen: int | None = None
    _order: list[int] = field(init=False)
    _at: int = field(init=False, default=0)
    _skip: int = field(init=False)
    _times: list[float] = field(init=False, default_factory=list)
    #: the run-off's count of each block still to run, the current one first
    _blocks: list[int] = field(init=False, default_factory=list)
    _runoff_times: dict[int, list[float]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.share < 1:
            raise ValueError(f"a share of {self.share} threads: use 1 or more")
        self._order = candidates(self.share)
        self._skip = self.warm_steps
        if len(self._order) == 1:
            self.chosen = self.share

    @property
    def done(self) -> bool:
        return self.chosen is not None

    @property
    def in_runoff(self) -> bool:
        """Whether the steps now time the run-off's two counts (the sweep is over)."""
        return bool(self._blocks)

    @property
    def current(self) -> int:
        """The count the steps run at now (the share until the sweep moves)."""
        if self.chosen is not None:
            return self.chosen
        if self._blocks:
            return self._blocks[0]
        return self._order[self._at]

    def observe(self, step_ms: float) -> int | None:
        """One step took ``step_ms`` at ``current`` threads; returns the count to set
        before the next step, or None to keep the current one."""
        if self.chosen is not None:
            return None
        if self._skip > 0:
            self._skip -= 1
            return None
        self._times.append(step_ms)
        if self._blocks:
            return self._runoff_step()
        if len(self._times) < self.timed_steps:
            return None
        timed = self._order[self._at]
        self.medians[timed] = median = statistics.median(self._times)
        self._times = []
        self._at += 1
        best = min(self.medians.values())
        if self._at < len(self._order) and (best < STOP_MIN_MS or median <= STOP * best):
            self._skip = self.settle_steps
            return self._order[self._at]
        fastest = pick(self.medians)
        fewest = min(n for n, ms in self.medians.items() if ms <= best * RUNOFF)
        if fewest == fastest or self.runoff_blocks < 1:
            return self._settle(fastest, timed)
        # The run-off starts at the count the steps run at now where it is one of the
        # two (the last timed is the fewest tried): no change of count to start it.
        first, second = (fewest, fastest) if timed != fastest else (fastest, fewest)
        self._blocks = [first, second] * self.runoff_blocks
        self._runoff_times = {fewest: [], fastest: []}
        self._skip = 0 if first == timed else self.settle_steps
        return None if first == timed else first

    def _runoff_step(self) -> int | None:
        if len(self._times) < max(1, self.timed_steps // 2):
            return None
        count = self._blocks.pop(0)
        self._runoff_times[count].extend(self._times)
        self._times = []
        if self._blocks:
            self._skip = self.settle_steps
            return self._blocks[0]
        self.runoff = {n: statistics.median(ts) for n, ts in self._runoff_times.items()}
        fewer, more = sorted(self.runoff)
        faster = self.runoff[more] * (1.0 + RUNOFF_TIE) < self.runoff[fewer]
        return self._settle(more if faster else fewer, count)

    def _settle(self, count: int, running: int) -> int | None:
        self.chosen = count
        return count if count != running else None

    def describe(self) -> str:
        """One line for the rank's console: what was timed and what was kept."""
        timed = ", ".join(f"{n}: {ms:.3f} ms" for n, ms in self.medians.items())
        off = ""
        if self.runoff:
            off = "; run-off " + ", ".join(f"{n}: {ms:.3f} ms" for n, ms in self.runoff.items())
        return f"torch threads {self.chosen} (sized to the work, median step at {timed}{off})"


def pick(medians: dict[int, float]) -> int:
    """The smallest count whose median is within ``TIE`` of the fastest."""
    best = min(medians.values())
    return min(n for n, ms in medians.items() if ms <= best * (1.0 + TIE))
