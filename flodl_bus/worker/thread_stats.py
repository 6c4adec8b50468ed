"""How often a thread stopped, read from the kernel: the measure of a rank's thread hand-overs.

A rank's training thread blocks where the plain loop's never does: each time another of
its process's threads (the publisher, the control reader, the record writer, the
averaging thread) takes the GIL, the training thread waits for it at its next Python
line, asleep, and is woken when the GIL comes back. On the 16-core host a world of one's
training thread blocked 267 times a second, 360 µs a time on average (issue 27,
BENCHMARKS.md), and step times there drift too much to show a few percent; the count of
waits does not drift. So a rank puts its training thread's count in its record's
``end`` line, the plain loop measures its own the same way, and ``bench train`` prints
both (``bench.breakdown``).

Linux only (``/proc/thread-self``); elsewhere ``sample`` is None and nothing is said.
``scripts/thread_split.py`` reads other processes' threads with the same ``sample``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Final

#: the calling thread's task directory
SELF: Final = "/proc/thread-self"


@dataclass(frozen=True, slots=True)
class ThreadSample:
    """One thread's counters at one moment."""

    tid: int
    #: perf_counter at the sample
    at: float
    #: times it blocked (a lock, the GIL, a socket, a sleep)
    voluntary: int
    #: times the scheduler took its core away
    involuntary: int
    #: ns it ran on a core, and ns it was runnable but waited for one
    run_ns: int
    wait_ns: int


def sample(task: str = SELF) -> ThreadSample | None:
    """The counters of the calling thread, or of the thread whose task directory is
    ``task`` (``/proc/<pid>/task/<tid>``); None where the kernel does not give them (or
    the thread is gone)."""
    try:
        with open(f"{task}/status") as f:
            status = f.read()
        with open(f"{task}/schedstat") as f:
            run_ns, wait_ns, _ = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    counts = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            counts[key] = int(value)
    if len(counts) != 2:
        return None
    return ThreadSample(
        tid=threading.get_native_id() if task == SELF else int(os.path.basename(task)),
        at=time.perf_counter(),
        voluntary=counts["voluntary_ctxt_switches"],
        involuntary=counts["nonvoluntary_ctxt_switches"],
        run_ns=run_ns,
        wait_ns=wait_ns,
    )


def since(start: ThreadSample | None, end: ThreadSample | None) -> dict[str, float] | None:
    """What one thread did between two of its samples, per second of wall time: blocks
    (voluntary switches) and preemptions a second, and the shares of the wall it ran on
    a core and waited for one. None without both samples, or for two threads' samples."""
    if start is None or end is None or start.tid != end.tid:
        return None
    wall = end.at - start.at
    if wall <= 0:
        return None
    return {
        "wall_s": round(wall, 3),
        "blocks_s": round((end.voluntary - start.voluntary) / wall, 1),
        "preempted_s": round((end.involuntary - start.involuntary) / wall, 1),
        "on_core": round((end.run_ns - start.run_ns) / 1e9 / wall, 4),
        "runnable": round((end.wait_ns - start.wait_ns) / 1e9 / wall, 4),
    }
