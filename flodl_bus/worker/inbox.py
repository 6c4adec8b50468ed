"""The rank's local control queue: the reader thread puts, the training thread takes.

Between batches the training thread only polls, so the empty case must cost well under a
microsecond: ``poll`` reads the deque without taking the lock (``len`` and ``popleft``
on a deque are atomic under the GIL and there is one consumer). Blocking waits use the
condition. ``close`` is how a dead reader wakes a training thread that would otherwise
wait for a message that can never come.

Each message may carry its ``Origin`` (the stream and entry id it was read from; None for
one injected in process, like the param plane's ``Update``). ``last_origin`` is the
origin of the message the consumer took last, so the recorder can name where a dispatched
message came from; there is one consumer, so it is never another thread's.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final, final

from flodl_bus.protocol.messages import ControlMsg

#: (stream key, entry id) a message was read from.
Origin = tuple[str, str]


@final
class Closed:
    __slots__ = ()

    def __repr__(self) -> str:
        return "CLOSED"


#: Returned by ``Inbox.get`` once the inbox is closed and drained.
CLOSED: Final = Closed()


class Inbox:
    def __init__(self) -> None:
        # (message, origin) pairs: one deque append/popleft keeps the pair atomic.
        self._items: deque[tuple[ControlMsg, Origin | None]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        #: origin of the message most recently returned by ``poll``/``get``
        self.last_origin: Origin | None = None
        #: called (on the consumer's thread) before ``get`` blocks on an empty inbox: the
        #: rank's publisher writes what it holds back (``bus.publisher``'s ``hurry``), so
        #: a report the coordinator must answer never lingers while the rank waits
        self.before_wait: Callable[[], None] | None = None
        #: called (on the consumer's thread) when ``poll`` finds the inbox empty: a rank
        #: whose training thread takes its control itself (``worker.runtime``) looks for
        #: more there, without waiting
        self.before_poll: Callable[[], None] | None = None

    def put(self, msg: ControlMsg, origin: Origin | None = None) -> None:
        with self._cond:
            if self._closed:
                return
            self._items.append((msg, origin))
            self._cond.notify()

    def put_many(
        self, msgs: list[ControlMsg], origins: Sequence[Origin | None] | None = None
    ) -> None:
        """Queue ``msgs`` at once: the consumer never sees part of one read."""
        if not msgs:
            return
        pairs = list(zip(msgs, origins)) if origins is not None else [(m, None) for m in msgs]
        with self._cond:
            if self._closed:
                return
            self._items.extend(pairs)
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
            if self.before_poll is None:
                return None
            self.before_poll()
            if not items:
                return None
        msg, self.last_origin = items.popleft()
        return msg

    def get(self, timeout: float | None = None) -> ControlMsg | Closed | None:
        """Block for the next message; CLOSED once closed and drained; None on timeout."""
        if not self._items and self.before_wait is not None:
            self.before_wait()
        with self._cond:
            if not self._cond.wait_for(lambda: self._items or self._closed, timeout):
                return None
            if self._items:
                msg, self.last_origin = self._items.popleft()
                return msg
            return CLOSED

    def __len__(self) -> int:
        return len(self._items)
