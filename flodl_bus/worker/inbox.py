"""The rank's local control queue: the reader thread puts, the training thread takes.

Between batches the training thread only polls, so the empty case must cost well under a
microsecond: ``poll`` reads the deque without taking the lock (``len`` and ``popleft``
on a deque are atomic under the GIL and there is one consumer). Blocking waits use the
condition. ``close`` is how a dead reader wakes a training thread that would otherwise
wait for a message that can never come.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Final, final

from flodl_bus.protocol.messages import ControlMsg


@final
class Closed:
    __slots__ = ()

    def __repr__(self) -> str:
        return "CLOSED"


#: Returned by ``Inbox.get`` once the inbox is closed and drained.
CLOSED: Final = Closed()


class Inbox:
    def __init__(self) -> None:
        self._items: deque[ControlMsg] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, msg: ControlMsg) -> None:
        with self._cond:
            if self._closed:
                return
            self._items.append(msg)
            self._cond.notify()

    def put_many(self, msgs: list[ControlMsg]) -> None:
        """Queue ``msgs`` at once: the consumer never sees part of one read."""
        if not msgs:
            return
        with self._cond:
            if self._closed:
                return
            self._items.extend(msgs)
            self._cond.notify()

    def close(self) -> None:
        """No more messages will come; queued ones are still delivered first."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def poll(self) -> ControlMsg | None:
        """The next message if one is queued, else None. Never blocks."""
        items = self._items
        if not items:
            return None
        return items.popleft()

    def get(self, timeout: float | None = None) -> ControlMsg | Closed | None:
        """Block for the next message; CLOSED once closed and drained; None on timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items or self._closed, timeout):
                return None
            if self._items:
                return self._items.popleft()
            return CLOSED

    def __len__(self) -> int:
        return len(self._items)
