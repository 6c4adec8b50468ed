"""Stream entry ids, and the clock that hands out explicit ones.

Every entry the bus writes carries an explicit id ``<ms>-<n>`` chosen before the first
attempt. Redis refuses an id at or below a stream's top, which gives two guarantees at
once: a retried XADD whose first reply was lost cannot create a duplicate (the retry is
refused, and the refusal proves the first attempt landed), and one clock shared by
``ctl:<r>`` and ``ctl:all`` makes the id order the coordinator's send order.
"""

from __future__ import annotations

from typing import Final

EntryId = tuple[int, int]
ZERO: Final[EntryId] = (0, 0)
_SEQ_LIMIT: Final = 2**64


def parse_id(raw: bytes | str) -> EntryId:
    # int() takes ASCII bytes as they come from Redis: no decode per entry on ingest.
    if isinstance(raw, bytes):
        ms_b, _, seq_b = raw.partition(b"-")
        return (int(ms_b), int(seq_b or 0))
    ms, _, seq = raw.partition("-")
    return (int(ms), int(seq or 0))


def format_id(eid: EntryId) -> str:
    return f"{eid[0]}-{eid[1]}"


class IdClock:
    """Strictly increasing ids that follow the wall clock (ms) where it allows.

    Sans-IO: the caller passes ``now_ms``. A clock that steps back never makes ids go
    back; ``raise_floor`` lifts the next id above a stream top found in Redis (a previous
    incarnation of the writer, or a clock that was ahead then).
    """

    def __init__(self, floor: EntryId = ZERO) -> None:
        self._last = floor

    @property
    def last(self) -> EntryId:
        return self._last

    def raise_floor(self, floor: EntryId) -> None:
        if floor > self._last:
            self._last = floor

    def next(self, now_ms: int) -> EntryId:
        ms, seq = self._last
        if now_ms > ms:
            nxt = (now_ms, 0)
        elif seq + 1 < _SEQ_LIMIT:
            nxt = (ms, seq + 1)
        else:
            nxt = (ms + 1, 0)
        self._last = nxt
        return nxt
