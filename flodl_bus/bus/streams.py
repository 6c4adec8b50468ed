"""``RankBus`` and ``CoordinatorBus`` on Redis Streams (DESIGN §3).

Streams of a run (see ``keys``): ``ctl:<r>`` and ``ctl:all`` (coordinator → ranks),
``up:<r>`` (rank r → coordinator), ``dlq`` (rejected entries).

How each rule of DESIGN §3 is kept:

1. Per-rank order: the coordinator writes every control entry under one lock with an
   explicit id from one ``IdClock``; a rank reads ``ctl:<r>`` and ``ctl:all`` in ONE
   XREADGROUP (atomic on the server) and ``GroupCursor`` releases them in id order.
2. One upstream stream per rank, written only by the rank's publisher thread, in
   ``publish()`` order (FIFO queue, one thread, each batch one WATCH/MULTI/EXEC
   transaction above the stream's top, so a foreign entry cannot split it).
3. No duplicates, no loss: explicit ids make a retried XADD harmless (Redis refuses an id
   at or below the stream top; a retry after a lost reply first asks whether our entry,
   same id and same MAC, is there). Consumer groups with XACK after dispatch; pending
   entries are re-read first after every start and every lost connection;
   ``GroupCursor`` drops redeliveries. A foreign entry that moved a stream's top is
   followed up to ``FOLLOW_LIMIT_MS`` ahead, and beyond that removed by the coordinator
   (``repair_stream``): nothing anyone writes stops a writer or wedges a stream.
5. Bounded memory: the coordinator trims every stream up to what all its readers
   consumed, keeping one trim pass of entries (``bus.trim``), so a stream holds a few
   seconds of entries whatever the run length; every XADD also caps with ``MAXLEN ~
   maxlen``, the bound when a reader falls far behind: a reader must stay less than
   ``maxlen`` entries (default 100,000) behind on a stream. A pending entry trimmed away
   anyway is dead-lettered with that reason, never silently dropped.
6. Bounded waits: BLOCK is capped at ``MAX_BLOCK_MS`` (1 s) under a 10 s socket timeout;
   ``Link`` reconnects with exponential backoff and logs one line per reconnect.
7. Bad input: ``entries.parse`` names the reason; the entry goes to ``dlq`` with it, is
   acked, is logged as one structured error, and reading goes on.
8. Authentication: every entry's MAC (rank key, or a broadcast's per-rank MAC vector or
   Ed25519 signature; ``protocol.signing``) covers the stream, the entry id and the
   writer's seq; a reader is moved only by entries that verify.
9. Replay protection: a seq at or below the last one accepted on a stream is ``replayed``.
"""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, get_args

import redis
import structlog

from flodl_bus.bus import entries
from flodl_bus.bus.api import Delivery
from flodl_bus.bus.connection import MAX_BLOCK_MS, Backoff, BusClosed, BusUnavailable, Link
from flodl_bus.bus.cursor import Check, GroupCursor, Received
from flodl_bus.bus.ids import ZERO, EntryId, IdClock, format_id, parse_id
from flodl_bus.bus.keys import BROADCAST, RunKeys
from flodl_bus.bus.trim import DEFAULT_STALE_S, DEFAULT_TRIM_INTERVAL_S, Trimmer, trim_pass
from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import ControlWire, UpstreamMsg
from flodl_bus.protocol.signing import CoordinatorKeys, MacKey, RankKeys, Signer, Verifier

#: how long a dead-letter write may wait for Redis before the read goes on without it
DLQ_DEADLINE_S: Final = 2.0
log = structlog.get_logger("flodl_bus.bus")

COORDINATOR_GROUP: Final = "coordinator"
DEFAULT_MAXLEN: Final = 100_000
#: How far ahead of its own clock a writer follows a stream's top. A top further ahead
#: was put there by a foreign writer (every writer of the run makes ids from its own
#: clock): the writer does not follow it up to the largest id, where the stream would be
#: wedged, but has the coordinator remove it (``repair_stream``). Half a day tolerates
#: any clock skew between hosts that NTP leaves.
FOLLOW_LIMIT_MS: Final = 12 * 3600 * 1000


