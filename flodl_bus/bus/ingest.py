"""The coordinator's upstream ingest spread over K reader processes (``--ingest-procs K``).

One thread reading, authenticating and decoding every rank's upstream is the coordinator's
limit at high rank counts (``bench path``). Here K processes each own a fixed subset of
the ``up:<r>`` streams (round-robin in the order ranks are added) and run the same
``_GroupReader`` the in-thread ingest uses: XREADGROUP, ``GroupCursor``, seq and replay
checks, MAC verification, a full decode, dead-lettering with the reason, foreign-entry
repair. What passes goes to the main process as one blob per read: the verified ``type``
and ``body`` of each entry, not the decoded message (pickling message objects cost more
than decoding them again: ~10 µs against ~3 µs a message). The main process decodes,
hands the deliveries to the one ordered consumer (the sans-IO core, whose order is what
is recorded, so replay stays exact), and acks through the owning reader.

How DESIGN §3 is kept:

* Per-rank order: a stream belongs to exactly one reader, which sends its entries in
  read order over one pipe; the main process keeps that order within every blob and
  across the blobs of a reader.
* No loss: an entry is acked only after ``ack`` (the core dispatched it): the main
  process sends the ids to the owning reader, which acks them on its next read.
* No duplicate: each reader's cursor starts above the last entry the main process got
  of its streams, so pending entries handed out before are not read again; a
  ``GroupCursor`` drops redeliveries as in-thread.
* A reader that dies (a crash, SIGKILL, OOM) is seen at once (its process sentinel is
  part of every wait) and restarted from its pending entries: the new process starts
  each stream after the last entry the main process received (and its seq, so replay
  protection holds across the restart), acks the pending entries the main process had
  asked its predecessor to ack, and re-reads every other pending entry. Restarting is
  what a user expects of one crashed helper. A reader that keeps dying
  (``MAX_RESTARTS`` within ``RESTART_WINDOW_S``) is a fault restarting will not cure:
  ``read`` raises ``IngestFailed`` with the reason, and the coordinator's bus goes on
  reading on its own thread from where the readers were (``hand_over``), as with
  ``--ingest-procs 0``: the run goes on, slower, and the log says why.
* A reader alive but hung (stopped, deadlocked) would leave its ranks unheard while the
  rest of the run goes on: each reader counts its turns of the read loop (at least one
  every ``_READ_BLOCK_MS`` plus a Redis round trip) in memory the main process reads;
  one that makes no turn and sends nothing for ``STALL_S`` is killed (its successor
  starts as a dead one's does, so the ranks' last words are still heard) and ``read``
  raises ``IngestHung`` naming it and its ranks: the coordinator stops the run in order
  and exits ``FAILED``. A hung helper is a fault to look at, not one to restart past.

A host agent's fold stream (``bus.fold``) is one stream like the others, owned by one
reader: that reader unpacks each entry and checks every item with its rank's key and
seq, and sends the items on as from the ranks' own ``up:<r>`` (synthetic ids), each
rank's last seq beside them; an item's ack is its folded entry's. A successor, or the
coordinator's thread after ``hand_over``, starts with those seqs, so an item folded
again is still a replay.

Reader processes log at the coordinator's console level (``--log-level``).

The readers are spawned, not forked (the coordinator runs threads whose locks a fork
would copy held), so a program that builds a coordinator bus with reader processes
guards its entry point with ``if __name__ == "__main__":``, as ``multiprocessing``
requires of every spawning program; ``flodl-bus coordinator`` does.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing as mp
import os
import pickle
import signal
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Final

import redis

from flodl_bus.bus import entries
from flodl_bus.bus.api import Delivery, IngestHung
from flodl_bus.bus.fold import FoldRoutes, Item, fold_entry_of
from flodl_bus.bus.foreign import repair_stream
from flodl_bus.bus.ids import ZERO, EntryId, format_id, parse_id
from flodl_bus.bus.reader import _GroupReader
from flodl_bus.bus.stream_ops import BusError, StreamsConfig, _now_ms, log
from flodl_bus.protocol import wire
from flodl_bus.protocol.signing import Verifier

#: restarts of one reader within ``RESTART_WINDOW_S`` before the run is stopped
#: ``--ingest-procs auto``: reader processes from this world size on, on a host with at
#: least ``AUTO_MIN_CORES`` cores. Measured on a 16-core host (BENCHMARKS.md, "Reader
#: processes, a record process"): 4 readers cut a 1,024-rank epoch from +265% to +108%
#: over the ideal; below a few hundred ranks one thread keeps up and the readers only
#: add processes (on 2 cores they are slower).
AUTO_MIN_RANKS: Final = 256
AUTO_MIN_CORES: Final = 8
AUTO_PROCS: Final = 4


def auto_procs(world_size: int, cores: int | None) -> int:
    """What ``--ingest-procs auto`` reads with at this world size on this host."""
    if world_size >= AUTO_MIN_RANKS and (cores or 1) >= AUTO_MIN_CORES:
        return AUTO_PROCS
    return 0


def procs_arg(text: str) -> int | None:
    """``--ingest-procs``: a count >= 0, or ``auto`` (None)."""
    if text.strip().lower() == "auto":
        return None
    try:
        k = int(text)
    except ValueError:
        k = -1
    if k < 0:
        raise ValueError(f"--ingest-procs: expected 'auto' or a count >= 0, got {text!r}")
    return k


MAX_RESTARTS: Final = 5
RESTART_WINDOW_S: Final = 60.0
#: a ready reader that neither turns its read loop nor sends anything for this long is
#: hung (``IngestPool.stall_s`` is this unless ``FLODL_INGEST_STALL_S`` or a caller set
#: another: the end-to-end test does not wait 30 s)
STALL_S: Final = 30.0
ENV_STALL: Final = "FLODL_INGEST_STALL_S"


def stall_s(env: Mapping[str, str] | None = None) -> float:
    """``STALL_S``, or ``FLODL_INGEST_STALL_S`` when that is a positive number."""
    raw = (os.environ if env is None else env).get(ENV_STALL, "")
    try:
        value = float(raw)
    except ValueError:
        return STALL_S
    return value if value > 0 else STALL_S


#: a reader's XREADGROUP BLOCK (acks and a stop wait for the read in progress)
_READ_BLOCK_MS: Final = 250
#: blobs taken from one reader per ``read`` (the rest wait for the next one)
_BLOBS_PER_READ: Final = 64
#: a blob's header: whether its read left entries waiting (``GroupCursor.behind``), and
#: how many entries it holds (the main process's budget counts them undecoded)
_HEADER: Final = struct.Struct("<BI")
#: kwargs of a connection pool that do not cross a process boundary (made afresh there)
_LOCAL_KWARGS: Final = frozenset({"himport_registry"})
# Spawned, not forked: the coordinator runs threads (trimmer, recorder, heartbeats) whose
# locks a fork would copy held.
_CTX: Final = mp.get_context("spawn")


class IngestFailed(BusError):
    """A reader process kept dying; the pool stops (``IngestPool.hand_over``).
    ``deliveries``: what the read that found it dead received first, to dispatch (the
    streams' positions are already past them)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.deliveries: list[Delivery] = []


@dataclass(frozen=True)
class _Spec:
    """What a reader process needs to start (crosses the process boundary once)."""

    connection_class: type
    connection_kwargs: dict[str, Any]
    group: str
    consumer: str
    config: StreamsConfig
    name: str
    where: str
    dlq: str
    channel: str
    #: run first in the reader process: the caller's logging set up there (a picklable
    #: callable; the bus imports no logging setup of its own, which lives above it)
    child_setup: Callable[[], None] | None = None


@dataclass
class _Stream:
    verifier: Verifier | None
    rank_field: str
    reader: int
    #: the last entry (id, seq) the main process received of this stream
    last_id: str = ""
    last_seq: int = 0
    #: the last id the main process asked the owning reader to ack
    acked: str = ""
    #: a host agent's fold stream (``bus.fold``): rank -> (its ``up:<r>``, its key)
    fold: dict[int, tuple[str, Verifier]] | None = None
    #: ... and the last seq the main process received of each of those ranks
    item_seqs: dict[str, int] = field(default_factory=dict)


#: rank -> (its ``up:<r>``, its key, start after seq): the ranks a fold stream carries
_FoldStart = dict[int, tuple[str, Verifier, int]]
#: (stream, verifier, rank field, start after id, start after seq, ack pending through
#: id, the fold's ranks or None)
_StreamStart = tuple[str, Verifier | None, str, str, int, str, _FoldStart | None]


@dataclass
class _Proc:
    proc: BaseProcess
    data: Connection
    cmd: Connection
    #: the reader's count of read-loop turns (shared memory; only the reader writes it)
    turns: Any
    #: the count last seen, and when the reader was last seen alive (a turn, a blob)
    seen: int = 0
    alive_at: float = 0.0


def _ack_through(reader: _GroupReader, stream: str, last: str) -> None:
    """Ack this consumer's pending entries of ``stream`` up to ``last``: a dead
    predecessor was asked to ack them and may not have."""
    client = reader.client
    while True:
        rows = client.xpending_range(
            stream, reader.group, min="-", max=last, count=1000, consumername=reader.consumer
        )
        if not rows:
            return
        client.xack(stream, reader.group, *[r["message_id"] for r in rows])
        if len(rows) < 1000:
            return


def _say_caught_up(data: Connection) -> bool:
    """A blob of no entries that says its reader is not behind; False: the pipe is gone."""
    try:
        data.send_bytes(_HEADER.pack(0, 0) + pickle.dumps(([], [], [], [], {}, {}), protocol=5))
    except (BrokenPipeError, OSError):
        return False
    return True


def _reader_main(
    spec: _Spec, data: Connection, cmd: Connection, start: list[_StreamStart], turns: Any
) -> None:
    """A reader process: read its streams, send what verifies, ack what it is told."""
    # Ctrl-C reaches the whole process group; the main process decides when readers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.child_setup is not None:
        spec.child_setup()
    pool = redis.ConnectionPool(connection_class=spec.connection_class, **spec.connection_kwargs)
    reader = _GroupReader(
        redis.Redis(connection_pool=pool),
        [],
        group=spec.group,
        consumer=spec.consumer,
        ordered=False,
        config=spec.config,
        name=spec.name,
        where=spec.where,
        dlq=spec.dlq,
    )
    verifiers: dict[str, Verifier] = {}
    rank_fields: dict[str, str] = {}
    # Host agents' fold streams: each item is checked with its rank's key and seq, as
    # the coordinator's own reader does (``bus.fold``).
    fold_keys: dict[str, Verifier] = {}
    routes = FoldRoutes(fold_keys, reader.seqs)
    lock = threading.Lock()
    added: list[_StreamStart] = list(start)
    stop = threading.Event()
    woken = threading.Event()

    def commands() -> None:
        try:
            while True:
                kind, arg = cmd.recv()
                if kind == "ack":
                    reader.queue_ack_ids(arg)
                elif kind == "add":
                    with lock:
                        added.append(arg)
                    woken.set()
                else:
                    break
        except (EOFError, OSError):
            pass  # the main process is gone: stop as if told to
        stop.set()
        woken.set()

    threading.Thread(target=commands, name="flodl-bus-ingest-cmd", daemon=True).start()
    # A short BLOCK: acks and a stop wait for the read in progress.
    block_ms = min(spec.config.max_block_ms, _READ_BLOCK_MS)
    hello = True
    #: the flag of the last blob sent: a reader that catches up says so even with
    #: nothing to send, or the main process would go on taking it for behind (as it
    #: takes a reader that has not yet said anything)
    said_behind = True
    while not stop.is_set():
        turns.value += 1  # alive: the main process tells a hung reader by this
        with lock:
            new, added[:] = list(added), []
        for stream, verifier, rank_field, after, seq, acked, fold in new:
            if fold is None:
                assert verifier is not None
                verifiers[stream] = verifier
                rank_fields[stream] = rank_field
            else:
                for _rank, (up, key, item_seq) in fold.items():
                    fold_keys[up] = key
                    if item_seq:
                        reader.seqs[up] = item_seq
                routes.add(stream, {r: up for r, (up, _, _) in fold.items()})
                reader.folds[stream] = routes.check
            reader.add_stream(stream)
            if after:
                reader.cursor.skip(stream, parse_id(after))
                if fold is None:
                    reader.seqs[stream] = seq
            if acked:

                def ack_old(retry: bool, s: str = stream, a: str = acked) -> None:
                    _ack_through(reader, s, a)

                reader.link.call(ack_old)
        if hello:
            # an empty message: up, its streams' groups made and its pending acks done
            def groups(retry: bool) -> None:
                reader._ensure_groups()

            reader.link.call(groups)
            data.send_bytes(b"")
            hello = False
        if not reader.cursor.streams:
            if said_behind:  # nothing to read is nothing left behind
                if not _say_caught_up(data):
                    break
                said_behind = False
            woken.wait(0.2)
            woken.clear()
            continue
        items: list[Item] = []
        got = reader.read_checked(block_ms, verifiers, spec.channel, rank_fields, items=items)
        behind = reader.cursor.behind
        if reader.foreign:
            # A rank's publisher waits on a stream wedged by a foreign entry; only the
            # coordinator's credential may remove it, and this process holds it.
            streams, reader.foreign = reader.foreign, set()
            for stream in sorted(streams):
                floor = reader.cursor.last_id(stream)

                def repair(retry: bool, s: str = stream, f: EntryId = floor) -> None:
                    repair_stream(
                        reader.client, s, spec.dlq, floor=f, now_ms=_now_ms(), by="coordinator"
                    )

                reader.link.call(repair)
        if not got and not items:
            if said_behind and not behind:
                if not _say_caught_up(data):
                    break
                said_behind = False
            continue
        names: list[str] = []
        ids: list[str] = []
        types: list[str] = []
        bodies: list[bytes] = []
        tops: dict[str, tuple[str, int]] = {}
        for r in got:
            eid = format_id(r.entry_id)
            p: entries.Parsed = r.parsed  # type: ignore[assignment]
            names.append(r.stream)
            ids.append(eid)
            types.append(p.type)
            bodies.append(r.fields[entries.F_BODY])  # type: ignore[index]
            tops[r.stream] = (eid, p.seq)
        # A folded item goes as from its rank's own stream, under its synthetic id; the
        # fold stream's top is its entry, and each rank's seq travels beside it.
        item_seqs: dict[str, int] = {}
        for it in items:
            names.append(it.stream)
            ids.append(format_id(it.entry_id))
            types.append(it.fields[entries.F_TYPE].decode())
            bodies.append(it.fields[entries.F_BODY])
            item_seqs[it.stream] = int(it.fields[entries.F_SEQ])
        for stream in reader.folds:
            top = reader.cursor.last_id(stream)
            if top != ZERO:
                tops[stream] = (format_id(top), 0)
        try:
            blob = pickle.dumps((names, ids, types, bodies, tops, item_seqs), protocol=5)
            data.send_bytes(_HEADER.pack(behind, len(names)) + blob)
            said_behind = behind
        except (BrokenPipeError, OSError):
            break
    reader.close()


class IngestPool:
    """The main process's side: K reader processes, their pipes, and the acks owed."""

    def __init__(
        self,
        client: redis.Redis,
        procs: int,
        *,
        group: str,
        consumer: str,
        config: StreamsConfig,
        name: str,
        where: str,
        dlq: str,
        channel: str = wire.UPSTREAM,
        child_setup: Callable[[], None] | None = None,
    ) -> None:
        """``child_setup``: run first in each reader process (the coordinator's console
        logging at its ``--log-level``)."""
        if procs < 1:
            raise ValueError("an ingest pool needs at least one reader process")
        cpool = client.connection_pool
        # A bare ``object()`` is redis-py's "not given" marker, which pickling would
        # turn into a value; left out, the other side takes its own default.
        kwargs = {
            k: v
            for k, v in cpool.connection_kwargs.items()
            if k not in _LOCAL_KWARGS and type(v) is not object
        }
        #: entries one ``read`` takes from a reader before it moves on (the rest wait in
        #: its pipe): a read of every pipe's fill at 4,096 ranks held 24,000 entries and
        #: the loop ticked once in 18 s. Each reader reads as much at a time, so the loop
        #: takes about ``read_total`` entries a read, as it does reading in-thread.
        self._share = max(1, config.read_total // procs)
        reader_config = dataclasses.replace(config, read_total=self._share)
        self._spec = _Spec(
            cpool.connection_class, kwargs, group, consumer, reader_config, name, where, dlq,
            channel, child_setup,
        )  # fmt: skip
        #: how long a ready reader may make no turn and send nothing before it is hung
        self.stall_s = stall_s()
        self.procs = procs
        self._streams: dict[str, _Stream] = {}
        #: a folded rank's ``up:<r>`` -> the fold stream that carries it
        self._fold_of: dict[str, str] = {}
        self._members: list[list[str]] = [[] for _ in range(procs)]
        self._acks: list[dict[str, list[str]]] = [{} for _ in range(procs)]
        self._deaths: list[collections.deque[float]] = [collections.deque() for _ in range(procs)]
        #: reader processes started again after one died
        self.restarts = 0
        self._closed = False
        self._ready = [False] * procs
        #: each reader's last word on whether its streams hold entries it has not sent
        #: (behind until its first read says otherwise)
        self._behind = [True] * procs
        #: whether the last ``read`` left blobs in a pipe (more than it takes at once)
        self._left = False
        #: blobs that came while waiting for readers to start
        self._held: list[bytes] = []
        self._readers: list[_Proc] = [self._start(j) for j in range(procs)]
        log.info("bus_ingest_started", reader=name, procs=procs, pids=self.pids)

    # ------------------------------------------------------------------ processes

    def _start(self, j: int) -> _Proc:
        data_r, data_w = _CTX.Pipe(duplex=False)
        cmd_r, cmd_w = _CTX.Pipe(duplex=False)
        start: list[_StreamStart] = [self._start_of(s) for s in self._members[j]]
        turns = _CTX.RawValue("Q", 0)
        proc = _CTX.Process(
            target=_reader_main,
            args=(self._spec, data_w, cmd_r, start, turns),
            name=f"{self._spec.name}.{j}",
            daemon=True,
        )
        self._ready[j] = False
        self._behind[j] = True  # until it says otherwise: a successor re-reads pending
        proc.start()
        data_w.close()
        cmd_r.close()
        return _Proc(proc, data_r, cmd_w, turns, 0, time.monotonic())

    def _start_of(self, stream: str) -> _StreamStart:
        s = self._streams[stream]
        fold: _FoldStart | None = None
        if s.fold is not None:
            fold = {r: (up, key, s.item_seqs.get(up, 0)) for r, (up, key) in s.fold.items()}
        return (stream, s.verifier, s.rank_field, s.last_id, s.last_seq, s.acked, fold)

    @property
    def pids(self) -> list[int | None]:
        return [r.proc.pid for r in self._readers]

    def _restart(self, j: int) -> None:
        old = self._readers[j]
        old.proc.join(5.0)
        if old.proc.is_alive():
            # its pipe broke but it lives on: two readers of one stream would split it
            old.proc.kill()
            old.proc.join(5.0)
        code = old.proc.exitcode
        old.data.close()
        old.cmd.close()
        now = time.monotonic()
        deaths = self._deaths[j]
        deaths.append(now)
        while deaths and deaths[0] < now - RESTART_WINDOW_S:
            deaths.popleft()
        log.error(
            "bus_ingest_reader_died",
            reader=f"{self._spec.name}.{j}",
            exitcode=code,
            streams=len(self._members[j]),
            deaths_in_window=len(deaths),
        )
        if len(deaths) > MAX_RESTARTS:
            raise IngestFailed(
                f"ingest reader {self._spec.name}.{j} died {len(deaths)} times within "
                f"{RESTART_WINDOW_S:g} s (last exit code {code}): not restarting it again"
            )
        self._readers[j] = self._start(j)
        self.restarts += 1
        log.warning("bus_ingest_reader_restarted", reader=f"{self._spec.name}.{j}")

    # ------------------------------------------------------------------ streams

    def add_stream(self, stream: str, verifier: Verifier, rank_field: str) -> None:
        self._add(stream, _Stream(verifier, rank_field, len(self._streams) % self.procs))

    def add_fold(self, stream: str, ranks: Mapping[int, tuple[str, Verifier]]) -> None:
        """A host agent's fold stream (``bus.fold``), carrying ``ranks`` (rank -> its
        ``up:<r>`` and key): its reader checks every item with its rank's key and seq,
        and hands each on as from the rank's own stream."""
        fold = dict(ranks)
        self._add(stream, _Stream(None, "host", len(self._streams) % self.procs, fold=fold))
        for up, _key in fold.values():
            self._fold_of[up] = stream

    def _add(self, stream: str, s: _Stream) -> None:
        if stream in self._streams:
            return
        self._streams[stream] = s
        self._members[s.reader].append(stream)
        self._send(s.reader, ("add", self._start_of(stream)))

    @property
    def behind(self) -> bool:
        """Entries may wait that the last ``read`` did not hand on: a pipe held more than
        one read takes, or a reader's last read filled its count (``GroupCursor.behind``)."""
        return self._left or any(self._behind)

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every reader process is up (False: not within ``timeout``).
        Nothing needs it (entries wait in Redis meanwhile); benches do not time a
        process start, and tests know when a reader can be killed mid-stream."""
        deadline = time.monotonic() + timeout
        while not all(self._ready):
            pending = [r.data for j, r in enumerate(self._readers) if not self._ready[j]]
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for conn in wait(pending, timeout=left):
                j = next(j for j, r in enumerate(self._readers) if r.data is conn)
                try:
                    blob = self._readers[j].data.recv_bytes()
                except (EOFError, OSError):
                    self._restart(j)
                    continue
                if blob:
                    self._behind[j] = bool(_HEADER.unpack_from(blob)[0])
                    self._held.append(blob)
                else:
                    self._ready[j] = True
        return True

    def last_id(self, stream: str) -> EntryId:
        s = self._streams.get(stream)
        return parse_id(s.last_id) if s is not None and s.last_id else ZERO

    def _send(self, j: int, msg: tuple[str, Any]) -> None:
        # Dead: the next wait sees its sentinel and restarts it with every stream it owns.
        with contextlib.suppress(BrokenPipeError, OSError):
            self._readers[j].cmd.send(msg)

    # ------------------------------------------------------------------ acks

    def queue_acks(self, deliveries: Sequence[Delivery]) -> None:
        streams = self._streams
        acks = self._acks
        fold_of = self._fold_of
        for d in deliveries:
            stream, eid = d.stream, d.entry_id
            host = fold_of.get(stream)
            if host is not None:
                # A folded item is acked as its folded entry, on the fold stream.
                stream, eid = host, format_id(fold_entry_of(parse_id(eid)))
            ids = acks[streams[stream].reader].setdefault(stream, [])
            if not ids or ids[-1] != eid:
                ids.append(eid)

    def flush_acks(self) -> None:
        """Hand the queued acks to their readers (each acks on its next read)."""
        for j, acks in enumerate(self._acks):
            if not acks:
                continue
            try:
                self._readers[j].cmd.send(("ack", acks))
            except (BrokenPipeError, OSError):
                continue  # dead: kept for its successor
            self._acks[j] = {}
            for stream, ids in acks.items():
                self._streams[stream].acked = ids[-1]

    # ------------------------------------------------------------------ reads

    def read(self, block_ms: int) -> list[Delivery]:
        self.flush_acks()
        deadline = time.monotonic() + max(0, block_ms) / 1000
        while True:
            out = self._read_once(max(0.0, deadline - time.monotonic()))
            # A reader's word that it caught up carries no entry: wait on for one, as a
            # blocking read does, rather than hand back an empty read early.
            if out or time.monotonic() >= deadline:
                return out

    def _read_once(self, timeout_s: float) -> list[Delivery]:
        readers = self._readers
        by_handle: dict[Any, int] = {}
        for j, r in enumerate(readers):
            by_handle[r.data] = j
            by_handle[r.proc.sentinel] = j
        ready = wait(list(by_handle), timeout=timeout_s)
        blobs, self._held = self._held, []
        dead: set[int] = set()
        left = False
        for handle in ready:
            j = by_handle[handle]
            if j in dead:
                continue
            r = readers[j]
            taken = 0
            try:
                for _ in range(_BLOBS_PER_READ):
                    if taken >= self._share:
                        left = left or r.data.poll()
                        break
                    if not r.data.poll():
                        break
                    blob = r.data.recv_bytes()
                    if blob:
                        behind, n = _HEADER.unpack_from(blob)
                        self._behind[j] = bool(behind)
                        taken += n
                        blobs.append(blob)
                    else:
                        self._ready[j] = True
                else:
                    left = left or r.data.poll()
            except (EOFError, OSError):
                dead.add(j)  # what it sent whole is taken; a torn last message is not
            if not r.proc.is_alive():
                dead.add(j)
        self._left = left
        hung = self._hung(ready, by_handle, dead)
        # Decoded before any restart: a successor starts after what its predecessor sent.
        out = self._decode(blobs)
        for j in sorted(dead | set(hung)):
            try:
                self._restart(j)
            except IngestFailed as exc:
                exc.deliveries = out
                raise
        if hung:
            raise IngestHung("; ".join(hung.values()), out)
        return out

    def _hung(
        self, ready: Sequence[Any], by_handle: dict[Any, int], dead: set[int]
    ) -> dict[int, str]:
        """The ready readers, alive, that made no turn and sent nothing for ``stall_s``
        (killed here: a stopped process would outlive the run), each with why."""
        now = time.monotonic()
        heard = {by_handle[h] for h in ready}
        hung: dict[int, str] = {}
        for j, r in enumerate(self._readers):
            turns = r.turns.value
            if turns != r.seen or j in heard or not self._ready[j]:
                r.seen = turns
                r.alive_at = now
            elif j not in dead and now - r.alive_at >= self.stall_s:
                ranks = [s.rsplit(":", 1)[-1] for s in self._members[j]]
                hung[j] = (
                    f"ingest reader {self._spec.name}.{j} (pid {r.proc.pid}, ranks "
                    f"{', '.join(ranks)}) made no turn of its read loop for "
                    f"{now - r.alive_at:.0f} s: hung (killed)"
                )
                log.error(
                    "bus_ingest_reader_hung",
                    reader=f"{self._spec.name}.{j}",
                    pid=r.proc.pid,
                    ranks=ranks,
                    stalled_s=round(now - r.alive_at, 1),
                )
                r.proc.kill()
        return hung

    def _decode(self, blobs: list[bytes]) -> list[Delivery]:
        out: list[Delivery] = []
        decode = wire.decode_validated
        channel = self._spec.channel
        streams = self._streams
        for blob in blobs:
            names, ids, types, bodies, tops, item_seqs = pickle.loads(
                memoryview(blob)[_HEADER.size :]
            )
            # The reader decoded and validated each body already (a bad one went to the
            # dlq there); building it again here is cheaper than pickling the message.
            out += [
                Delivery(name, eid, decode(body, channel, type_))
                for name, eid, type_, body in zip(names, ids, types, bodies, strict=True)
            ]
            for name, (eid, seq) in tops.items():
                s = streams[name]
                s.last_id = eid
                s.last_seq = seq
            for up, seq in item_seqs.items():
                streams[self._fold_of[up]].item_seqs[up] = seq
        return out

    def hand_over(self, reader: _GroupReader) -> None:
        """Close the pool and give every stream to ``reader`` (the in-thread one; a fold
        stream's unpacker is the caller's to set) from where the main process got it:
        after the last entry and seq received (a fold's: each of its ranks' seqs), the
        pending entries this process asked to ack acked, the acks it still owes queued.
        Nothing is lost (what a reader read and did not send is pending, and re-read);
        nothing comes twice (the cursor starts after what was received)."""
        self.close()
        for stream, s in self._streams.items():
            reader.add_stream(stream)
            if s.last_id:
                reader.cursor.skip(stream, parse_id(s.last_id))
                if s.fold is None:
                    reader.seqs[stream] = s.last_seq
            # A fold stream's ranks' seqs: the caller gives ``reader`` its unpacker.
            reader.seqs.update(s.item_seqs)
            if s.acked:

                def ack_old(retry: bool, st: str = stream, a: str = s.acked) -> None:
                    _ack_through(reader, st, a)

                reader.link.call(ack_old)
        for acks in self._acks:
            reader.queue_ack_ids(acks)
        self._acks = [{} for _ in range(self.procs)]

    def close(self, timeout: float | None = None) -> None:
        """Flush the acks owed, ask every reader to stop (each acks what it holds and
        exits after its current read), and reap them."""
        if self._closed:
            return
        self._closed = True
        self.flush_acks()
        for j in range(self.procs):
            self._send(j, ("stop", None))
        wait_s = self._spec.config.max_block_ms / 1000 + 5.0 if timeout is None else timeout
        deadline = time.monotonic() + wait_s
        live = list(self._readers)
        while live and time.monotonic() < deadline:
            # A reader may be blocked sending a blob: take (and drop) what it sends so it
            # sees the stop. Dropped entries were never acked: they stay pending.
            for r in live:
                try:
                    while r.data.poll():
                        r.data.recv_bytes()
                except (EOFError, OSError):
                    pass
            wait([r.proc.sentinel for r in live], timeout=0.05)
            live = [r for r in live if r.proc.is_alive()]
        for r in self._readers:
            if r.proc.is_alive():
                r.proc.kill()
            r.proc.join(1.0)
            r.data.close()
            r.cmd.close()
