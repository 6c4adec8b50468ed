"""Where a rank's runtime took its control over, for a rank bus whose reads are not
Redis's own (through a host agent, or a bus process of its own)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from flodl_bus.bus.api import Delivery
from flodl_bus.bus.ids import ZERO, EntryId, format_id, parse_id


class Applied:
    """The newest entry the runtime took over (``ack``) on the rank's own control
    stream ``ctl`` and on its broadcast stream ``bcast``: what its heartbeats say
    (``control_read``), so the coordinator trims those streams no further."""

    def __init__(self, ctl: str, bcast: str) -> None:
        self._ctl = ctl
        self._bcast = bcast
        self._ids: dict[str, EntryId] = {}
        self._lock = threading.Lock()

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        with self._lock:
            for d in deliveries:
                eid = parse_id(d.entry_id)
                if eid > self._ids.get(d.stream, ZERO):
                    self._ids[d.stream] = eid

    def control_read(self) -> tuple[str | None, str | None]:
        with self._lock:
            ctl, bcast = self._ids.get(self._ctl), self._ids.get(self._bcast)
        return (
            None if ctl is None else format_id(ctl),
            None if bcast is None else format_id(bcast),
        )


class AckedControl:
    """A ``RankBus``'s ack side, for a bus that reads its control somewhere else than
    Redis (its ``_applied`` set up by the bus)."""

    _applied: Applied

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        """The runtime took these over: the heartbeats say so (``control_read``)."""
        self._applied.ack(deliveries)

    def flush_acks(self) -> None:
        return

    def control_read(self) -> tuple[str | None, str | None]:
        return self._applied.control_read()
