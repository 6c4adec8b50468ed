"""``RankBus`` and ``CoordinatorBus`` on Redis Streams (DESIGN §3).

Streams of a run (see ``keys``): ``ctl:<r>`` and ``ctl:all`` (coordinator → ranks),
``up:<r>`` (rank r → coordinator), ``dlq`` (rejected entries).

Where each rule of DESIGN §3 is kept: the coordinator writes every control entry under
one lock with an explicit id from one ``IdClock`` (rule 1, here); the rank's upstream
writer is ``bus.publisher`` (rule 2); reading, acks, the dlq and verification are
``bus.reader`` (rules 1, 3, 5, 7-9); explicit ids, ``landed`` after a lost reply, the
``MAXLEN`` cap and bounded waits are ``bus.stream_ops`` (rules 3, 5, 6); foreign entries
beyond the horizon are ``bus.foreign`` (rule 3); trimming is ``bus.trim`` (rule 5).
"""

from __future__ import annotations

import collections
import gc
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final, get_args

import redis

from flodl_bus.bus import entries
from flodl_bus.bus.api import Delivery, IngestHung
from flodl_bus.bus.batch_script import BatchScript, named_user, write_batch
from flodl_bus.bus.connection import Link
from flodl_bus.bus.fold import FoldRoutes, host_stream
from flodl_bus.bus.foreign import FOLLOW_LIMIT_MS, StreamBlocked, repair_stream, writer_limit
from flodl_bus.bus.ids import ZERO, EntryId, IdClock, format_id, parse_id
from flodl_bus.bus.ingest import IngestFailed, IngestPool
from flodl_bus.bus.keys import BROADCAST, RunKeys
from flodl_bus.bus.lane import Lane
from flodl_bus.bus.publisher import _Publisher
from flodl_bus.bus.reader import _CursorReader, _GroupReader
from flodl_bus.bus.replication import ReplicaGuard
from flodl_bus.bus.resp import XaddPacker
from flodl_bus.bus.stream_ops import (
    DEFAULT_MAXLEN,
    BusError,
    StreamsConfig,
    _now_ms,
    ensure_group,
    id_refused,
    landed,
    last_seq,
    log,
    rank_group,
    settle_heap,
    stream_top,
)
from flodl_bus.bus.trim import GroupHold, Trimmer, trim_pass
from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import ControlWire, Heartbeat, UpstreamMsg
from flodl_bus.protocol.signing import CoordinatorKeys, MacKey, RankKeys, Signer, Verifier

# Names other modules imported from here before the split; their homes are above.
__all__ = [
    "COORDINATOR_GROUP",
    "DEFAULT_MAXLEN",
    "FOLLOW_LIMIT_MS",
    "BusError",
    "RedisCoordinatorBus",
    "RedisRankBus",
    "StreamBlocked",
    "StreamsConfig",
    "ensure_group",
    "id_refused",
    "landed",
    "last_seq",
    "rank_group",
    "repair_stream",
    "settle_heap",
    "stream_top",
    "writer_limit",
]

COORDINATOR_GROUP: Final = "coordinator"

_CONTROL_TYPES: Final = wire.CONTROL_TYPES
#: most control entries remembered per stream as owed (``RedisCoordinatorBus.overdue``)
MAX_OWED: Final = 100_000
_UPSTREAM_CLASSES: Final[frozenset[type]] = frozenset(get_args(UpstreamMsg))


