"""The stall dump (flodl's, reference §4.2): a run that stops moving says why.

A run whose counters have not moved for ``FIRST_S`` (15 s) gets one log line with
everything the gate and the dispatch wait on; a second one at ``SECOND_S`` (120 s). Any
movement (a step, a round, an aggregated epoch) re-arms both. Read by the coordinator's
loop between two core calls; the core never sees it, so records and replay are untouched.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Final

FIRST_S: Final = 15.0
SECOND_S: Final = 120.0
#: how often the loop looks (the dumps are due within this of their time)
STALL_CHECK_S: Final = 1.0


class StallWatch:
    """When to dump: ``check(progress, now)`` returns the seconds stalled at the moment a
    dump is due (the first and the second), else None."""

    def __init__(self, first_s: float = FIRST_S, second_s: float = SECOND_S) -> None:
        self.first_s = first_s
        self.second_s = second_s
        self._progress: Hashable | None = None
        self._since: float | None = None
        self._dumped = 0

    def check(self, progress: Hashable, now: float) -> float | None:
        if progress != self._progress or self._since is None:
            self._progress, self._since, self._dumped = progress, now, 0
            return None
        waited = now - self._since
        due = (self.first_s, self.second_s)
        if self._dumped < len(due) and waited >= due[self._dumped]:
            self._dumped += 1
            return waited
        return None
