"""Trim each stream up to what every reader of it has consumed (DESIGN §3 rule 5).

``MAXLEN ~`` on every XADD only caps a stream; on its own it leaves each stream holding
up to the cap of entries every reader acknowledged long ago (16 MB per rank at the
default cap). The coordinator, the only role allowed to trim, runs a pass every few
seconds that removes what is consumed:

* A group **holds** a stream from its oldest pending entry (delivered, not acked) or, with
  nothing pending, from its last-delivered id. Nothing at or above the lowest hold is
  removed, so no reader loses an entry it had not acknowledged: a slow reader holds
  trimming back (up to the ``MAXLEN`` cap, as before).
* A **margin**: the stream keeps every entry above the top its writer had one pass ago
  (the top as the coordinator knows it: the last id it wrote, or the last upstream id it
  verified). The margin is in the stream's own ids, so a writer's clock skew cannot eat
  it; it leaves ``tail`` and a reader that reconnects at least one pass of entries, and it
  always keeps the newest entry that verifies, from which a restarted writer continues its
  seq (``stream_ops.last_seq``): a stream is never trimmed empty.
* A **gone** reader does not hold a stream for ever: a group that holds back trimming
  without moving for ``stale_s`` (far beyond every liveness timeout: a rank that read
  nothing for that long stopped itself, or was declared dead) is left out, with one
  ``bus_reader_stale`` line. If it comes back, what was trimmed under it is named, never
  silent: a pending entry trimmed away is dead-lettered (``entry was trimmed``), a seq gap
  is logged as ``bus_entries_missing``.

``Trimmer`` is the sans-IO rule (ids and the clock in, ``MINID`` per stream out);
``trim_pass`` asks Redis for the groups (XINFO GROUPS, XPENDING) and trims (XTRIM MINID ~,
whole radix-tree nodes only, so trimming never rewrites a node).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import redis
import structlog

from flodl_bus.bus.ids import ZERO, EntryId, format_id, parse_id

log = structlog.get_logger("flodl_bus.bus")

#: How often the coordinator trims (seconds); also the margin: one pass of entries.
DEFAULT_TRIM_INTERVAL_S: Final = 5.0
#: A group that holds trimming back without moving for this long is taken as gone.
DEFAULT_STALE_S: Final = 120.0


class GroupHold(NamedTuple):
    group: str
    #: the oldest id the group still needs (oldest pending, else last delivered)
    hold: EntryId


@dataclass
class _Held:
    hold: EntryId
    since: float
    stale: bool = False


class Trimmer:
    """Which ``MINID`` each stream may be trimmed to (sans-IO)."""

    def __init__(self, stale_s: float = DEFAULT_STALE_S) -> None:
        self.stale_s = stale_s
        self._margin: dict[str, EntryId] = {}
        self._held: dict[tuple[str, str], _Held] = {}

    def plan(
        self,
        now: float,
        tops: Mapping[str, EntryId],
        groups: Mapping[str, Sequence[GroupHold]],
    ) -> dict[str, EntryId]:
        """``tops``: each stream's newest verified id; ``groups``: its readers' holds.
        Returns the streams to trim and the id below which their entries may go."""
        out: dict[str, EntryId] = {}
        for stream in sorted(tops):
            top = tops[stream]
            margin = self._margin.get(stream)
            self._margin[stream] = top
            if margin is None or margin == ZERO:
                continue  # the first pass only learns where the stream stands
            minid = min(margin, top)
            for g in groups.get(stream, ()):
                if self._holds(now, stream, g, minid):
                    minid = min(minid, g.hold)
            if minid > ZERO:
                out[stream] = minid
        return out

    def _holds(self, now: float, stream: str, g: GroupHold, minid: EntryId) -> bool:
        key = (stream, g.group)
        if g.hold >= minid:
            self._held.pop(key, None)  # not behind: its clock starts when it falls behind
            return False
        held = self._held.get(key)
        if held is None or held.hold != g.hold:
            self._held[key] = _Held(g.hold, now)
            return True
        if now - held.since < self.stale_s:
            return True
        if not held.stale:
            held.stale = True
            log.warning(
                "bus_reader_stale",
                stream=stream,
                group=g.group,
                hold=format_id(g.hold),
                still_s=round(now - held.since, 1),
                reason="holds trimming back without reading; trimmed past it",
            )
        return False

    def forget(self, streams: Sequence[str]) -> None:
        for s in streams:
            self._margin.pop(s, None)
        gone = set(streams)
        for key in [k for k in self._held if k[0] in gone]:
            del self._held[key]


def _field(d: Mapping[Any, Any], name: str) -> Any:
    v = d.get(name)
    return d.get(name.encode()) if v is None else v


def read_holds(client: redis.Redis, streams: Sequence[str]) -> dict[str, list[GroupHold]]:
    """Every group of each stream and the oldest id it still needs (two pipelines)."""
    pipe = client.pipeline(transaction=False)
    for s in streams:
        pipe.xinfo_groups(s)
    infos = pipe.execute(raise_on_error=False)
    holds: dict[str, list[GroupHold]] = {}
    pending: list[tuple[str, str, EntryId]] = []
    for s, info in zip(streams, infos, strict=True):
        if isinstance(info, Exception):
            continue  # no such key yet: nothing to trim
        got = holds[s] = []
        for g in info:
            name = _field(g, "name")
            name = name.decode() if isinstance(name, bytes) else str(name)
            last = parse_id(_field(g, "last-delivered-id"))
            if int(_field(g, "pending") or 0) > 0:
                pending.append((s, name, last))
            else:
                got.append(GroupHold(name, last))
    if pending:
        pipe = client.pipeline(transaction=False)
        for s, name, _ in pending:
            pipe.xpending(s, name)
        for (s, name, last), summary in zip(
            pending, pipe.execute(raise_on_error=False), strict=True
        ):
            low = summary.get("min") if isinstance(summary, dict) else None
            # acked meanwhile: the last-delivered id is then the hold
            holds[s].append(GroupHold(name, parse_id(low) if low else last))
    return holds


def trim_pass(
    client: redis.Redis,
    trimmer: Trimmer,
    tops: Mapping[str, EntryId],
    now: float,
    extra: Mapping[str, Sequence[GroupHold]] | None = None,
) -> dict[str, EntryId]:
    """One pass over ``tops``' streams; returns what was trimmed to which MINID.
    ``extra``: holds of readers without a group (the ranks' control, from heartbeats)."""
    streams = sorted(tops)
    holds = read_holds(client, streams)
    for stream, more in (extra or {}).items():
        holds.setdefault(stream, []).extend(more)
    plan = trimmer.plan(now, tops, holds)
    if plan:
        pipe = client.pipeline(transaction=False)
        for s, minid in plan.items():
            pipe.xtrim(s, minid=format_id(minid), approximate=True)
        pipe.execute()
    return plan