class BusError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class StreamsConfig:
    #: ``MAXLEN ~`` of every stream (see rule 5 above for the bound it implies).
    maxlen: int = DEFAULT_MAXLEN
    #: COUNT of one XREADGROUP, per stream.
    read_count: int = 512
    #: Most upstream entries the publisher writes in one pipeline.
    publish_batch: int = 512
    max_block_ms: int = MAX_BLOCK_MS
    backoff: Backoff = field(default_factory=Backoff)
    #: The coordinator trims every stream to what its readers consumed this often
    #: (``bus.trim``); 0 leaves only the ``MAXLEN`` cap.
    trim_interval_s: float = DEFAULT_TRIM_INTERVAL_S
    #: A reader that holds trimming back without moving this long is taken as gone.
    trim_stale_s: float = DEFAULT_STALE_S


def rank_group(rank: int) -> str:
    return f"rank{rank}"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def settle_heap() -> None:
    """Move every object made so far out of the cyclic collector's view (``gc.freeze``).

    A full collection walks every tracked object: with a process's imports alone (some
    40,000 objects, more with torch) that is a 5-10 ms stall of every thread, and on an
    H200 host it took the control dispatch p99 from 0.6 ms to 10-28 ms (one stall holds
    up the ~20 messages behind it). What a bus process keeps from its start is never
    garbage; after a freeze a full collection walks only what was made since. Closing a
    bus unfreezes: a frozen object is never collected, not even at exit, and a process
    group left to the interpreter's teardown ends the process in std::terminate.
    """
    gc.freeze()


def id_refused(exc: redis.exceptions.ResponseError) -> bool:
    # "equal or smaller than the target stream top item", or, past the largest id,
    # "The stream has exhausted the last possible ID"
    text = str(exc)
    return "equal or smaller" in text or "exhausted the last possible ID" in text


def writer_limit(now_ms: int) -> int:
    """The largest stream-top millisecond a writer follows; above it, it waits for the
    coordinator to remove the foreign entry (``repair_stream``)."""
    return now_ms + FOLLOW_LIMIT_MS


class StreamBlocked(BusError):
    """A foreign entry put the stream's top beyond any id a writer of the run may use."""


def _as_map(fields: Any) -> dict[bytes, bytes]:
    """An entry's fields as XRANGE gives them: a dict, or a flat [k, v, ...] list."""
    if not fields:
        return {}
    if isinstance(fields, dict):
        return fields
    it = iter(fields)
    return dict(zip(it, it))


def landed(client: redis.Redis, stream: str, eid: str, mac: bytes) -> bool:
    """Whether our entry (same id AND same mac) is in ``stream``: after a lost reply a
    refused id only proves *someone's* entry is there."""
    found: Any = client.xrange(stream, min=eid, max=eid, count=1)
    return bool(found) and _as_map(found[0][1]).get(entries.F_MAC) == mac


def last_seq(client: redis.Redis, stream: str, verifier: Verifier, rank: str, channel: str) -> int:
    """The seq of the newest entry in ``stream`` that verifies with our key (0 if none):
    a writer that starts again on a stream continues above it, so readers that already
    passed the old entries keep accepting. Foreign entries cannot move it."""
    found: Any = client.xrevrange(stream, "+", "-", count=64)
    for raw_id, fields in found or ():
        p = entries.parse(verifier, stream, raw_id, _as_map(fields), channel=channel, rank=rank)
        if isinstance(p, entries.Parsed):
            return p.seq
    return 0


