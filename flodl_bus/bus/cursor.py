"""Which ids a consumer-group reader asks for next, and which entries it may dispatch.

Sans-IO: the transport runs XREADGROUP with ``request()`` and feeds the reply to
``on_reply``; this core decides, so the rules below are unit-tested without Redis.

Rules:

- **Pending first.** A reader starts (and restarts after every lost connection) by
  re-reading its own pending entries (explicit ids: "entries delivered to me after id X"),
  then switches to ``>`` (never delivered). A lost XREADGROUP reply leaves entries in the
  pending list that the reader never saw; reading only ``>`` would lose them.
- **Only what verifies moves the reader.** Each new entry goes through the caller's
  ``check`` (authenticate, validate, decode) as it arrives; one that fails is released at
  once with its reason for the dlq and moves nothing. Anyone who can write a stream can
  put an entry far ahead of the real ones (up to the largest id): had it moved the last
  id, every real entry after it would look old.
- **Never twice.** The highest verified id per stream is kept. An entry at or below it is
  dropped while re-reading pending entries (it was dispatched, or is held back, already);
  in a ``>`` read Redis never hands out an entry twice, so there it can only be one put
  back under an old id (a stream deleted and refilled): it is released with the reason
  ``replayed``, for the dlq.
- **One order across streams** (``ordered=True``, the rank's ``ctl:<r>`` + ``ctl:all``):
  the coordinator numbers control entries from one increasing clock, so the send order is
  the id order. One XREADGROUP reads both streams atomically, but COUNT may cut a stream
  short: an entry is released only when no stream can still hide a smaller id, i.e. its id
  is at or below the last id returned by every stream that filled its COUNT. Pending reads
  say nothing about never-delivered entries, so nothing is released until the first ``>``
  read after them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from typing import Final, NamedTuple

from flodl_bus.bus.ids import ZERO, EntryId, format_id

_INFINITE: Final[EntryId] = (2**64, 0)


class Received(NamedTuple):
    """An entry as read. ``fields`` is None when it was trimmed while pending. Either
    ``rejected`` says why it goes to the dlq, or ``parsed`` is what ``check`` made of it."""

    stream: str
    entry_id: EntryId
    fields: Mapping[bytes, bytes] | None
    rejected: str | None = None
    parsed: object = None


#: ``check(stream, entry_id, fields)``: the parsed entry, or (a str) why it is refused
Check = Callable[[str, EntryId, "Mapping[bytes, bytes] | None"], object]
REPLAYED: Final = "replayed"


def _accept_all(stream: str, eid: EntryId, fields: Mapping[bytes, bytes] | None) -> object:
    return fields


Reply = Mapping[str, Sequence[tuple[EntryId, Mapping[bytes, bytes] | None]]]


class GroupCursor:
    """``grouped=False``: a plain XREAD reader (the rank's control, ``bus.reader``): it
    always asks for the entries after its last verified ids, and has no pending list to
    drain (a lost reply is simply read again)."""

    def __init__(
        self, streams: Sequence[str], *, count: int, ordered: bool, grouped: bool = True
    ) -> None:
        if count < 1:
            raise ValueError("count must be >= 1")
        self.streams: list[str] = list(streams)
        self.count = count
        self.ordered = ordered
        self.grouped = grouped
        self._last: dict[str, EntryId] = dict.fromkeys(self.streams, ZERO)
        self._pending = grouped
        self._heap: list[tuple[EntryId, str, Received]] = []
        #: the last reply gave some stream all the entries asked for (more may wait)
        self._filled = False

    def add_stream(self, stream: str) -> None:
        if stream in self._last:
            return
        self.streams.append(stream)
        self._last[stream] = ZERO
        self._pending = self.grouped

    @property
    def draining_pending(self) -> bool:
        return self._pending

    @property
    def behind(self) -> bool:
        """Entries may be waiting that the last read did not hand on: it filled some
        stream's count, or entries are held back, or the pending list is not drained.
        A reader behind its streams cannot tell a silent writer from one it has not
        reached (the coordinator's liveness asks this)."""
        return self._filled or self._pending or bool(self._heap)

    @property
    def can_block(self) -> bool:
        """Only a ``>`` read with nothing held back may wait for new entries."""
        return not self._pending and not self._heap

    def last_id(self, stream: str) -> EntryId:
        return self._last[stream]

    def positions(self) -> dict[str, EntryId]:
        """Every stream's last id (a copy)."""
        return dict(self._last)

    def request(self) -> dict[str, str]:
        if self._pending or not self.grouped:
            return {s: format_id(self._last[s]) for s in self.streams}
        return dict.fromkeys(self.streams, ">")

    def on_lost(self) -> None:
        self._pending = self.grouped

    def skip(self, stream: str, eid: EntryId) -> None:
        """Move past a refused entry (an XREAD reader, which has no group to ack it
        away: it would read it again for ever). The caller decides which may be passed:
        never one beyond any id the run writes (see the module's rules)."""
        if eid > self._last.get(stream, eid):
            self._last[stream] = eid

    def on_reply(self, reply: Reply, check: Check = _accept_all) -> list[Received]:
        """Entries now safe to dispatch, in dispatch order; refused ones first."""
        fresh: list[Received] = []
        refused: list[Received] = []
        frontier = _INFINITE
        filled = False
        pending = self._pending
        for stream, entries in reply.items():
            last = self._last.get(stream)
            if last is None:
                continue  # not ours (cannot happen with our own request)
            for eid, fields in entries:
                if eid <= last:
                    if not pending:
                        why = f"{REPLAYED}: entry id {format_id(eid)} at or below {format_id(last)}"
                        refused.append(Received(stream, eid, fields, why))
                    continue  # redelivered: already dispatched or held back
                got = check(stream, eid, fields)
                if isinstance(got, str):
                    refused.append(Received(stream, eid, fields, got))
                    continue
                last = eid
                fresh.append(Received(stream, eid, fields, None, got))
            self._last[stream] = last
            if len(entries) >= self.count:
                filled = True
                if entries:
                    frontier = min(frontier, entries[-1][0])
        was_pending = self._pending
        # A read of the pending list says nothing of the entries never delivered: until
        # a read of new ones, more may wait.
        self._filled = filled or was_pending
        if was_pending and not filled:
            self._pending = False
        if not self.ordered:
            return refused + fresh
        for r in fresh:
            heapq.heappush(self._heap, (r.entry_id, r.stream, r))
        if was_pending:
            return refused
        out: list[Received] = refused
        while self._heap and self._heap[0][0] <= frontier:
            out.append(heapq.heappop(self._heap)[2])
        return out
