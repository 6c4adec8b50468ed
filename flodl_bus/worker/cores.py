"""A core kept for a rank's training thread (``FLODL_KEEP_CORE=1``; opt-in, Linux).

On a host of idle cores a rank's training thread blocks hundreds of times a second (the
GIL its other threads take, its control reads), and each time it is woken where the
scheduler finds room, often beside the thread or process that woke it: the publisher,
the control reader, the record writer, the coordinator, Redis. So the step can lose its
core, or its caches, to work that had 14 other cores to run on (issue 27: on the 16-core
host two bus ranks stepped at 0.74-0.95 ms where two plain processes stepped at about
0.47). With the policy on, once the rank trains at one intra-op thread, its training
thread runs alone on a core of its own, and every other thread of its process runs on
the cores no rank of the host keeps. An earlier try put the whole control plane on one
kept core instead, and it queued there (BENCHMARKS.md).

Only at one intra-op thread: a team started by a pinned thread inherits its single core.
The kept cores are the highest of the usable ones, one per local rank (the lowest take
the host's interrupts first), and only on a host with at least ``MIN_SPARE`` cores more
than its ranks keep; else nothing is pinned. A thread the training thread starts later
inherits the kept core; ``KeptCore.hold`` puts any such thread back where it belongs (the
rank calls it at each plan's start).

``plan`` is the decision alone; ``KeptCore`` moves threads (``os.sched_setaffinity`` on
a thread id moves that thread only).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

#: ``1``: keep a core for each rank's training thread (see the module's docstring)
ENV: Final = "FLODL_KEEP_CORE"
#: cores beyond the kept ones a host must have for the policy: the rank's other threads,
#: the coordinator and Redis need somewhere to run
MIN_SPARE: Final = 2


def wanted(env: Mapping[str, str]) -> bool:
    """Whether ``FLODL_KEEP_CORE`` asks for the policy; a value other than 0 or 1 is
    refused with the fix named."""
    flag = env.get(ENV, "").strip()
    if flag not in ("", "0", "1"):
        raise ValueError(f"{ENV}={flag!r}: use 1 (a core kept for each training thread) or 0")
    return flag == "1"


@dataclass(frozen=True, slots=True)
class CorePlan:
    #: the training thread's core
    kept: int
    #: where every other thread of the rank runs
    away: frozenset[int]


def plan(cores: Iterable[int], local_rank: int, local_world: int) -> CorePlan | None:
    """Local rank ``local_rank``'s kept core, the ``local_world`` highest of ``cores``
    taken from the top down; None when fewer than ``MIN_SPARE`` cores would be left."""
    usable = sorted(set(cores))
    if not 0 <= local_rank < local_world or len(usable) < local_world + MIN_SPARE:
        return None
    kept_all = usable[len(usable) - local_world :]
    return CorePlan(kept_all[-1 - local_rank], frozenset(usable) - frozenset(kept_all))


@dataclass
class KeptCore:
    """Applies a ``CorePlan`` to this process's threads, from its training thread."""

    plan: CorePlan
    #: the training thread's id (set by ``apply``)
    training: int | None = None
    #: thread ids already put where they belong
    _placed: set[int] = field(default_factory=set)

    def apply(self) -> int:
        """Pin the calling (training) thread to the kept core and every other thread of
        the process away from it; the count of threads moved."""
        self.training = threading.get_native_id()
        self._placed.clear()
        return self.hold()

    def hold(self) -> int:
        """Move the threads started since the last call (they inherited the kept core
        from the training thread); the count moved. A thread gone meanwhile is skipped."""
        if self.training is None:
            return 0
        try:
            tids = {int(t) for t in os.listdir("/proc/self/task")}
        except OSError:
            return 0
        moved = 0
        for tid in tids - self._placed:
            cores = {self.plan.kept} if tid == self.training else set(self.plan.away)
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cores)
                moved += 1
            self._placed.add(tid)
        self._placed &= tids
        return moved