def repair_stream(
    client: redis.Redis, stream: str, dlq: str, *, floor: EntryId, now_ms: int, by: str
) -> int:
    """Remove foreign entries whose ids lie beyond what any writer of the run follows,
    and bring the stream's top and its groups back below them. Returns how many were
    removed (each is dead-lettered first).

    A foreign entry at the largest id wedges a stream for good: Redis refuses every later
    XADD, explicit id or ``*``. XDEL alone does not lower the top; XSETID does, once the
    entry is gone. A group that was handed the foreign entry has its last-delivered id
    beyond every real one, so it is set back too: it had been handed every real entry
    below, as Redis delivers in id order. Coordinator credential only (XDEL, XSETID,
    XGROUP SETID)."""
    limit = writer_limit(now_ms)
    removed = 0
    for _ in range(16):  # a writer keeps adding foreign entries: bounded, then give up
        top = stream_top(client, stream)
        if top[0] <= limit:
            return removed
        found: Any = client.xrange(stream, min=f"{limit + 1}-0", max="+", count=1000)
        pipe = client.pipeline(transaction=False)
        for raw_id, fields in found or ():
            eid = raw_id.decode()
            flat = _as_map(fields)
            pipe.xadd(
                dlq,
                entries.dead_letter_fields(  # type: ignore[arg-type]
                    stream, eid, "foreign: entry id beyond the horizon, removed", flat, by
                ),
                maxlen=DEFAULT_MAXLEN,
                approximate=True,
            )
            pipe.xdel(stream, eid)
            removed += 1
        pipe.execute()
        if found and len(found) >= 1000:
            continue
        last: Any = client.xrevrange(stream, "+", "-", count=1)
        new_top = max(parse_id(last[0][0]) if last else ZERO, floor)
        client.execute_command("XSETID", stream, format_id(new_top))  # type: ignore[no-untyped-call]
        groups: Any = client.xinfo_groups(stream)
        for g in groups:
            if parse_id(g["last-delivered-id"]) > new_top:
                client.xgroup_setid(stream, g["name"], format_id(new_top))
        log.warning("bus_stream_repaired", stream=stream, removed=removed, top=format_id(new_top))
    raise StreamBlocked(f"{stream}: foreign entries beyond the horizon keep coming")


def stream_top(client: redis.Redis, stream: str) -> EntryId:
    """The last id ever generated in ``stream`` (survives trimming), ZERO if absent."""
    try:
        info = client.xinfo_stream(stream)
    except redis.exceptions.ResponseError as exc:
        if "no such key" in str(exc).lower():
            return ZERO
        raise
    return parse_id(info["last-generated-id"])


def ensure_group(client: redis.Redis, stream: str, group: str, start: str = "0") -> None:
    """Create ``group`` on ``stream`` from ``start`` (from the beginning by default:
    entries sent before a reader started must reach it), creating the stream if needed;
    an existing group is kept."""
    try:
        client.xgroup_create(stream, group, id=start, mkstream=True)
    except redis.exceptions.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


_CONTROL_TYPES: Final = wire.CONTROL_TYPES
_UPSTREAM_CLASSES: Final[frozenset[type]] = frozenset(get_args(UpstreamMsg))


def _raw_reply(response: Any, **_options: Any) -> Any:
    return response


def _require(msg: object, types: frozenset[str], what: str) -> None:
    try:
        name = wire.type_name(msg)
    except TypeError:
        raise TypeError(f"{type(msg).__name__} cannot travel on {what}") from None
    if name not in types:
        raise TypeError(f"{name} is not a {what} message")


# ------------------------------------------------------------------- group reader


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
        self.cursor = GroupCursor(streams, count=config.read_count, ordered=ordered)
        # Reads go through a client object of our own on the same connection pool, whose
        # XREADGROUP replies stay raw: redis-py's reply callback builds a list and a dict
        # per entry in Python, a tenth of the coordinator's whole ingest time; the loop
        # in ``read`` does the same in one pass.
        self._reads = redis.Redis(connection_pool=client.connection_pool)
        self._reads.set_response_callback("XREADGROUP", _raw_reply)
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

    def _on_lost(self) -> None:
        self.cursor.on_lost()
        # A server restarted without persistence lost the groups too.
        self._groups.clear()

    def add_stream(self, stream: str) -> None:
        self.cursor.add_stream(stream)

    def queue_acks(self, deliveries: Sequence[Delivery]) -> None:
        with self._ack_lock:
            for d in deliveries:
                self._acks.setdefault(d.stream, []).append(d.entry_id)

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
            ids: dict[Any, Any] = dict(self.cursor.request())
            wait = block if block > 0 and self.cursor.can_block else None
            try:
                if not acks:
                    return self._reads.xreadgroup(
                        self.group, self.consumer, ids, count=self.config.read_count, block=wait
                    )
                pipe = self._reads.pipeline(transaction=False)
                for stream, entry_ids in acks.items():
                    pipe.xack(stream, self.group, *entry_ids)
                pipe.xreadgroup(
                    self.group, self.consumer, ids, count=self.config.read_count, block=wait
                )
                return pipe.execute()[-1]
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
        reply: dict[str, list[tuple[EntryId, Any]]] = {}
        # RESP2: [[stream, [[id, [k, v, ...] or nil], ...]], ...]; RESP3: {stream: [...]}
        for name, items in raw.items() if isinstance(raw, dict) else raw or ():
            got = reply[name.decode()] = []
            for eid, flat in items:
                # nil fields: a pending entry that was trimmed away (parse rejects it)
                it = iter(flat or ())
                got.append((parse_id(eid), dict(zip(it, it)) if flat else None))
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
        parse = entries.parse
        seqs = self.seqs
        limit = writer_limit(_now_ms())

        def check(stream: str, eid: EntryId, fields: Mapping[bytes, bytes] | None) -> object:
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
                if eid[0] > limit:
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

        out: list[Delivery] = []
        rejected: list[tuple[Received, str]] = []
        for r in self.read(block_ms, check):
            if r.rejected is not None:
                rejected.append((r, r.rejected))
            else:
                out.append(Delivery(r.stream, format_id(r.entry_id), r.parsed.msg))  # type: ignore[attr-defined]
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
                pipe.xack(r.stream, self.group, format_id(r.entry_id))
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

    def close(self) -> None:
        try:
            self.flush_acks(timeout=1.0)
        except (BusUnavailable, BusClosed, *(redis.exceptions.RedisError,)):
            pass
        self.link.close()


