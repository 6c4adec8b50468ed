"""The coordinator's control writes on a thread of their own (issue 31; opt-in,
``LoopOptions.send_thread``, ``FLODL_SEND_THREAD=1``).

The loop waits for every ``Send``/``Broadcast`` round trip before it reads on: at 1,024
ranks about 470 µs a bus call, 2.2 s of an 11 s loop on the 16-core host. With a lane it
hands each run of them to ``SendLane.put`` and goes on; one thread writes what it was
handed, in that order, and hands back what was refused. On that host it took a quarter
of the loop's work off it, but the epoch did not get shorter and the median dispatch got
slower (each write carried what queued behind the one before it: 40-60 entries, 15-20
ms), so it is not the default (BENCHMARKS.md, 2026-12-06, fifth session).

* **Order.** One thread takes the items in the order they were put, so every rank's
  control keeps the core's order across calls (DESIGN §3 rule 1). Nothing else may
  write a control stream while a lane runs (the loop's own writes go through it).
* **Fewer round trips.** Consecutive items of one kind (all unicast, or all broadcast:
  ``send_batch`` never mixes them) waiting together go out in one ``send_batch``, up to
  ``MAX_BATCH``: the sends of several core calls in one transaction, all or none.
* **Failures come back to the loop.** A refused item is handed back (``take``); the
  loop runs ``Coordinator.send_failed`` for a Send as the recorded core call it always
  was, a turn later than when the write was on its thread. The record holds what the
  core saw and in which order, so replay stays exact.
* **Bounded.** At most ``MAX_QUEUED`` items wait: a ``put`` beyond that blocks until the
  thread has taken some (the loop then waits on Redis as it did before), so a Redis
  that stalls cannot grow the coordinator's memory without end.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from flodl_bus.bus.api import CoordinatorBus
from flodl_bus.coordinator.effects import Broadcast, Send

#: the items one ``send_batch`` may carry: one transaction (a step's burst to every rank of
#: a thousand is one call, as before the lane; Redis runs nothing else meanwhile)
MAX_BATCH: Final = 2048
#: the items that may wait before ``put`` blocks
MAX_QUEUED: Final = 65_536

Item = Send | Broadcast


@dataclass(frozen=True, slots=True)
class Refused:
    """An item the bus did not write, and why."""

    item: Item
    error: Exception


class SendLane:
    """One thread writing the core's control effects in the order they were put."""

    def __init__(
        self,
        bus: CoordinatorBus,
        *,
        max_batch: int = MAX_BATCH,
        max_queued: int = MAX_QUEUED,
        name: str = "flodl-coordinator-sender",
    ) -> None:
        if max_batch < 1 or max_queued < 1:
            raise ValueError("max_batch and max_queued must be at least 1")
        self._bus = bus
        self._batch: Callable[[Sequence[tuple[int | None, Any]]], object] | None = getattr(
            bus, "send_batch", None
        )
        #: a bus that times its writes (``bench scale``) is told when the oldest item of
        #: each write was put: its latency counts the wait in this queue too
        self._put_at: Callable[[float], None] | None = getattr(bus, "put_at", None)
        self._max_batch = max_batch
        self._max_queued = max_queued
        self._cond = threading.Condition()
        #: each item with when it was put (``time.monotonic``)
        self._todo: collections.deque[tuple[Item, float]] = collections.deque()
        self._refused: list[Refused] = []
        self._busy = False
        self._closed = False
        #: bus calls made, and the thread's seconds in them
        self.calls = 0
        self.busy_s = 0.0
        #: unicasts and broadcasts written (the loop's profile reads them at the end)
        self.sent = 0
        self.broadcasts = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, items: Sequence[Item]) -> None:
        """Queue ``items`` behind everything put before; blocks while the lane is full
        and its thread writes. A thread that died (a bug: every write's error is handed
        back) raises here rather than leave the loop waiting on it for ever."""
        if not items:
            return
        with self._cond:
            if self._closed:
                raise RuntimeError("SendLane.put after close")
            while True:
                if not self._thread.is_alive():
                    raise RuntimeError(
                        f"the coordinator's sender thread died with {self.pending} "
                        "control writes queued"
                    )
                if len(self._todo) < self._max_queued:
                    break
                # bounded: a thread that dies while we wait is seen at the next look
                self._cond.wait(1.0)
            at = time.monotonic()
            self._todo.extend((o, at) for o in items)
            self._cond.notify_all()

    def take(self) -> list[Refused]:
        """What was refused since the last call, in the order it was put."""
        if not self._refused:  # read without the lock: a miss is taken next turn
            return []
        with self._cond:
            out, self._refused = self._refused, []
        return out

    def drain(self, timeout: float) -> bool:
        """Wait until everything put has been tried; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._todo or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    @property
    def refused_waiting(self) -> bool:
        """Whether ``take`` has something to hand back."""
        return bool(self._refused)

    @property
    def pending(self) -> int:
        """Items put and not yet tried."""
        return len(self._todo) + (1 if self._busy else 0)

    def close(self, timeout: float = 30.0) -> bool:
        """Write what is queued, then stop the thread; False if it did not finish."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ----------------------------------------------------------------- thread

    def _next_run(self) -> list[Item] | None:
        with self._cond:
            todo = self._todo
            while not todo:
                if self._closed:
                    return None
                self._cond.wait()
            kind = type(todo[0][0])
            if self._put_at is not None:
                self._put_at(todo[0][1])
            run: list[Item] = []
            while todo and type(todo[0][0]) is kind and len(run) < self._max_batch:
                run.append(todo.popleft()[0])
            self._busy = True
            self._cond.notify_all()  # room for a blocked put
            return run

    def _run(self) -> None:
        while True:
            run = self._next_run()
            if run is None:
                return
            t0 = time.perf_counter()
            refused: list[Refused] = []
            written = False
            try:
                refused = self._write(run)
                written = True
            finally:
                if not written:
                    # Dying (a bug): the run goes back to the loop as refused, never lost
                    # in silence; the next put says the thread is gone.
                    why = RuntimeError("the coordinator's sender thread died writing it")
                    refused = [Refused(o, why) for o in run]
                self.busy_s += time.perf_counter() - t0
                with self._cond:
                    self._refused.extend(refused)
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, run: list[Item]) -> list[Refused]:
        if self._batch is not None:
            items = [(o.rank, o.msg) if isinstance(o, Send) else (None, o.msg) for o in run]
            self.calls += 1
            try:
                self._batch(items)
            except Exception as exc:
                # One transaction: none of it was written.
                return [Refused(o, exc) for o in run]
            self._count(run)
            return []
        refused: list[Refused] = []
        for o in run:
            self.calls += 1
            try:
                if isinstance(o, Send):
                    self._bus.send(o.rank, o.msg)
                else:
                    self._bus.broadcast(o.msg)
            except Exception as exc:
                refused.append(Refused(o, exc))
                continue
            self._count([o])
        return refused

    def _count(self, run: Sequence[Item]) -> None:
        if isinstance(run[0], Send):
            self.sent += len(run)
        else:
            self.broadcasts += len(run)
