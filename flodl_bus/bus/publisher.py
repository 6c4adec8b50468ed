"""The rank's publisher: the sole writer of ``up:<r>`` (DESIGN §3 rule 2).

One upstream stream per rank, written only by this thread, in ``publish()`` order (FIFO
queue, one thread, each batch one WATCH/MULTI/EXEC transaction above the stream's top, so
a foreign entry cannot split it). A retry after a lost reply first asks whether the
batch's first entry, same id and same MAC, landed (rule 3).

Per-step reports linger (``StreamsConfig.publish_linger_s``) so that one transaction
carries many of them: the thread sleeps through the linger without waking per message,
and a message the coordinator acts on (anything not in ``LAZY``: a step's ``Batch`` and
``LrUpdate``, a ``Heartbeat``) ends it, so it and everything queued before it go at once.
While steps flow, the thread sleeps a linger after each write before it looks again,
rather than being woken by the next report only to sleep then: a wake of another thread
is what costs the training thread most (BENCHMARKS.md, 2026-12-06).
With ``publish_first_step`` (a world of one), so does the first ``Batch`` after such a
message: a plan's first step is what its coordinator sends it its next plan on; the
steps after it are not news, until the next such message.
With ``publish_epoch_end_lazy`` (a world of one, which holds its next plan while it
trains), a plan's ``MetricsMsg`` and an ``EvalResult`` wait too, for that first step:
an epoch's end is then one write, not three (each a wake of this thread and of the
training thread's GIL). The rank calls ``hurry`` before it blocks on its control, so a
message its coordinator must answer never waits out a linger on a rank that waits for
the answer.
Order is never changed: a batch is always a prefix of the queue.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Final

import redis

from flodl_bus.bus import entries
from flodl_bus.bus.connection import BusClosed, Link
from flodl_bus.bus.foreign import writer_limit
from flodl_bus.bus.ids import ZERO, EntryId, IdClock, format_id, parse_id
from flodl_bus.bus.resp import XaddPacker, command
from flodl_bus.bus.stream_ops import (
    BusError,
    StreamsConfig,
    _now_ms,
    landed,
    last_seq,
    log,
    stream_top,
)
from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import Batch, EvalResult, Heartbeat, LrUpdate, MetricsMsg
from flodl_bus.protocol.signing import MacKey

_STOP: Final = object()
_MULTI: Final = command("MULTI")
_EXEC: Final = command("EXEC")
_UNWATCH: Final = command("UNWATCH")


def _top_of(info: object) -> EntryId:
    """``last-generated-id`` of a raw XINFO STREAM reply (a flat list, or a map over
    RESP3)."""
    if isinstance(info, dict):
        raw = info.get(b"last-generated-id", info.get("last-generated-id"))
    else:
        items = list(info) if isinstance(info, list | tuple) else []
        raw = None
        for k, v in zip(items[::2], items[1::2], strict=False):
            if k in (b"last-generated-id", "last-generated-id"):
                raw = v
                break
    if raw is None:
        raise redis.exceptions.ResponseError("XINFO STREAM gave no last-generated-id")
    return parse_id(raw)


#: What may wait for company (see the module's docstring): the coordinator's next
#: decision never hangs on one of these alone (a plan's end is told by its MetricsMsg,
#: a round's by its SyncAck, liveness has a timeout of seconds).
LAZY: Final[frozenset[type]] = frozenset({Batch, LrUpdate, Heartbeat})
#: What also waits with ``publish_epoch_end_lazy``: news (the next ``Batch`` goes at
#: once after one), but nothing a rank that trains on waits for.
EPOCH_END: Final[frozenset[type]] = frozenset({MetricsMsg, EvalResult})


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
        #: set by every message that must not linger (and by flush and close)
        self._urgent = threading.Event()
        #: whether the next ``Batch`` is the first after a message the coordinator acts
        #: on (publish is called by the training and heartbeat threads; a race between
        #: them costs at most one early or late write, never order or a message)
        self._news = config.publish_first_step
        self._first_step = config.publish_first_step
        #: the types that wait for company (``LAZY``, and ``EPOCH_END`` where asked)
        self._lazy = LAZY | EPOCH_END if config.publish_epoch_end_lazy else LAZY
        #: whether ``hurry`` does anything (see there)
        self._hurries = config.publish_epoch_end_lazy
        self._closed = False
        self._closing = threading.Event()
        #: the first id and mac of the last batch tried (a lost reply: did it land?)
        self._tried: tuple[str, bytes] | None = None
        self._blocked_since: float | None = None
        #: the publisher thread's own connection (redis-py's ``Connection``; untyped there)
        self._conn: Any = None
        #: the stream's top read under the watch that connection holds (``_commit``)
        self._armed: EntryId | None = None
        #: the next transaction's WATCH and look at the top, packed once
        self._arm = command("WATCH", stream) + command("XINFO", "STREAM", stream)
        self._xadd = XaddPacker(stream, config.maxlen, entries.FIELD_ORDER)
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
        kind = type(msg)
        if kind not in self._lazy:
            self._news = self._first_step
            self._urgent.set()
        elif kind is Batch:
            if self._news:
                self._news = False
                self._urgent.set()
        elif kind in EPOCH_END:
            self._news = self._first_step

    def hurry(self) -> None:
        """Write what waits now, without waiting for it: the rank is about to block on
        its control, whose next message may answer what waits. Set even when the queue
        looks empty: the thread may hold what it took, lingering; an event left set
        costs at most one early write. Only with ``publish_epoch_end_lazy``: otherwise
        nothing the coordinator must answer ever waits, and that early write (a plan's
        first step report) makes a sync round fire sooner, so a run makes more of them
        (cpu-sync x2 on two cores: 101-119 rounds against 83-92, 1.6-1.9 s against 1.4-1.6)."""
        if self._hurries:
            self._urgent.set()

    def flush(self, timeout: float) -> bool:
        if not self._thread.is_alive():
            return self._q.empty() and self.error is None
        done = threading.Event()
        self._q.put(done)
        self._urgent.set()
        # After a failure the thread still answers flushes but drops messages.
        return done.wait(timeout) and self.error is None

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._q.put(_STOP)
        self._urgent.set()
        self._thread.join(timeout)
        self._closing.set()
        self.link.close()
        self._thread.join(1.0)
        if self._conn is not None and not self._thread.is_alive():
            self._conn.disconnect()
            self._conn = None

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
        linger = self.config.publish_linger_s
        urgent = self._urgent
        lazy = self._lazy
        #: the last write was of a run of step reports: more are likely on their way
        flowing = False
        while True:
            lingered = False
            if flowing:
                # Sleep out a linger before looking again, instead of blocking on the
                # queue, whose next put (the next step's report) would wake us only to
                # sleep the linger then: one wake a write fewer while steps flow. What
                # came meanwhile waited at most the linger and goes now.
                urgent.wait(linger)
                with contextlib.suppress(queue.Empty):
                    first = get_nowait()
                    lingered = True
            if not lingered:
                first = get()
                if linger > 0 and type(first) in lazy:
                    # Asleep, not woken by each put: the training thread's publishes cost
                    # it no GIL hand-over. An urgent put wakes us; one already queued left
                    # the event set, so the wait returns at once.
                    urgent.wait(linger)
            batch = [first]
            # Cleared before the drain below: an urgent message put from here on is
            # either drained now or sets the event again for the next round.
            urgent.clear()
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
            flowing = linger > 0 and bool(msgs) and type(msgs[-1]) in lazy

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
        stream's top is read under WATCH, so the XADDs cannot be refused.

        One round trip a batch, on a connection of our own, the commands packed and the
        replies read raw: after its EXEC every transaction arms the next one (WATCH and
        the top, in the same write), so a batch sends MULTI, its XADDs, EXEC and the next
        WATCH + XINFO, and reads their replies once. The watch is held between batches:
        whatever writes or trims the stream meanwhile makes the next EXEC answer nil,
        and that batch is renumbered above the top read after it. Neither the
        coordinator's XREADGROUP nor its XACK fires the watch (only a change to the
        stream does). Every round trip is a GIL hand-over the training thread pays for
        (issue 27): the transaction took two a batch, redis-py's pipeline three. Any
        error leaves the connection mid-transaction, so it is dropped and ``Link``
        retries on a fresh one, which is armed first."""
        if retry and self._tried is not None and landed(self.client, self.stream, *self._tried):
            return  # the lost reply was of a transaction that ran
        conn = self._connection()
        stream = self.stream
        try:
            top = self._armed
            self._armed = None
            if top is None:
                conn.send_packed_command([self._arm])
                top = self._read_arm(conn)
            while True:
                if not self._follow(top):
                    conn.send_packed_command([_UNWATCH + self._arm])
                    conn.read_response()
                    top = self._read_arm(conn)
                    continue
                now = _now_ms()
                packet = [_MULTI]
                for seq, encoded in batch:
                    eid = format_id(self.clock.next(now))
                    fields = entries.sign(self.key, stream, eid, encoded, self.rank_field, seq)
                    if seq == batch[0][0]:
                        self._tried = (eid, fields[entries.F_MAC])
                    packet.append(self._xadd.pack(eid, fields))
                packet += (_EXEC, self._arm)
                # Packed here, not by redis-py (``bus.resp``): its packing was most of the
                # publisher's time under the GIL, about 8 µs an entry.
                conn.send_packed_command([b"".join(packet)])
                # MULTI's OK, then QUEUED per XADD: a command refused while queuing (OOM)
                # raises here, EXEC refused whole (EXECABORT) raises below: both are
                # weather to ``Link``, and nothing of the batch ran.
                for _ in range(len(batch) + 1):
                    conn.read_response()
                done = conn.read_response() is not None
                # The next WATCH was queued behind EXEC: read it in either case, so the
                # connection is armed with the top as it stands after this EXEC.
                top = self._read_arm(conn)
                if done:
                    self._armed = top
                    return
                # EXEC answered nil: the stream was written or trimmed since the watch
                # (nothing of ours landed). Renumber above the top read after it.
        except BaseException:
            self._armed = None
            conn.disconnect()
            raise

    @staticmethod
    def _read_arm(conn: Any) -> EntryId:
        """The replies of WATCH and XINFO STREAM: the stream's top (ZERO: no stream)."""
        conn.read_response()
        try:
            return _top_of(conn.read_response())
        except redis.exceptions.ResponseError as exc:
            if "no such key" not in str(exc).lower():
                raise
            return ZERO

    def _connection(self) -> Any:
        """The publisher thread's own connection (WATCH state is per connection).

        Made by the pool but never lent to it: ``pool.disconnect()`` from another
        thread (the reader's ``Link`` after a MOVED) would drop the socket that holds
        the armed watch, and redis-py reconnects on the next send without a word, so an
        EXEC would run unwatched. Only this thread closes it (``_commit`` after any
        error, which disarms; ``close`` once the thread is gone)."""
        if self._conn is None:
            self._conn = self.client.connection_pool.make_connection()
        return self._conn

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
