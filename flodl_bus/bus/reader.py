"""The group reader: XREADGROUP over some streams through a ``GroupCursor``.

How it keeps DESIGN §3:

1. Per-rank order: a rank reads ``ctl:<r>`` and ``ctl:all`` in ONE XREADGROUP (atomic on
   the server) and ``GroupCursor`` releases them in id order.
3. No loss, no duplicates: consumer groups with XACK after dispatch (acks ride on the next
   read); pending entries are re-read first after every start and every lost connection;
   ``GroupCursor`` drops redeliveries.
5. A pending entry trimmed away is dead-lettered with that reason, never silently dropped.
7. Bad input: ``entries.parse`` names the reason; the entry goes to ``dlq`` with it, is
   acked, is logged as one structured error, and reading goes on.
8. Authentication: every entry's MAC (rank key, or a broadcast's per-rank MAC vector or
   Ed25519 signature; ``protocol.signing``) covers the stream, the entry id and the
   writer's seq; a reader is moved only by entries that verify.
9. Replay protection: a seq at or below the last one accepted on a stream is ``replayed``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import redis

from flodl_bus.bus import entries
from flodl_bus.bus.api import Delivery
from flodl_bus.bus.connection import BusClosed, BusUnavailable, Link
from flodl_bus.bus.cursor import Check, GroupCursor, Received
from flodl_bus.bus.fold import Item, Unpacked, good_items, unfold_into
from flodl_bus.bus.foreign import writer_limit
from flodl_bus.bus.ids import ZERO, EntryId, format_id, parse_id
from flodl_bus.bus.lane import Lane, pack
from flodl_bus.bus.stream_ops import (
    StreamsConfig,
    _now_ms,
    ensure_group,
    log,
    read_count_for,
)
from flodl_bus.protocol.signing import Verifier

#: how long a dead-letter write may wait for Redis before the read goes on without it
DLQ_DEADLINE_S: Final = 2.0


def _raw_reply(response: Any, **_options: Any) -> Any:
    return response


def _entries_of(raw: Any) -> dict[str, list[tuple[EntryId, Any]]]:
    """A raw XREAD/XREADGROUP reply as stream -> [(id, fields)]. RESP2:
    ``[[stream, [[id, [k, v, ...] or nil], ...]], ...]``; RESP3: ``{stream: [...]}``.
    Nil fields: a pending entry that was trimmed away (``entries.parse`` rejects it)."""
    reply: dict[str, list[tuple[EntryId, Any]]] = {}
    for name, items in raw.items() if isinstance(raw, dict) else raw or ():
        got = reply[name.decode()] = []
        for eid, flat in items:
            it = iter(flat or ())
            got.append((parse_id(eid), dict(zip(it, it)) if flat else None))
    return reply


class _GroupReader:
    """XREADGROUP over some streams through a ``GroupCursor``, acks piggybacked on reads."""

    def __init__(
        self,
        client: redis.Redis,
        streams: Sequence[str],
        *,
        group: str,
        consumer: str,
        ordered: bool,
        config: StreamsConfig,
        name: str,
        where: str,
        dlq: str,
    ) -> None:
        self.client = client
        self.group = group
        self.consumer = consumer
        self.config = config
        self.dlq = dlq
        self.name = name
        self.cursor = GroupCursor(
            streams, count=read_count_for(config, len(streams)), ordered=ordered
        )
        # Reads go through a kept connection of the same pool (``bus.lane``), whose
        # XREADGROUP replies stay raw: redis-py's reply callback builds a list and a dict
        # per entry in Python, a tenth of the coordinator's whole ingest time; the loop
        # in ``read`` does the same in one pass. Only the reading thread uses it.
        self._lane = Lane(client)
        self.link = Link(
            client, name=name, where=where, backoff=config.backoff, on_lost=self._on_lost
        )
        self._groups: set[str] = set()
        self._acks: dict[str, list[str]] = {}
        self._ack_lock = threading.Lock()
        #: the highest seq accepted per stream (a lower or equal one is a replay)
        self.seqs: dict[str, int] = {}
        #: streams where a foreign entry beyond the horizon was seen since the last look
        self.foreign: set[str] = set()
        #: host agents' fold streams -> their unpacker (``bus.fold``, set by the
        #: coordinator's bus): each entry carries items of several ranks
        self.folds: dict[str, Check] = {}

    def _on_lost(self) -> None:
        self.cursor.on_lost()
        # A server restarted without persistence lost the groups too.
        self._groups.clear()

    def add_stream(self, stream: str) -> None:
        self.cursor.add_stream(stream)
        self.cursor.count = read_count_for(self.config, len(self.cursor.streams))

    def queue_acks(self, deliveries: Sequence[Delivery]) -> None:
        with self._ack_lock:
            for d in deliveries:
                self._acks.setdefault(d.stream, []).append(d.entry_id)

    def queue_ack_ids(self, acks: Mapping[str, Sequence[str]]) -> None:
        """Like ``queue_acks``, for ids dispatched elsewhere (``bus.ingest``)."""
        with self._ack_lock:
            for stream, ids in acks.items():
                self._acks.setdefault(stream, []).extend(ids)

    def _take_acks(self) -> dict[str, list[str]]:
        with self._ack_lock:
            acks, self._acks = self._acks, {}
        return acks

    def _restore_acks(self, acks: dict[str, list[str]]) -> None:
        with self._ack_lock:
            for stream, ids in acks.items():
                self._acks.setdefault(stream, [])[:0] = ids

    def _ensure_groups(self) -> None:
        for stream in self.cursor.streams:
            if stream not in self._groups:
                # A group recreated after it vanished starts where this reader is, not
                # at the stream's start: everything below was dispatched already, and
                # handing it out again would only fill the dlq with replays.
                last = self.cursor.last_id(stream)
                ensure_group(
                    self.client, stream, self.group, "0" if last == ZERO else format_id(last)
                )
                self._groups.add(stream)

    def flush_acks(self, timeout: float = 2.0) -> None:
        acks = self._take_acks()
        if not acks:
            return

        def op(retry: bool) -> None:
            pipe = self.client.pipeline(transaction=False)
            for stream, ids in acks.items():
                pipe.xack(stream, self.group, *ids)
            pipe.execute()

        try:
            self.link.call(op, deadline=time.monotonic() + timeout)
        except (BusUnavailable, BusClosed):
            self._restore_acks(acks)
            raise

    def read(self, block_ms: int, check: Check | None = None) -> list[Received]:
        if not self.cursor.streams:
            time.sleep(max(0, block_ms) / 1000)
            return []
        block = min(block_ms, self.config.max_block_ms)
        acks = self._take_acks()

        def op(retry: bool) -> Any:
            self._ensure_groups()
            req = self.cursor.request()
            head: tuple[Any, ...] = ("XREADGROUP", "GROUP", self.group, self.consumer)
            head += ("COUNT", self.cursor.count)
            if block > 0 and self.cursor.can_block:
                head += ("BLOCK", block)
            # Packed here (``bus.lane``): redis-py's pipeline packed every acked id
            # through its encoder, a few µs of the coordinator's thread per message.
            cmds = [pack(("XACK", s, self.group, *ids)) for s, ids in acks.items()]
            cmds.append(pack((*head, "STREAMS", *req.keys(), *req.values())))
            try:
                return self._lane.call_many(cmds)[-1]
            except redis.exceptions.ResponseError as exc:
                # NOGROUP, or UNBLOCKED for a read that was blocked when it went
                if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                    raise
                # The stream or group vanished (server restarted without AOF, key
                # deleted): recreate and re-read pending (nothing is pending any more).
                self._groups.clear()
                self.cursor.on_lost()
                self._ensure_groups()
                return None

        try:
            raw = self.link.call(op, deadline=time.monotonic() + max(block, 0) / 1000 + 0.05)
        except BusUnavailable:
            self._restore_acks(acks)
            return []
        except BaseException:
            self._restore_acks(acks)
            raise
        reply = _entries_of(raw)
        return self.cursor.on_reply(reply) if check is None else self.cursor.on_reply(reply, check)

    def read_parsed(
        self,
        block_ms: int,
        verifiers: Mapping[str, Verifier],
        channel: str,
        rank_fields: Mapping[str, str],
    ) -> list[Delivery]:
        """One read, verified and decoded; what fails goes to the dlq (``verifiers``
        and ``rank_fields``: stream -> its key, and the ``rank`` field its entries carry)."""
        folded: list[Delivery] = []
        out = [
            Delivery(r.stream, format_id(r.entry_id), r.parsed.msg)  # type: ignore[attr-defined]
            for r in self.read_checked(block_ms, verifiers, channel, rank_fields, folded)
        ]
        # A rank's entries come either on its own stream or in its host's fold, never
        # both, so its order is kept with the folded ones after the direct ones.
        return out + folded if folded else out

    def read_checked(
        self,
        block_ms: int,
        verifiers: Mapping[str, Verifier],
        channel: str,
        rank_fields: Mapping[str, str],
        folded: list[Delivery] | None = None,
        items: list[Item] | None = None,
    ) -> list[Received]:
        """``read_parsed``'s accepted entries as read (``parsed``: an ``entries.Parsed``),
        for a caller that hands on the verified fields rather than the message
        (``bus.ingest``). A host agent's fold stream (``folds``) is unpacked into
        ``folded``, its items as deliveries from their ranks' own streams, or into
        ``items`` as they were verified (a reader process hands on their fields too)."""
        parse = entries.parse
        seqs = self.seqs
        folds = self.folds

        def check(stream: str, eid: EntryId, fields: Mapping[bytes, bytes] | None) -> object:
            if folds and stream in folds:
                return folds[stream](stream, eid, fields)
            last = seqs.get(stream, 0)
            p = parse(
                verifiers[stream],
                stream,
                f"{eid[0]}-{eid[1]}".encode(),
                fields,
                channel=channel,
                rank=rank_fields[stream],
                last_seq=last,
            )
            if isinstance(p, str):
                if eid[0] > writer_limit(_now_ms()):
                    self.foreign.add(stream)
                return p
            if last and p.seq != last + 1:
                # Nothing can bring them back; say so once, loudly, and go on.
                log.error(
                    "bus_entries_missing",
                    reader=self.name,
                    stream=stream,
                    seqs=f"{last + 1}..{p.seq - 1}",
                    reason="deleted or trimmed before this reader read them",
                )
            seqs[stream] = p.seq
            return p

        out: list[Received] = []
        rejected: list[tuple[Received, str]] = []
        for r in self.read(block_ms, check):
            if r.rejected is not None:
                rejected.append((r, r.rejected))
            elif type(r.parsed) is Unpacked:
                if items is not None:
                    items += good_items(r, r.parsed, rejected)
                elif folded is not None:
                    unfold_into(r, r.parsed, folded, rejected)
                else:
                    raise RuntimeError(f"{self.name}: fold stream {r.stream} read without folds")
            else:
                out.append(r)
        if rejected:
            self.dead_letter(rejected)
        return out

    def dead_letter(self, rejected: Sequence[tuple[Received, str]]) -> None:
        """Every rejected entry to the dlq with its reason, acked, logged once."""
        for r, reason in rejected:
            log.error(
                "bus_dead_letter",
                reader=self.name,
                stream=r.stream,
                entry=format_id(r.entry_id),
                type=(r.fields or {}).get(entries.F_TYPE, b"?").decode(errors="replace")[:64],
                reason=reason,
            )

        def op(retry: bool) -> None:
            # A retried dlq XADD may add a second dlq copy: harmless, the dlq is for humans.
            pipe = self.client.pipeline(transaction=False)
            for r, reason in rejected:
                pipe.xadd(
                    self.dlq,
                    entries.dead_letter_fields(  # type: ignore[arg-type]
                        r.stream, format_id(r.entry_id), reason, r.fields, self.name
                    ),
                    maxlen=self.config.maxlen,
                    approximate=True,
                )
                self._ack_dead(pipe, r)
            pipe.execute()

        # Bounded and never fatal: the valid entries of the same read are already past
        # the cursor, and a dlq write that fails (Redis down, OOM under noeviction, an
        # ACL refusal) must not throw them away. The rejected ones stay pending.
        try:
            self.link.call(op, deadline=time.monotonic() + DLQ_DEADLINE_S)
        except BusClosed:
            raise
        except Exception as exc:
            log.error(
                "bus_dead_letter_failed",
                reader=self.name,
                count=len(rejected),
                error=f"{type(exc).__name__}: {exc}"[:200],
            )

    def _ack_dead(self, pipe: Any, r: Received) -> None:
        pipe.xack(r.stream, self.group, format_id(r.entry_id))

    def close(self) -> None:
        try:
            self.flush_acks(timeout=1.0)
        except (BusUnavailable, BusClosed, *(redis.exceptions.RedisError,)):
            pass
        self.link.close()
        self._lane.close()


class _CursorReader(_GroupReader):
    """A rank's control reader: plain XREAD from its own cursor, no consumer group.

    A group is a queue anyone with the stream's ACL may take from: a worker credential
    that read one ``StartEpoch`` out of ``rank1``'s group hung the run for good, and a
    group made ahead at a future id left the rank deaf (issue 28). XREAD takes nothing
    from anyone, so no other reader can consume what this one has not seen. What a
    group also gave, this keeps otherwise:

    * order, authentication and replay protection: the same ordered ``GroupCursor``
      (``grouped=False``) and ``entries.parse`` checks, seq by seq;
    * no loss after a lost reply: the read is repeated from the cursor, which only
      verified entries move;
    * trimming never removes what the rank has not taken: ``applied`` (the last entry
      per stream the rank's runtime took over, its ``ack``) rides on every heartbeat,
      and the coordinator holds each control stream there (``bus.trim``).

    A rank process reads its streams from their start: its keys are made fresh at each
    start (``protocol.signing``), so no process reads another one's control."""

    def __init__(
        self,
        client: redis.Redis,
        streams: Sequence[str],
        *,
        config: StreamsConfig,
        name: str,
        where: str,
        dlq: str,
    ) -> None:
        super().__init__(
            client,
            streams,
            group="",
            consumer="",
            ordered=True,
            config=config,
            name=name,
            where=where,
            dlq=dlq,
        )
        self.cursor = GroupCursor(
            streams, count=read_count_for(config, len(streams)), ordered=True, grouped=False
        )
        #: the newest entry id per stream the runtime took over (``queue_acks``)
        self.applied: dict[str, EntryId] = {}
        #: refused entries beyond the run's ids, which the cursor stays below
        self._far: set[tuple[str, EntryId]] = set()

    def _ensure_groups(self) -> None:
        return

    def queue_acks(self, deliveries: Sequence[Delivery]) -> None:
        with self._ack_lock:
            for d in deliveries:
                eid = parse_id(d.entry_id)
                if eid > self.applied.get(d.stream, ZERO):
                    self.applied[d.stream] = eid

    def applied_ids(self) -> dict[str, str]:
        with self._ack_lock:
            return {s: format_id(e) for s, e in self.applied.items()}

    def flush_acks(self, timeout: float = 2.0) -> None:
        return

    def _ack_dead(self, pipe: Any, r: Received) -> None:
        return  # nothing to ack: the cursor moved past it (or stays, for a foreign id)

    def read(self, block_ms: int, check: Check | None = None) -> list[Received]:
        block = min(block_ms, self.config.max_block_ms)

        def op(retry: bool) -> Any:
            req = self.cursor.request()
            args: list[Any] = ["XREAD", "COUNT", self.cursor.count]
            if block > 0 and self.cursor.can_block:
                args += ("BLOCK", block)
            return self._lane.call(*args, "STREAMS", *req.keys(), *req.values())

        try:
            raw = self.link.call(op, deadline=time.monotonic() + max(block, 0) / 1000 + 0.05)
        except BusUnavailable:
            return []
        reply = _entries_of(raw)
        # The cursor's positions and the clock are read only where they can matter: a
        # rank's every control message comes through here on its way to the core.
        watch = bool(reply) and block > 0
        before = self.cursor.positions() if watch else None
        out = self.cursor.on_reply(reply) if check is None else self.cursor.on_reply(reply, check)
        limit: int | None = None
        kept: list[Received] = []
        for r in out:
            if r.rejected is None:
                kept.append(r)
                continue
            if limit is None:
                limit = writer_limit(_now_ms())
            if r.entry_id[0] <= limit:
                # Refused (forged, copied, another run's...): read past it, once.
                self.cursor.skip(r.stream, r.entry_id)
            elif (r.stream, r.entry_id) in self._far:
                continue  # beyond the run's ids, dead-lettered already: it stays
            else:
                # Beyond any id the run writes: the cursor stays below it (passing it
                # would hide every real entry after it); the coordinator removes it.
                self._far.add((r.stream, r.entry_id))
                if len(self._far) > 10_000:
                    self._far.clear()
            kept.append(r)
        if watch and self.cursor.positions() == before:
            # Only an entry the cursor must not pass came back (XREAD returns it at once
            # every time): wait as a read would, instead of spinning on it.
            time.sleep(block / 1000)
        return kept