# ------------------------------------------------------------------------- rank


_STOP: Final = object()


class _Publisher:
    """The rank's sole writer of ``up:<r>``: a queue drained by one thread."""

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        rank: int,
        key: MacKey,
        config: StreamsConfig,
        where: str,
    ) -> None:
        self.client = client
        self.stream = stream
        self.rank = rank
        self.rank_field = str(rank)
        self.key = key
        self.config = config
        self.link = Link(client, name=f"rank{rank}.publisher", where=where, backoff=config.backoff)
        self.clock = IdClock()
        self.seq = 0
        self.error: BaseException | None = None
        self.written = 0
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._closed = False
        self._closing = threading.Event()
        #: the first id and mac of the last batch tried (a lost reply: did it land?)
        self._tried: tuple[str, bytes] | None = None
        self._blocked_since: float | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"flodl-bus-publisher-{rank}", daemon=True
        )
        self._thread.start()

    def publish(self, msg: object) -> None:
        if self._closed:
            raise BusClosed("publish after close")
        if self.error is not None:
            raise BusError(f"upstream publisher of rank {self.rank} failed: {self.error}")
        self._q.put(msg)

    def flush(self, timeout: float) -> bool:
        if not self._thread.is_alive():
            return self._q.empty() and self.error is None
        done = threading.Event()
        self._q.put(done)
        # After a failure the thread still answers flushes but drops messages.
        return done.wait(timeout) and self.error is None

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._q.put(_STOP)
        self._thread.join(timeout)
        self._closing.set()
        self.link.close()
        self._thread.join(1.0)

    def _run(self) -> None:
        try:
            self._drain()
        except BusClosed:
            return
        except BaseException as exc:
            # A dead publisher must be visible: flush() reports it and the rank stops
            # instead of training on while its heartbeats silently pile up in the queue.
            self.error = exc
            log.error("bus_publisher_failed", rank=self.rank, error=repr(exc)[:200])

    def _start(self) -> None:
        top = stream_top(self.client, self.stream)
        if top[0] <= writer_limit(_now_ms()):
            self.clock.raise_floor(top)
        # Continue the stream's seq: a reader that passed our earlier entries (this rank
        # restarted) must not take the new ones for replays.
        self.seq = max(
            self.seq, last_seq(self.client, self.stream, self.key, self.rank_field, wire.UPSTREAM)
        )

    def _drain(self) -> None:
        self.link.call(lambda retry: self._start())
        get = self._q.get
        get_nowait = self._q.get_nowait
        limit = self.config.publish_batch
        while True:
            batch = [get()]
            while len(batch) < limit:
                try:
                    batch.append(get_nowait())
                except queue.Empty:
                    break
            msgs: list[object] = []
            for item in batch:
                if item is _STOP:
                    self._write(msgs)
                    return
                if isinstance(item, threading.Event):
                    self._write(msgs)
                    msgs = []
                    item.set()
                else:
                    msgs.append(item)
            self._write(msgs)

    def _write(self, msgs: list[object]) -> None:
        if not msgs or self.error is not None:
            return
        batch: list[tuple[int, tuple[bytes, bytes]]] = []
        for msg in msgs:
            try:
                encoded = entries.encode(msg)
            except (TypeError, ValueError, OverflowError) as exc:
                # e.g. an int beyond 64 bits: one message lost, loudly; the stream goes on
                log.error("bus_publish_dropped", rank=self.rank, error=str(exc)[:200])
                continue
            self.seq += 1
            batch.append((self.seq, encoded))
        if not batch:
            return
        self._tried = None
        try:
            self.link.call(lambda retry: self._commit(batch, retry))
        except BusClosed:
            log.error("bus_publish_unwritten", rank=self.rank, count=len(batch))
            return
        except Exception as exc:
            self.error = exc
            log.error("bus_publisher_failed", rank=self.rank, error=str(exc)[:200])
            return
        self.written += len(batch)

    def _commit(self, batch: list[tuple[int, tuple[bytes, bytes]]], retry: bool) -> None:
        """Write the batch atomically, in order, above the stream's top.

        WATCH + MULTI/EXEC makes the batch all-or-nothing: a foreign entry that lands
        between our ids cannot leave half the batch written and the rest renumbered
        behind it (which would break the rank's send order). Ids are chosen after the
        stream's top is read under WATCH, so the XADDs cannot be refused."""
        if retry and self._tried is not None and landed(self.client, self.stream, *self._tried):
            return  # the lost reply was of a transaction that ran
        while True:
            with self.client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(self.stream)  # type: ignore[no-untyped-call]
                    top = stream_top(pipe, self.stream)
                    if not self._follow(top):
                        continue
                    now = _now_ms()
                    pipe.multi()
                    for seq, encoded in batch:
                        eid = format_id(self.clock.next(now))
                        fields = entries.sign(
                            self.key, self.stream, eid, encoded, self.rank_field, seq
                        )
                        if seq == batch[0][0]:
                            self._tried = (eid, fields[entries.F_MAC])
                        pipe.xadd(
                            self.stream,
                            fields,  # type: ignore[arg-type]
                            id=eid,
                            maxlen=self.config.maxlen,
                            approximate=True,
                        )
                    pipe.execute()
                    return
                except redis.exceptions.WatchError:
                    # Someone wrote the stream meanwhile (EXEC aborted, nothing of ours
                    # landed), or, as redis-py reports a connection lost while watching,
                    # the reply of an EXEC that may have run: ask the stream which.
                    if self._tried is not None and landed(self.client, self.stream, *self._tried):
                        return
                    continue

    def _follow(self, top: EntryId) -> bool:
        """Lift our ids above ``top`` if a writer of the run may follow it; else wait
        (False) for the coordinator to remove the foreign entry that put it there."""
        if top <= self.clock.last:
            self._blocked_end()
            return True
        if top[0] <= writer_limit(_now_ms()):
            self.clock.raise_floor(top)
            self._blocked_end()
            return True
        if self._blocked_since is None:
            self._blocked_since = time.monotonic()
            log.error(
                "bus_stream_blocked",
                stream=self.stream,
                top=format_id(top),
                reason="a foreign entry beyond any id of the run; waiting for the "
                "coordinator to remove it",
            )
        if self._closing.wait(0.05):
            raise BusClosed(f"{self.stream}: closed while blocked")
        return False

    def _blocked_end(self) -> None:
        if self._blocked_since is not None:
            log.warning(
                "bus_stream_unblocked",
                stream=self.stream,
                blocked_s=round(time.monotonic() - self._blocked_since, 3),
            )
            self._blocked_since = None


