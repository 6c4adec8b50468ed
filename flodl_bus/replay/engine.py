"""The replay engine: what a replay of one process does, its results and its transport.

A recorded run is re-fed to FRESH cores through the same transport code it ran on:

1. every entry the process read is written into fakeredis streams under its recorded id
   (re-signed with a replay key: the run's secret is never recorded);
2. the process's own bus class (``RedisRankBus`` / ``RedisCoordinatorBus``) reads them
   back on a fakeredis client, with its cursor, ordering, authentication and dead-letter
   rules; a rank's deliveries go through the rank runtime's own router into its inbox;
3. the recorded core calls are walked in order (``i``): each consumes the entry the record
   says it consumed, drives the core, and compares the state before, every port call,
   everything emitted and the state after with the record. Ports, the clock and training
   steps are answered from the record (``replay.ports``), so no model is needed.

With ``transport="direct"`` steps 1-2 shrink to the bus's entry code alone: each entry is
built and signed, then checked (fields, sizes, seq, MAC) and decoded by
``bus.entries.parse`` as the reader does, without the fakeredis streams (groups, cursors)
around it, which cost most of a replay's time. Entries are fed a window at a time
(``WINDOW`` events ahead) and trimmed once delivered, so memory stays bounded.

Exit status 0 with ``identical (N dispatches)``, or 1 with the first divergence: the
event's index, the entry, the field, expected vs actual. Nothing here reads a clock or a
random source, so a replay prints the same thing every time.

``explore=True`` (the surgery helpers' mode) does not stop at the first divergence: an
entry the record never consumed is dispatched where it appears (as the loop would between
batches), an entry the transport no longer delivers (dropped, dead-lettered) is skipped,
and synthetic ticks are run; ``ReplayResult.actual`` is the new record.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import orjson

from flodl_bus.bus import entries as bus_entries
from flodl_bus.bus.api import Delivery
from flodl_bus.bus.entries import F_BODY, F_MAC, F_RANK, F_SEQ, F_TYPE
from flodl_bus.bus.ids import EntryId, parse_id
from flodl_bus.bus.keys import BROADCAST, RunKeys
from flodl_bus.bus.stream_ops import StreamsConfig
from flodl_bus.protocol import signing, wire
from flodl_bus.record.dispatch import dumps
from flodl_bus.record.log import unjson
from flodl_bus.replay.load import Recording

#: Stands in for the run secret (never recorded): entries are re-signed with it.
#: replay re-signs what it feeds with fixed keys (no run secret is ever recorded)
REPLAY_KEYS = signing.fixed_keys(hashlib.sha256(b"flodl-bus replay: not a run secret").digest())
#: The replay's buses: what they write (the coordinator's sends) is trimmed short, so the
#: streams stay small whatever the record's length.
REPLAY_STREAMS = StreamsConfig(maxlen=1000)

# ------------------------------------------------------------------------ results


def norm(value: Any) -> Any:
    """The JSON form of a value as a record holds it (tuples -> lists, NaN -> null)."""
    return orjson.loads(dumps(value))


def brief(msg: Any) -> str:
    """``StartEpoch(plan={...})`` from a recorded wire map."""
    if not isinstance(msg, dict) or "type" not in msg:
        return _short(msg)
    body = ", ".join(f"{k}={_short(v)}" for k, v in msg.items() if k not in ("v", "type", "local"))
    return f"{msg['type']}({body})"


def _short(value: Any, limit: int = 160) -> str:
    text = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS, default=str).decode()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _paths(expected: Any, actual: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Where two JSON values differ: (dotted key path, recorded, replayed), the deepest
    differing keys of dicts and of lists of equal length."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        out: list[tuple[str, Any, Any]] = []
        for k in [*expected, *(k for k in actual if k not in expected)]:
            e, a = expected.get(k, _ABSENT), actual.get(k, _ABSENT)
            if e != a:
                out += _paths(e, a, f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        out = []
        for k, (e, a) in enumerate(zip(expected, actual)):
            if e != a:
                out += _paths(e, a, f"{prefix}[{k}]")
        return out
    return [(prefix, expected, actual)]


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT: Any = _Absent()


def _value(v: Any, limit: int) -> str:
    return "(absent)" if v is _ABSENT else _short(v, limit)


@dataclass(frozen=True)
class Divergence:
    index: int
    event: str
    where: str
    field: str
    expected: Any
    actual: Any

    def changes(self) -> list[tuple[str, Any, Any]]:
        """The changed keys under ``field``: (path, recorded, replayed)."""
        return _paths(self.expected, self.actual, self.field)

    def __str__(self) -> str:
        head = f"divergence at event i={self.index} ({self.event} {self.where}): {self.field}"
        changes = self.changes()
        lines = [head]
        for path, e, a in changes[:12]:
            lines.append(f"  {path}: recorded {_value(e, 300)}, replayed {_value(a, 300)}")
        if len(changes) > 12:
            lines.append(f"  ... and {len(changes) - 12} more changed keys")
        lines.append(f"  expected: {_short(self.expected, 2000)}")
        lines.append(f"  actual:   {_short(self.actual, 2000)}")
        return "\n".join(lines)


@dataclass
class ReplayResult:
    key: str
    replayed: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    #: the replay's own record of what the fresh core did (same schema)
    actual: list[dict[str, Any]] = field(default_factory=list)
    #: entries the transport dead-lettered: stream, entry id, reason
    dead_letters: list[dict[str, str]] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.divergences

    def summary(self) -> str:
        if self.identical:
            return f"identical ({self.replayed} dispatches)"
        return str(self.divergences[0])


def _where(ev: Mapping[str, Any]) -> str:
    msg = ev.get("msg")
    what = brief(msg) if msg is not None else ""
    if ev.get("stream"):
        return f"of {what} from {ev['stream']} id {ev['id']}"
    if ev.get("event") in ("tick", "start"):
        return f"at now={ev.get('now')}"
    return f"of {what}" if what else ""


# ------------------------------------------------------------------------ transport


def _msg_of(data: Any) -> Any:
    return wire.from_map(unjson(data))


class Feeder:
    """Writes recorded entries into the replay's fakeredis streams, a batch at a time, as
    the replay reaches them: under their recorded ids, re-signed with ``REPLAY_KEYS``,
    each stream's ``seq`` going on from batch to batch. Entries already consumed are
    trimmed away, so the streams hold a window of the record, not all of it."""

    def __init__(self, client: fakeredis.FakeRedis, keys: RunKeys) -> None:
        self.client = client
        self.keys = keys
        self.last: dict[str, EntryId] = {}
        self.seq: dict[str, int] = {}
        self.fed = 0

    def pipeline(self) -> Any:
        return self.client.pipeline(transaction=False)

    def has(self, stream: str, raw_id: str) -> bool:
        last = self.last.get(stream)
        return last is not None and parse_id(raw_id) <= last

    def feed(self, entries: Sequence[Mapping[str, Any]]) -> int:
        """Write the entries not written yet, stream by stream in id order; how many."""
        by_stream: dict[str, dict[EntryId, Mapping[str, Any]]] = {}
        for entry in entries:
            stream = entry["stream"]
            eid = parse_id(entry["id"])
            last = self.last.get(stream)
            if last is not None and eid <= last:
                continue  # already in the stream (a rank's dispatch of an entry it read)
            # the first mention wins: a rank's read, then its dispatch of the same entry
            by_stream.setdefault(stream, {}).setdefault(eid, entry)
        if not by_stream:
            return 0
        pipe = self.pipeline()
        n = 0
        for stream in sorted(by_stream):
            rank_field = BROADCAST if stream in self.keys.broadcasts else stream.rsplit(":", 1)[1]
            owner = self.keys.rank_of(stream)
            if owner is not None:
                REPLAY_KEYS.rank(owner)
            signer: signing.Signer = (
                REPLAY_KEYS.broadcast
                if rank_field == BROADCAST
                else REPLAY_KEYS.rank(int(rank_field))
            )
            seq = self.seq.get(stream, 0)
            got = sorted(by_stream[stream].items(), key=lambda x: x[0])
            for eid, entry in got:
                seq += 1
                eid_s = f"{eid[0]}-{eid[1]}"
                fields = bus_entries.build(
                    signer, stream, eid_s, _msg_of(entry["msg"]), rank_field, seq
                )
                corrupt = entry.get("corrupt")
                if corrupt is not None:
                    _corrupt(fields, corrupt, signer, stream, eid_s)
                self.put(pipe, stream, eid, eid_s, rank_field, fields)
                n += 1
            self.seq[stream] = seq
            self.last[stream] = got[-1][0]
        self.done(pipe)
        self.fed += n
        return n

    def put(
        self,
        pipe: Any,
        stream: str,
        eid: EntryId,
        eid_s: str,
        rank_field: str,
        fields: dict[bytes, bytes],
    ) -> None:
        pipe.xadd(stream, fields, id=eid_s)

    def done(self, pipe: Any) -> None:
        pipe.execute()

    def trim(self, upto: Mapping[str, str]) -> None:
        """Drop every entry below ``upto[stream]`` (delivered and acked ones)."""
        if not upto:
            return
        pipe = self.client.pipeline(transaction=False)
        for stream, eid in upto.items():
            pipe.xtrim(stream, minid=eid, approximate=False)
        pipe.execute()


def _corrupt(
    fields: dict[bytes, bytes], how: str, signer: signing.Signer, stream: str, eid_s: str
) -> None:
    if how == "mac":
        fields[F_MAC] = b"0" * len(fields[F_MAC])
        return
    # Damaged but correctly signed, so the reader rejects it for the damage.
    if how == "body":
        fields[F_BODY] = b"\xc1" + fields[F_BODY][1:]
    else:
        fields[F_TYPE] = str(how).encode()
    fields[F_MAC] = signer.sign(
        signing.signed_bytes(
            stream.encode(),
            eid_s.encode(),
            fields[F_TYPE],
            fields[F_RANK],
            fields[F_SEQ],
            fields[F_BODY],
        )
    )


class DirectFeeder(Feeder):
    """The ``direct`` transport: each entry is built, signed, then checked and decoded by
    the bus's own entry code (``bus.entries.parse``: fields, sizes, seq, MAC, message) as
    its reader does, without the Redis emulation around it (consumer groups, cursors:
    fakeredis costs most of a replay's time). Entries come out in id order; a rejected
    one goes to ``dead`` with the reason the reader would give."""

    def __init__(
        self,
        client: fakeredis.FakeRedis,
        keys: RunKeys,
        verifiers: Mapping[str, signing.Verifier],
        channel: str,
    ) -> None:
        super().__init__(client, keys)
        self.verifiers = verifiers
        self.channel = channel
        self.ready: list[tuple[EntryId, Delivery]] = []
        self.dead: list[dict[str, str]] = []
        #: the highest seq accepted per stream (the reader's replay check)
        self.accepted: dict[str, int] = {}

    def pipeline(self) -> Any:
        return None

    def put(
        self,
        pipe: Any,
        stream: str,
        eid: EntryId,
        eid_s: str,
        rank_field: str,
        fields: dict[bytes, bytes],
    ) -> None:
        parsed = bus_entries.parse(
            self.verifiers[stream],
            stream,
            eid_s.encode(),
            fields,
            channel=self.channel,
            rank=rank_field,
            last_seq=self.accepted.get(stream, 0),
        )
        if isinstance(parsed, str):
            self.dead.append({"stream": stream, "id": eid_s, "reason": parsed})
            return
        self.accepted[stream] = parsed.seq
        self.ready.append((eid, Delivery(stream, eid_s, parsed.msg)))

    def done(self, pipe: Any) -> None:
        return None

    def take(self) -> list[Delivery]:
        """What the last feeds delivered, in id order across streams (as the rank's
        ordered reader merges its unicast and broadcast streams)."""
        got = [d for _, d in sorted(self.ready, key=lambda x: x[0])]
        self.ready = []
        return got

    def trim(self, upto: Mapping[str, str]) -> None:
        return None


def _dead_letters(client: fakeredis.FakeRedis, keys: RunKeys) -> list[dict[str, str]]:
    out = []
    found: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(keys.dlq)  # type: ignore[assignment]
    for _eid, f in found:
        out.append(
            {
                "stream": f[b"stream"].decode(),
                "id": f[b"entry"].decode(),
                "reason": f[b"reason"].decode(),
            }
        )
    return out


def _drain(read: Any, want: int, dlq_len: Any, tries: int = 3) -> list[Delivery]:
    """What the transport delivers of ``want`` entries just written: read until each was
    delivered or dead-lettered, or a few empty reads in a row (a cursor releases entries
    only after its first ``>`` read)."""
    got: list[Delivery] = []
    dlq0 = dlq_len()
    empty = 0
    while empty < tries:
        batch = read(0)
        if batch:
            got.extend(batch)
            empty = 0
            if len(got) >= want:
                break
        else:
            if len(got) + dlq_len() - dlq0 >= want:
                break
            empty += 1
    return got


#: ``fakeredis``: entries go through the process's own bus class over fakeredis streams
#: (groups, cursors, ordering, dead letters); ``direct``: through the bus's entry code
#: only (signing, checks, decoding), several times faster
TRANSPORTS = ("fakeredis", "direct")

#: events read ahead of the one being replayed; their entries are written to the streams
#: together (one pipeline, a few reads) instead of one by one
WINDOW = 512


# ------------------------------------------------------------------------ base


class _Replay:
    def __init__(
        self,
        rec: Recording,
        *,
        explore: bool,
        keep_actual: bool = True,
        allow_incomplete: bool = True,
        transport: str = "direct",
    ) -> None:
        self.rec = rec
        self.explore = explore
        #: keep the replay's own record in ``result.actual`` (tools, tests); a replay that
        #: only wants the verdict keeps nothing and runs in bounded memory
        self.keep_actual = keep_actual or explore
        self.allow_incomplete = allow_incomplete
        self.result = ReplayResult(rec.key)
        self.stopped = False
        self.client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
        run = rec.header.get("run") or "replay"
        # a run on a Redis Cluster names its shards (its streams' tags) in the header
        self.keys = RunKeys(str(run), tuple(int(n) for n in rec.header.get("shards") or ()))
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: one of {', '.join(TRANSPORTS)}")
        self.transport = transport
        self.feeder: Feeder = Feeder(self.client, self.keys)
        self.last_event: Mapping[str, Any] | None = None

    def use_direct(self, verifiers: Mapping[str, signing.Verifier], channel: str) -> None:
        """Switch to the ``direct`` transport (the subclass knows its streams' keys)."""
        self.feeder = DirectFeeder(self.client, self.keys, verifiers, channel)

    def delivered(self, n: int, read: Any) -> list[Delivery]:
        """What the transport delivers of the ``n`` entries just fed."""
        if isinstance(self.feeder, DirectFeeder):
            return self.feeder.take()
        return _drain(read, n, self.dlq_len)

    def dead_letters(self) -> list[dict[str, str]]:
        if isinstance(self.feeder, DirectFeeder):
            return list(self.feeder.dead)
        return _dead_letters(self.client, self.keys)

    def windowed(self, events: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """``events`` in order; before an event is handed out, the entries of the next
        ``WINDOW`` events have been written and handed to ``deliver``."""
        window: deque[dict[str, Any]] = deque()
        exhausted = False
        while True:
            if not exhausted and len(window) <= WINDOW // 2:
                batch: list[Mapping[str, Any]] = []
                while len(window) < WINDOW:
                    ev = next(events, None)
                    if ev is None:
                        exhausted = True
                        break
                    window.append(ev)
                    batch += self.inputs_of(ev)
                if batch:
                    n = self.feeder.feed(batch)
                    if n:
                        self.deliver(n)
            if not window:
                return
            yield window.popleft()

    def inputs_of(self, ev: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        raise NotImplementedError

    def deliver(self, n: int) -> None:
        raise NotImplementedError

    def dlq_len(self) -> int:
        return int(self.client.xlen(self.keys.dlq))

    def keep(self, ev: Mapping[str, Any], actual: Mapping[str, Any]) -> None:
        if self.keep_actual:
            self.result.actual.append({**_ident(ev), **actual})

    def diverge(self, ev: Mapping[str, Any], what: str, expected: Any, actual: Any) -> None:
        self.result.divergences.append(
            Divergence(
                int(ev.get("i", -1)), str(ev.get("event")), _where(ev), what, expected, actual
            )
        )
        if not self.explore:
            self.stopped = True

    def compare(
        self, ev: Mapping[str, Any], actual: Mapping[str, Any], fields: Sequence[str]
    ) -> None:
        if ev.get("synthetic"):
            return
        # ``actual`` holds JSON forms already (``norm``), as the record does
        for f in fields:
            if f not in ev:
                continue  # the record did not keep it: nothing to hold the replay to
            exp, act = ev.get(f), actual.get(f)
            if exp != act:
                self.diverge(ev, f, exp, act)
                return

    def dlq_reason(self, stream: str, eid: str) -> str | None:
        for d in self.dead_letters():
            if d["stream"] == stream and d["id"] == eid:
                return d["reason"]
        return None

    def missing(self, ev: Mapping[str, Any], nxt: Any) -> None:
        stream, eid = ev["stream"], ev["id"]
        reason = self.dlq_reason(stream, eid)
        actual = f"dead-lettered: {reason}" if reason else f"not delivered (next: {nxt})"
        self.diverge(ev, "entry", f"{stream} {eid}", actual)


def _ident(ev: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("event", "i", "stream", "id", "sender", "rank", "now", "behind", "synthetic", "extra")
    return {k: ev[k] for k in keys if k in ev}