def _require(msg: object, types: frozenset[str], what: str) -> None:
    try:
        name = wire.type_name(msg)
    except TypeError:
        raise TypeError(f"{type(msg).__name__} cannot travel on {what}") from None
    if name not in types:
        raise TypeError(f"{name} is not a {what} message")


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
        self._all = self.keys.ctl_all_of(rank)
        self._rank_fields = {self._ctl: str(rank), self._all: BROADCAST}
        self._verifiers: dict[str, Verifier] = {
            self._ctl: keys.rank_key,
            self._all: keys.broadcast_verifier(rank),
        }
        self._reader = _CursorReader(
            client,
            [self._ctl, self._all],
            config=self.config,
            name=f"rank{rank}.reader",
            where=where,
            dlq=self.keys.dlq_for(self._ctl),
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
        """The runtime took these over: the rank's heartbeats say so (``control_read``)."""
        self._reader.queue_acks(deliveries)

    def flush_acks(self) -> None:
        self._reader.flush_acks()

    def control_read(self) -> tuple[str | None, str | None]:
        """The newest entry ids of ``ctl:<r>`` and of the broadcast stream the runtime
        took over (None: none yet), for the heartbeats that let the coordinator trim."""
        applied = self._reader.applied_ids()
        return applied.get(self._ctl), applied.get(self._all)

    def publish(self, msg: UpstreamMsg) -> None:
        # Only a type check here: encoding and signing happen on the publisher thread,
        # so the training thread pays a dict lookup and a queue put.
        if type(msg) not in _UPSTREAM_CLASSES:
            raise TypeError(f"{type(msg).__name__} is not an upstream message")
        self._publisher.publish(msg)

    def hurry(self) -> None:
        """Write what the publisher holds back now (``bus.publisher``): the rank is
        about to block on its control."""
        self._publisher.hurry()

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
        shard: int | None = None,
        clock: IdClock | None = None,
        lock: threading.RLock | None = None,
        wait_ms: int = 0,
        script: bool = True,
        ingest_procs: int = 0,
        ingest_setup: Callable[[], None] | None = None,
    ) -> None:
        """``shard``, ``clock``, ``lock``: one shard of a run on a Redis Cluster
        (``bus.sharded``), the shards sharing one id clock and one lock so that every
        rank's control keeps the send order. ``wait_ms`` > 0: each control write is
        followed by ``WAIT 1 wait_ms`` (``bus.replication``). ``script``: ``send_batch``
        in one EVALSHA where the server and the user allow it (``bus.batch_script``);
        False, or on a cluster shard, the WATCH/MULTI/EXEC transaction. ``ingest_procs``
        > 0: the upstream streams are read, verified and dead-lettered by that many
        reader processes (``bus.ingest``), each running ``ingest_setup`` first (its
        logging); 0 reads them on the calling thread."""
        self.keys = run if isinstance(run, RunKeys) else RunKeys(run)
        self.client = client
        self.signing = keys
        self.config = config or StreamsConfig()
        self.shard = shard
        self._bcast = self.keys.broadcast_of_shard(shard)
        self._dlq = self.keys.dlq_of_shard(shard)
        self._lock = lock if lock is not None else threading.RLock()
        #: what the loop, the trimmer and a sender thread share besides the sends: the
        #: ranks' read positions, the owed entries, the tops. Never held across a round
        #: trip, so a heartbeat read does not wait for a send's (taken after ``_lock``,
        #: never before it).
        self._state_lock = threading.Lock()
        self._clock = clock if clock is not None else IdClock()
        self._seqs: dict[str, int] = {}
        #: the last id written per control stream (the trimmer's margin)
        self._tops: dict[str, EntryId] = {}
        self._ranks: dict[str, str] = {}
        #: rank -> [ctl:<r>, broadcast] ids it said it read (heartbeats)
        self._reads: dict[int, list[EntryId]] = {}
        #: rank -> when its last heartbeat with read positions came (``monotonic``)
        self._reported_at: dict[int, float] = {}
        #: when each rank first said where it had read (its runtime had started)
        self._reading_since: dict[int, float] = {}
        #: the clock of ``overdue`` (sends and reports; a test may replace it)
        self.monotonic: Callable[[], float] = time.monotonic
        #: control stream -> entries written and not yet read by every rank it is for
        self._unread: dict[str, collections.deque[tuple[EntryId, str, float]]] = {}
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
            name="coordinator.reader" if shard is None else f"coordinator.reader.s{shard}",
            where=where,
            dlq=self._dlq,
        )
        #: host agents' fold streams (``add_fold``)
        self.folds = FoldRoutes(self._verifiers, self._reader.seqs)
        self._ingest: IngestPool | None = None
        if ingest_procs > 0:
            self._ingest = IngestPool(
                client,
                ingest_procs,
                group=COORDINATOR_GROUP,
                consumer=COORDINATOR_GROUP,
                config=self.config,
                name="coordinator.ingest" if shard is None else f"coordinator.ingest.s{shard}",
                where=where,
                dlq=self._dlq,
                child_setup=ingest_setup,
            )
        self._guard = (
            ReplicaGuard(client, self.keys.fence(shard), wait_ms, self._link)
            if wait_ms > 0
            else None
        )
        #: the connection the sends go out on, under ``_lock`` (``bus.lane``)
        self._lane = Lane(client)
        #: each control stream's XADD head, packed once (``bus.resp``)
        self._packers: dict[str, XaddPacker] = {}
        self.script = BatchScript(client, where, self._lane)
        if not script:
            self.script.off = "turned off by the caller"
        elif named_user(client) is not None:
            self.script.off = "a named Redis user (the per-run ACL users run no scripts)"
        elif shard is not None:
            # Untried there: a failover's redirects and NOSCRIPT on the promoted replica
            # have not been tested together yet.
            self.script.off = "a Redis Cluster shard"
        with self._lock:
            self._link.call(lambda retry: self._raise_floor(self._bcast))
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

    def _note_read(self, hb: Heartbeat) -> None:
        """Where a rank says it has read its control streams (its MAC says it is the
        rank): the trimmer holds each control stream there."""
        if hb.ctl_read is None and hb.all_read is None:
            # Says nothing about reading: a rank still setting up (its runtime, the only
            # reader, has not started), or one from before the field.
            return
        with self._state_lock:
            known = self._reads.setdefault(hb.rank, [ZERO, ZERO])
            for i, text in enumerate((hb.ctl_read, hb.all_read)):
                if text is not None:
                    known[i] = max(known[i], parse_id(text))
            now = self.monotonic()
            self._reported_at[hb.rank] = now
            # What went out while it set up is owed from when it started to read, not
            # from when it was sent: a long setup is not a rank that does not read.
            self._reading_since.setdefault(hb.rank, now)

    def _owed(self, stream: str, eid: EntryId, msg: object, at: float) -> None:
        """Note a control entry written: the stream's new top, and an entry owed until
        every rank it is for says it read it (``overdue``)."""
        with self._state_lock:
            self._tops[stream] = eid
            owed = self._unread.setdefault(stream, collections.deque())
            owed.append((eid, type(msg).__name__, at))
            if len(owed) > MAX_OWED:
                owed.popleft()  # a bound on memory, not on what is checked in practice

    def overdue(self, budget_s: float, now: float | None = None) -> list[tuple[int, str, float]]:
        """Ranks that, in a heartbeat sent more than ``budget_s`` after an entry went
        out to them, still said they had not read it: (rank, the entry's type, its age
        in seconds), the oldest unread one each (DESIGN §3 rule 11: a rank alive but not
        taking what it is sent is named and handled like a death, not waited on in
        silence). A rank that stopped heartbeating (a killed process) is left to the
        heartbeat timeout, as is one that never reported."""
        now = self.monotonic() if now is None else now
        out: list[tuple[int, str, float]] = []
        with self._state_lock:
            ranks = [int(f) for f in self._ranks.values()]
            reported = {r: self._reads[r] for r in ranks if r in self._reads}
            bcast = self._unread.get(self._bcast, collections.deque())
            if reported:
                floor = min(pos[1] for pos in reported.values())
                while bcast and bcast[0][0] <= floor:
                    bcast.popleft()
            for r, (ctl_pos, all_pos) in sorted(reported.items()):
                mine = self._unread.get(self.keys.ctl(r), collections.deque())
                while mine and mine[0][0] <= ctl_pos:
                    mine.popleft()
                oldest = mine[0] if mine else None
                for entry in bcast:
                    if entry[0] > all_pos:
                        if oldest is None or entry[0] < oldest[0]:
                            oldest = entry
                        break
                said_at = self._reported_at.get(r, 0.0)
                if oldest is None:
                    continue
                owed_since = max(oldest[2], self._reading_since.get(r, oldest[2]))
                if said_at - owed_since > budget_s:
                    out.append((r, oldest[1], now - owed_since))
        return out

    def read_holds(self) -> dict[str, list[GroupHold]]:
        """Each control stream's holds: every rank of this bus at the entry it last
        said it read (from its start, before its first heartbeat). A rank that stopped
        reading holds for ``StreamsConfig.trim_stale_s``, then is passed over."""
        holds: dict[str, list[GroupHold]] = {}
        with self._state_lock:
            for field in list(self._ranks.values()):
                rank = int(field)
                ctl, bcast = self._reads.get(rank, (ZERO, ZERO))
                name = rank_group(rank)
                holds.setdefault(self.keys.ctl(rank), []).append(GroupHold(name, ctl))
                holds.setdefault(self._bcast, []).append(GroupHold(name, bcast))
        return holds

    def trim_tops(self) -> dict[str, EntryId]:
        """Each stream's newest verified id as this coordinator knows it."""
        with self._state_lock:
            tops = dict(self._tops)
            ups = list(self._ranks)
        ingest = self._ingest
        for up in [*ups, *self.folds.hosts]:
            if up in self.folds.fold_of:  # a folded rank's own stream goes unread
                continue
            tops[up] = self._reader.cursor.last_id(up) if ingest is None else ingest.last_id(up)
        return tops

    def trim_now(self, now: float | None = None) -> dict[str, EntryId]:
        """One trim pass (``bus.trim``); the trimmer thread calls it every interval."""
        plan = trim_pass(
            self.client,
            self._trimmer,
            self.trim_tops(),
            time.monotonic() if now is None else now,
            extra=self.read_holds(),
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
            # No group on the rank's control streams: the rank reads them with XREAD
            # (``bus.reader._CursorReader``), and a group would only be a queue another
            # reader could take from.
            with self._lock:
                self._raise_floor(self.keys.ctl(rank))

        with self._lock:
            self._link.call(op)
        with self._state_lock:
            self._verifiers[up] = key
            self._ranks[up] = str(rank)
        if up in self.folds.fold_of:
            return
        if self._ingest is not None:
            self._ingest.add_stream(up, key, str(rank))
        else:
            self._reader.add_stream(up)

    def add_fold(self, host: str, ranks: Iterable[int]) -> str:
        """Read ``ranks``' upstream from host agent ``host``'s fold stream instead of
        their own ``up:<r>`` (``bus.fold``); call before ``add_rank`` of those ranks.
        Returns the fold stream's key."""
        ranks = list(ranks)
        shards = {self.keys.shard_of(r) for r in ranks}
        if len(shards) > 1:
            raise ValueError(f"host {host}: ranks {ranks} live on several shards")
        stream = host_stream(self.keys.shard_prefix(shards.pop() if ranks else None), host)
        self.folds.add(stream, {r: self.keys.up(r) for r in ranks})
        if self._ingest is not None:
            # A reader process unpacks the fold and checks each item with its rank's key.
            self._ingest.add_fold(
                stream, {r: (self.keys.up(r), self.signing.rank(r)) for r in ranks}
            )
            return stream
        self._reader.folds[stream] = self.folds.check
        self._reader.add_stream(stream)
        return stream

    def send(self, rank: int, msg: ControlWire) -> None:
        self._write(self.keys.ctl(rank), str(rank), msg, self.signing.rank(rank))

    def broadcast(self, msg: ControlWire) -> None:
        self._write(self._bcast, BROADCAST, msg, self.signing.broadcast)

    def send_batch(self, items: Sequence[tuple[int | None, ControlWire]]) -> list[str]:
        """Every ``(rank, msg)`` (rank None: a broadcast) in one round trip, in order;
        returns the entry id of each.

        One core step often sends a message to every rank (StartEpoch, SyncNow): one
        XADD round trip each made a burst at 1,024 ranks take ~300 ms. Where the server
        and the user run scripts, one EVALSHA checks the tops and writes the batch
        (``bus.batch_script``, the same guarantees in one round trip instead of three).
        Otherwise the streams
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
                plan.append((self._bcast, BROADCAST, self.signing.broadcast))
            else:
                plan.append((self.keys.ctl(rank), str(rank), self.signing.rank(rank)))
        with self._lock:
            encoded = [entries.encode(msg) for _, msg in items]
            seqs = [self._next_seq(st, rf, sg) for st, rf, sg in plan]
            planned = [(*p, e, q) for p, e, q in zip(plan, encoded, seqs, strict=True)]
            streams = list(dict.fromkeys(st for st, _, _ in plan))
            tried: list[tuple[str, str, bytes]] = []
            ids: list[str] = []
            written: list[tuple[str, str, dict[bytes, bytes]]] = []

            def op(retry: bool) -> None:
                if self._guard is not None:
                    self._guard.recover()
                if retry and tried and landed(self.client, *tried[-1]):
                    return  # the lost reply was of a transaction that ran
                if self.script.off is None and write_batch(
                    self.script,
                    self._clock,
                    self.config.maxlen,
                    planned,
                    streams,
                    self._repair,
                    tried,
                    ids,
                    written,
                ):
                    return
                while True:
                    with self.client.pipeline(transaction=True) as pipe:
                        try:
                            pipe.watch(*streams)  # type: ignore[no-untyped-call]
                            if not self._above_tops(streams):
                                continue
                            pipe.multi()
                            ids.clear()
                            written.clear()
                            for (st, rf, sg), enc, seq in zip(plan, encoded, seqs, strict=True):
                                eid = format_id(self._clock.next(_now_ms()))
                                fields = entries.sign(sg, st, eid, enc, rf, seq)
                                if not ids:
                                    tried.append((st, eid, fields[entries.F_MAC]))
                                ids.append(eid)
                                written.append((st, eid, fields))
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
            sent_at = self.monotonic()
            for (stream_key, _, _), eid, (_, msg) in zip(plan, ids, items, strict=True):
                self._owed(stream_key, parse_id(eid), msg, sent_at)
            self._confirm(written)
            return list(ids)

    def _confirm(self, written: list[tuple[str, str, dict[bytes, bytes]]]) -> None:
        guard = self._guard
        if guard is not None and written:
            self._link.call(lambda retry: guard.written(written))

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
            written: list[tuple[str, str, dict[bytes, bytes]]] = []
            packer = self._packers.get(stream)
            if packer is None:
                packer = self._packers[stream] = XaddPacker(
                    stream, self.config.maxlen, entries.FIELD_ORDER
                )

            def op(retry: bool) -> None:
                if self._guard is not None:
                    self._guard.recover()
                if retry and tried and landed(self.client, stream, *tried[-1]):
                    return  # the lost reply was of an XADD that ran
                while True:
                    eid = format_id(self._clock.next(_now_ms()))
                    fields = entries.sign(signer, stream, eid, encoded, rank_field, seq)
                    tried.append((eid, fields[entries.F_MAC]))
                    written[:] = [(stream, eid, fields)]
                    try:
                        self._lane.call_packed(packer.pack(eid, fields))
                        self._owed(stream, parse_id(eid), msg, self.monotonic())
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
            self._confirm(written)

    def _repair(self, stream: str, floor: EntryId | None = None) -> None:
        repair_stream(
            self.client,
            stream,
            self._dlq,
            floor=self._clock.last if floor is None else floor,
            now_ms=_now_ms(),
            by="coordinator",
        )

    @property
    def behind(self) -> bool:
        """The last ``read_upstream`` may have left entries waiting (``GroupCursor.behind``,
        ``IngestPool.behind``): the coordinator is behind its ranks' streams."""
        if self._ingest is not None:
            return self._ingest.behind
        return self._reader.cursor.behind

    def read_upstream(self, block_ms: int) -> list[Delivery]:
        if self._ingest is not None:
            # the readers dead-letter and repair foreign entries themselves
            try:
                out = self._ingest.read(block_ms)
            except IngestHung as exc:
                # the read's deliveries ride on the exception: their heartbeats still count
                for d in exc.deliveries:
                    if type(d.msg) is Heartbeat:
                        self._note_read(d.msg)
                raise
            except IngestFailed as exc:
                log.error("bus_ingest_in_thread", reason=str(exc), action="reading in-thread")
                self._ingest.hand_over(self._reader)
                for stream in self.folds.hosts:
                    self._reader.folds[stream] = self.folds.check
                self._ingest = None
                out = exc.deliveries
            for d in out:
                if type(d.msg) is Heartbeat:
                    self._note_read(d.msg)
            return out
        out = self._reader.read_parsed(block_ms, self._verifiers, wire.UPSTREAM, self._ranks)
        for d in out:
            if type(d.msg) is Heartbeat:
                self._note_read(d.msg)
        if self._reader.foreign:
            # A rank's publisher waits on a stream wedged by a foreign entry; only the
            # coordinator may remove it.
            streams, self._reader.foreign = self._reader.foreign, set()
            for stream in sorted(streams):
                floor = self._reader.cursor.last_id(stream)

                def op(retry: bool, s: str = stream, f: EntryId = floor) -> None:
                    self._repair(s, f)

                # the lock: on a cluster each shard's reader runs on its own thread
                with self._lock:
                    self._link.call(op)
        return out

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        if self._ingest is not None:
            self._ingest.queue_acks(deliveries)
        else:
            self._reader.queue_acks(self.folds.acks(deliveries))

    def flush_acks(self) -> None:
        if self._ingest is not None:
            self._ingest.flush_acks()
        else:
            self._reader.flush_acks()

    @property
    def ingest(self) -> IngestPool | None:
        """The reader processes of ``ingest_procs`` (None: ingest on the calling thread)."""
        return self._ingest

    @property
    def reconnects(self) -> int:
        return self._link.reconnects + self._reader.link.reconnects

    def close(self) -> None:
        self._trim_stop.set()
        if self._trim_thread is not None:
            self._trim_thread.join(5.0)
        if self._ingest is not None:
            self._ingest.close()
        self._reader.close()
        self._link.close()
        with self._lock:
            self._lane.close()
        gc.unfreeze()