class RedisRankBus:
    """A rank's side of the bus (see ``RankBus``)."""

    def __init__(
        self,
        client: redis.Redis,
        run: str | RunKeys,
        rank: int,
        keys: RankKeys,
        *,
        config: StreamsConfig | None = None,
        where: str = "",
    ) -> None:
        self.keys = run if isinstance(run, RunKeys) else RunKeys(run)
        self.rank = rank
        self.config = config or StreamsConfig()
        self._ctl = self.keys.ctl(rank)
        self._all = self.keys.ctl_all
        self._rank_fields = {self._ctl: str(rank), self._all: BROADCAST}
        self._verifiers: dict[str, Verifier] = {
            self._ctl: keys.rank_key,
            self._all: keys.broadcast_verifier(rank),
        }
        self._reader = _GroupReader(
            client,
            [self._ctl, self._all],
            group=rank_group(rank),
            consumer=rank_group(rank),
            ordered=True,
            config=self.config,
            name=f"rank{rank}.reader",
            where=where,
            dlq=self.keys.dlq,
        )
        self._publisher = _Publisher(
            client, self.keys.up(rank), rank, keys.rank_key, self.config, where
        )
        settle_heap()

    @property
    def reconnects(self) -> int:
        return self._reader.link.reconnects + self._publisher.link.reconnects

    def read_control(self, block_ms: int) -> list[Delivery]:
        return self._reader.read_parsed(block_ms, self._verifiers, wire.CONTROL, self._rank_fields)

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Queue the acks; they ride on the next read (or ``flush_acks``/``close``)."""
        self._reader.queue_acks(deliveries)

    def flush_acks(self) -> None:
        self._reader.flush_acks()

    def publish(self, msg: UpstreamMsg) -> None:
        # Only a type check here: encoding and signing happen on the publisher thread,
        # so the training thread pays a dict lookup and a queue put.
        if type(msg) not in _UPSTREAM_CLASSES:
            raise TypeError(f"{type(msg).__name__} is not an upstream message")
        self._publisher.publish(msg)

    def flush(self, timeout: float) -> bool:
        return self._publisher.flush(timeout)

    def close(self) -> None:
        self._publisher.close()
        self._reader.close()
        gc.unfreeze()


# ------------------------------------------------------------------ coordinator


class RedisCoordinatorBus:
    """The coordinator's side of the bus (see ``CoordinatorBus``)."""

    def __init__(
        self,
        client: redis.Redis,
        run: str | RunKeys,
        keys: CoordinatorKeys,
        *,
        ranks: Iterable[int] = (),
        config: StreamsConfig | None = None,
        where: str = "",
    ) -> None:
        self.keys = run if isinstance(run, RunKeys) else RunKeys(run)
        self.client = client
        self.signing = keys
        self.config = config or StreamsConfig()
        self._lock = threading.Lock()
        self._clock = IdClock()
        self._seqs: dict[str, int] = {}
        #: the last id written per control stream (the trimmer's margin)
        self._tops: dict[str, EntryId] = {}
        self._ranks: dict[str, str] = {}
        self._verifiers: dict[str, Verifier] = {}
        self._link = Link(
            client, name="coordinator.sender", where=where, backoff=self.config.backoff
        )
        self._reader = _GroupReader(
            client,
            [],
            group=COORDINATOR_GROUP,
            consumer=COORDINATOR_GROUP,
            ordered=False,
            config=self.config,
            name="coordinator.reader",
            where=where,
            dlq=self.keys.dlq,
        )
        self._link.call(lambda retry: self._raise_floor(self.keys.ctl_all))
        for rank in ranks:
            self.add_rank(rank)
        self._trim_stop = threading.Event()
        self._trimmer = Trimmer(self.config.trim_stale_s)
        self.trimmed_passes = 0
        self._trim_thread: threading.Thread | None = None
        if self.config.trim_interval_s > 0:
            self._trim_thread = threading.Thread(
                target=self._trim_loop, name="flodl-bus-trimmer", daemon=True
            )
            self._trim_thread.start()
        settle_heap()

    def _trim_loop(self) -> None:
        failing = False
        while not self._trim_stop.wait(self.config.trim_interval_s):
            try:
                self.trim_now()
                if failing:
                    log.info("bus_trim_resumed")
                failing = False
            except (redis.exceptions.RedisError, OSError) as exc:
                # Soft state: the next pass tries again; one line per episode.
                if not failing:
                    log.warning("bus_trim_failed", error=f"{type(exc).__name__}: {exc}"[:200])
                failing = True

    def trim_tops(self) -> dict[str, EntryId]:
        """Each stream's newest verified id as this coordinator knows it."""
        with self._lock:
            tops = dict(self._tops)
        for up in list(self._ranks):
            tops[up] = self._reader.cursor.last_id(up)
        return tops

    def trim_now(self, now: float | None = None) -> dict[str, EntryId]:
        """One trim pass (``bus.trim``); the trimmer thread calls it every interval."""
        plan = trim_pass(
            self.client, self._trimmer, self.trim_tops(), time.monotonic() if now is None else now
        )
        self.trimmed_passes += 1
        return plan

    @property
    def ranks(self) -> list[int]:
        return sorted(int(r) for r in self._ranks.values())

    def _raise_floor(self, stream: str) -> None:
        top = stream_top(self.client, stream)
        if top[0] <= writer_limit(_now_ms()):
            self._clock.raise_floor(top)

    def add_rank(self, rank: int) -> None:
        """Start reading ``up:<rank>``; create the rank's groups so nothing sent before
        its reader starts is missed; continue control ids above its stream's top."""
        up = self.keys.up(rank)
        if up in self._ranks:
            return
        key = self.signing.rank(rank)

        def op(retry: bool) -> None:
            ensure_group(self.client, self.keys.ctl(rank), rank_group(rank))
            ensure_group(self.client, self.keys.ctl_all, rank_group(rank))
            with self._lock:
                self._raise_floor(self.keys.ctl(rank))

        self._link.call(op)
        self._verifiers[up] = key
        self._ranks[up] = str(rank)
        self._reader.add_stream(up)

    def send(self, rank: int, msg: ControlWire) -> None:
        self._write(self.keys.ctl(rank), str(rank), msg, self.signing.rank(rank))

    def broadcast(self, msg: ControlWire) -> None:
        self._write(self.keys.ctl_all, BROADCAST, msg, self.signing.broadcast)

    def send_batch(self, items: Sequence[tuple[int | None, ControlWire]]) -> list[str]:
        """Every ``(rank, msg)`` (rank None: a broadcast) in one round trip, in order;
        returns the entry id of each.

        One core step often sends a message to every rank (StartEpoch, SyncNow): one
        XADD round trip each made a burst at 1,024 ranks take ~300 ms. Here the streams
        are WATCHed, their tops read in one pipeline, the clock lifted above them, and
        every XADD goes in one MULTI/EXEC: all of the batch lands or none of it, so no
        XADD can be refused halfway (which would leave a stream's later entry written
        and its earlier one renumbered behind it). After a lost reply the first entry
        (same id and MAC) says whether the transaction ran, as for one XADD.

        A batch is all unicasts or all broadcasts (ValueError otherwise): a rank blocked
        on ``ctl:<r>`` + ``ctl:all`` is woken by the first of its streams the transaction
        signals and handed only that stream's entries, so a batch holding both could
        show a rank a later id before an earlier one of its other stream (rule 1)."""
        if not items:
            return []
        if len({rank is None for rank, _ in items}) > 1:
            raise ValueError("send_batch: unicasts and broadcasts go in separate batches")
        plan: list[tuple[str, str, Signer]] = []
        for rank, msg in items:
            _require(msg, _CONTROL_TYPES, "a control stream")
            if rank is None:
                plan.append((self.keys.ctl_all, BROADCAST, self.signing.broadcast))
            else:
                plan.append((self.keys.ctl(rank), str(rank), self.signing.rank(rank)))
        with self._lock:
            encoded = [entries.encode(msg) for _, msg in items]
            seqs = [self._next_seq(st, rf, sg) for st, rf, sg in plan]
            streams = list(dict.fromkeys(st for st, _, _ in plan))
            tried: list[tuple[str, str, bytes]] = []
            ids: list[str] = []

            def op(retry: bool) -> None:
                if retry and tried and landed(self.client, *tried[-1]):
                    return  # the lost reply was of a transaction that ran
                while True:
                    with self.client.pipeline(transaction=True) as pipe:
                        try:
                            pipe.watch(*streams)  # type: ignore[no-untyped-call]
                            if not self._above_tops(streams):
                                continue
                            pipe.multi()
                            ids.clear()
                            for (st, rf, sg), enc, seq in zip(plan, encoded, seqs, strict=True):
                                eid = format_id(self._clock.next(_now_ms()))
                                fields = entries.sign(sg, st, eid, enc, rf, seq)
                                if not ids:
                                    tried.append((st, eid, fields[entries.F_MAC]))
                                ids.append(eid)
                                pipe.xadd(
                                    st,
                                    fields,  # type: ignore[arg-type]
                                    id=eid,
                                    maxlen=self.config.maxlen,
                                    approximate=True,
                                )
                            pipe.execute()
                            return
                        except redis.exceptions.WatchError:
                            # A stream was written meanwhile (nothing of ours landed), or
                            # redis-py's report of a connection lost while watching, the
                            # reply of an EXEC that may have run: ask the stream which.
                            if tried and landed(self.client, *tried[-1]):
                                return
                            continue

            self._link.call(op)
            for (st, _, _), eid in zip(plan, ids, strict=True):
                self._tops[st] = parse_id(eid)
            return list(ids)

    def _above_tops(self, streams: Sequence[str]) -> bool:
        """Read every stream's top (one pipeline) and lift the clock above those a writer
        of the run may follow; a top beyond that is removed first (False: read again)."""
        pipe = self.client.pipeline(transaction=False)
        for st in streams:
            pipe.xinfo_stream(st)
        infos = pipe.execute(raise_on_error=False)
        limit = writer_limit(_now_ms())
        clean = True
        for st, info in zip(streams, infos, strict=True):
            if isinstance(info, redis.exceptions.ResponseError):
                if "no such key" in str(info).lower():
                    continue
                raise info
            top = parse_id(info["last-generated-id"])
            if top <= self._clock.last:
                continue
            if top[0] <= limit:
                self._clock.raise_floor(top)
            else:
                self._repair(st)
                clean = False
        return clean

    def _next_seq(self, stream: str, rank_field: str, signer: Signer) -> int:
        seq = self._seqs.get(stream)
        if seq is None:
            # An earlier coordinator of the run wrote here: continue above its seq.
            verifier: Verifier = (
                signer if isinstance(signer, MacKey) else self.signing.broadcast_check
            )
            seq = self._link.call(
                lambda retry: last_seq(self.client, stream, verifier, rank_field, wire.CONTROL)
            )
        self._seqs[stream] = seq + 1
        return seq + 1

    def _write(self, stream: str, rank_field: str, msg: object, signer: Signer) -> None:
        _require(msg, _CONTROL_TYPES, "a control stream")
        with self._lock:
            encoded = entries.encode(msg)
            seq = self._next_seq(stream, rank_field, signer)
            tried: list[tuple[str, bytes]] = []

            def op(retry: bool) -> None:
                if retry and tried and landed(self.client, stream, *tried[-1]):
                    return  # the lost reply was of an XADD that ran
                while True:
                    eid = format_id(self._clock.next(_now_ms()))
                    fields = entries.sign(signer, stream, eid, encoded, rank_field, seq)
                    tried.append((eid, fields[entries.F_MAC]))
                    try:
                        self.client.xadd(
                            stream,
                            fields,  # type: ignore[arg-type]
                            id=eid,
                            maxlen=self.config.maxlen,
                            approximate=True,
                        )
                        self._tops[stream] = parse_id(eid)
                        return
                    except redis.exceptions.ResponseError as exc:
                        if not id_refused(exc):
                            raise
                    # Refused: the stream's top is ahead of our clock (an earlier
                    # coordinator, or a foreign entry). Renumber above it; every id we
                    # hand out afterwards is larger still, so the send order is kept. A
                    # top no writer of the run may follow is removed first.
                    self._repair(stream)
                    self._raise_floor(stream)

            self._link.call(op)

    def _repair(self, stream: str, floor: EntryId | None = None) -> None:
        repair_stream(
            self.client,
            stream,
            self.keys.dlq,
            floor=self._clock.last if floor is None else floor,
            now_ms=_now_ms(),
            by="coordinator",
        )

    def read_upstream(self, block_ms: int) -> list[Delivery]:
        out = self._reader.read_parsed(block_ms, self._verifiers, wire.UPSTREAM, self._ranks)
        if self._reader.foreign:
            # A rank's publisher waits on a stream wedged by a foreign entry; only the
            # coordinator may remove it.
            streams, self._reader.foreign = self._reader.foreign, set()
            for stream in sorted(streams):
                floor = self._reader.cursor.last_id(stream)

                def op(retry: bool, s: str = stream, f: EntryId = floor) -> None:
                    self._repair(s, f)

                self._link.call(op)
        return out

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        self._reader.queue_acks(deliveries)

    def flush_acks(self) -> None:
        self._reader.flush_acks()

    @property
    def reconnects(self) -> int:
        return self._link.reconnects + self._reader.link.reconnects

    def close(self) -> None:
        self._trim_stop.set()
        if self._trim_thread is not None:
            self._trim_thread.join(5.0)
        self._reader.close()
        self._link.close()
        gc.unfreeze()
