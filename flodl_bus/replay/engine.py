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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import orjson

from flodl_bus.bus import entries as bus_entries
from flodl_bus.bus.api import Delivery
from flodl_bus.bus.entries import F_BODY, F_MAC, F_RANK, F_SEQ, F_TYPE
from flodl_bus.bus.ids import EntryId, parse_id
from flodl_bus.bus.keys import BROADCAST, RunKeys
from flodl_bus.protocol import signing, wire
from flodl_bus.record.dispatch import dumps
from flodl_bus.record.log import unjson
from flodl_bus.replay.load import Recording

#: Stands in for the run secret (never recorded): entries are re-signed with it.
#: replay re-signs what it feeds with fixed keys (no run secret is ever recorded)
REPLAY_KEYS = signing.fixed_keys(hashlib.sha256(b"flodl-bus replay: not a run secret").digest())

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


@dataclass(frozen=True)
class Divergence:
    index: int
    event: str
    where: str
    field: str
    expected: Any
    actual: Any

    def __str__(self) -> str:
        return (
            f"divergence at event i={self.index} ({self.event} {self.where}): {self.field}\n"
            f"  expected: {_short(self.expected, 2000)}\n"
            f"  actual:   {_short(self.actual, 2000)}"
        )


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


def _seed(
    client: fakeredis.FakeRedis,
    keys: RunKeys,
    inputs: Mapping[tuple[str, str], dict[str, Any]],
) -> None:
    """Write every input entry under its recorded id, stream by stream in id order."""
    by_stream: dict[str, list[tuple[EntryId, dict[str, Any]]]] = {}
    for (stream, raw_id), entry in inputs.items():
        by_stream.setdefault(stream, []).append((parse_id(raw_id), entry))
    for stream in by_stream:
        # every rank whose stream is replayed has its slot in the broadcasts' MAC vector
        owner = keys.rank_of(stream)
        if owner is not None:
            REPLAY_KEYS.rank(owner)
    for stream in sorted(by_stream):
        rank_field = BROADCAST if stream == keys.ctl_all else stream.rsplit(":", 1)[1]
        pipe = client.pipeline(transaction=False)
        signer: signing.Signer = (
            REPLAY_KEYS.broadcast if rank_field == BROADCAST else REPLAY_KEYS.rank(int(rank_field))
        )
        for seq, (eid, entry) in enumerate(sorted(by_stream[stream], key=lambda x: x[0]), 1):
            eid_s = f"{eid[0]}-{eid[1]}"
            fields = bus_entries.build(
                signer, stream, eid_s, _msg_of(entry["msg"]), rank_field, seq
            )
            corrupt = entry.get("corrupt")
            if corrupt == "mac":
                fields[F_MAC] = b"0" * len(fields[F_MAC])
            elif corrupt is not None:
                # Damaged but correctly signed, so the reader rejects it for the damage.
                if corrupt == "body":
                    fields[F_BODY] = b"\xc1" + fields[F_BODY][1:]
                else:
                    fields[F_TYPE] = str(corrupt).encode()
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
            pipe.xadd(stream, fields, id=eid_s)  # type: ignore[arg-type]
        pipe.execute()


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


def _drain(read: Any, tries: int = 3) -> list[Delivery]:
    """Everything the transport will deliver now (a cursor releases entries only after
    its first ``>`` read, so a few empty reads in a row mean the end)."""
    got: list[Delivery] = []
    empty = 0
    while empty < tries:
        batch = read(0)
        if batch:
            got.extend(batch)
            empty = 0
        else:
            empty += 1
    return got


# ------------------------------------------------------------------------ base


class _Replay:
    def __init__(self, rec: Recording, *, explore: bool) -> None:
        self.rec = rec
        self.explore = explore
        self.result = ReplayResult(rec.key)
        self.stopped = False
        self.client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
        run = rec.header.get("run") or "replay"
        self.keys = RunKeys(str(run))

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
        for f in fields:
            if f not in ev:
                continue  # the record did not keep it: nothing to hold the replay to
            exp, act = ev.get(f), norm(actual.get(f))
            if exp != act:
                self.diverge(ev, f, exp, act)
                return

    def dlq_reason(self, stream: str, eid: str) -> str | None:
        for d in _dead_letters(self.client, self.keys):
            if d["stream"] == stream and d["id"] == eid:
                return d["reason"]
        return None

    def missing(self, ev: Mapping[str, Any], nxt: Any) -> None:
        stream, eid = ev["stream"], ev["id"]
        reason = self.dlq_reason(stream, eid)
        actual = f"dead-lettered: {reason}" if reason else f"not delivered (next: {nxt})"
        self.diverge(ev, "entry", f"{stream} {eid}", actual)


def _ident(ev: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("event", "i", "stream", "id", "sender", "rank", "now", "synthetic")
    return {k: ev[k] for k in keys if k in ev}
