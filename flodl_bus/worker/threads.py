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
steps should not be spent at counts that are slower still.

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


def candidates(share: int) -> list[int]:
    """The counts tried, from the share down: the share, then the powers of two below it
    (15 -> 15, 8, 4, 2, 1)."""
    below = [1 << k for k in range(share.bit_length()) if 1 << k < share]
    return [share, *reversed(below)]


@dataclass
class ThreadTuner:
    """Times ``TIMED_STEPS`` steps at each candidate count, then settles on one."""

    share: int
    warm_steps: int = WARM_STEPS
    settle_steps: int = SETTLE_STEPS
    timed_steps: int = TIMED_STEPS
    #: median step (ms) per count tried, in the order tried
    medians: dict[int, float] = field(default_factory=dict)
    #: the count kept, once the sweep is over
    chosen: int | None = None
    _order: list[int] = field(init=False)
    _at: int = field(init=False, default=0)
    _skip: int = field(init=False)
    _times: list[float] = field(init=False, default_factory=list)

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
    def current(self) -> int:
        """The count the steps run at now (the share until the sweep moves)."""
        if self.chosen is not None:
            return self.chosen
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
        if len(self._times) < self.timed_steps:
            return None
        timed = self._order[self._at]
        self.medians[timed] = median = statistics.median(self._times)
        self._times = []
        self._at += 1
        if self._at < len(self._order) and median <= STOP * min(self.medians.values()):
            self._skip = self.settle_steps
            return self._order[self._at]
        self.chosen = pick(self.medians)
        return self.chosen if self.chosen != timed else None

    def describe(self) -> str:
        """One line for the rank's console: what was timed and what was kept."""
        timed = ", ".join(f"{n}: {ms:.3f} ms" for n, ms in self.medians.items())
        return f"torch threads {self.chosen} (sized to the work, median step at {timed})"


def pick(medians: dict[int, float]) -> int:
    """The smallest count whose median is within ``TIE`` of the fastest."""
    best = min(medians.values())
    return min(n for n, ms in medians.items() if ms <= best * (1.0 + TIE))
