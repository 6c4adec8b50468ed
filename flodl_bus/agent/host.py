"""The host agent process: one Redis reader of the host's control, one writer of the
host's upstream, a Unix socket for its ranks (the design is in ``flodl_bus.agent``)."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final

import redis

from flodl_bus.agent import frames
from flodl_bus.bus import entries, fold
from flodl_bus.bus.connection import BusClosed, BusUnavailable, Link
from flodl_bus.bus.cursor import GroupCursor, Received
from flodl_bus.bus.foreign import writer_limit
from flodl_bus.bus.ids import ZERO, EntryId, IdClock, format_id, parse_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.publisher import LAZY
from flodl_bus.bus.reader import _entries_of, _raw_reply
from flodl_bus.bus.stream_ops import (
    StreamsConfig,
    _now_ms,
    id_refused,
    landed,
    log,
    stream_top,
)

_STOP: Final = object()
#: the types of ``publisher.LAZY``, as folded items carry them
LAZY_TYPES: Final = frozenset(t.__name__.encode() for t in LAZY)


#: frames queued to one rank before the agent gives up on it: a rank that stopped
#: reading its socket is dropped (it reconnects and catches up from Redis) instead of
#: stalling the agent, and with it every other rank of the host
MAX_QUEUED: Final = 10_000


class _Conn:
    """One rank's connection: what it was sent (per stream), and its own sender thread,
    so that a rank that stops reading holds up nobody else."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rank: int | None = None
        #: the newest id per control stream this rank has (its hello, then our sends)
        self.pos: dict[str, EntryId] = {}
        self.alive = True
        self._out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(target=self._send_loop, name="agent-send", daemon=True).start()

    def send(self, obj: dict[str, Any]) -> None:
        if not self.alive:
            return
        if self._out.qsize() > MAX_QUEUED:
            log.error("agent_rank_not_reading", rank=self.rank, queued=self._out.qsize())
            self.close()
            return
        self._out.put(frames.pack(obj))

    def _send_loop(self) -> None:
        while (data := self._out.get()) is not None:
            try:
                self.sock.sendall(data)
            except OSError:
                self.close()
                return

    def close(self) -> None:
        if self.alive:
            self.alive = False
            self._out.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class HostAgent:
    """Serves ``ranks`` of run ``keys`` on Unix socket ``path`` as host ``host``."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        host: str,
        ranks: Iterable[int],
        path: str,
        *,
        config: StreamsConfig | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.host = host
        self.ranks = sorted(set(ranks))
        if not self.ranks:
            raise ValueError("a host agent serves at least one rank")
        self.path = path
        self.config = config or StreamsConfig()
        shards = {keys.shard_of(r) for r in self.ranks}
        if len(shards) > 1:
            raise ValueError(f"ranks {self.ranks} live on several shards of the run")
        self.shard = shards.pop()
        self.fold_stream = fold.host_stream(keys.shard_prefix(self.shard), host)
        self.dlq = keys.dlq_of_shard(self.shard)
        #: control stream -> the ranks it is for
        self.targets: dict[str, list[int]] = {keys.ctl(r): [r] for r in self.ranks}
        self.bcast = keys.broadcast_of_shard(self.shard)
        self.targets[self.bcast] = list(self.ranks)
        self.cursor = GroupCursor(
            list(self.targets), count=self.config.read_count, ordered=True, grouped=False
        )
        #: per stream, the newest id handed out (all below it in id order went too)
        self.released: dict[str, EntryId] = dict.fromkeys(self.targets, ZERO)
        self._reads = redis.Redis(connection_pool=client.connection_pool)
        self._reads.set_response_callback("XREAD", _raw_reply)
        self._ctl_link = Link(client, name=f"agent.{host}.reader", backoff=self.config.backoff)
        self._up_link = Link(client, name=f"agent.{host}.writer", backoff=self.config.backoff)
        # dead letters come from the ranks' connection threads: a link of their own
        self._dlq_link = Link(client, name=f"agent.{host}.dlq", backoff=self.config.backoff)
        self._conns: dict[int, _Conn] = {}
        self._hellos: queue.SimpleQueue[_Conn] = queue.SimpleQueue()
        self._up: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._far: set[tuple[str, EntryId]] = set()
        self._stop = threading.Event()
        #: set when an item the coordinator acts on is queued (see ``_fold``)
        self._urgent = threading.Event()
        self._clock = IdClock()
        self._seq = 0
        self.folded_entries = 0
        self.folded_items = 0
        self.delivered = 0
        self._server: socket.socket | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------- life

    def start(self) -> HostAgent:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(self.path)
        os.chmod(self.path, 0o600)  # the ranks run as the agent's user
        srv.listen(64)
        self._server = srv
        for name, target in (
            ("accept", self._accept),
            ("control", self._control),
            ("fold", self._fold),
        ):
            t = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("agent_started", host=self.host, ranks=self.ranks, socket=self.path)
        return self

    def close(self) -> None:
        if not self._stop.is_set():
            log.info(
                "agent_stopped",
                host=self.host,
                delivered=self.delivered,
                folded_entries=self.folded_entries,
                folded_items=self.folded_items,
            )
        self._stop.set()
        self._up.put(_STOP)
        self._urgent.set()
        self._ctl_link.close()
        self._up_link.close()
        self._dlq_link.close()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()
        for c in list(self._conns.values()):
            c.close()
        for t in self._threads:
            t.join(2.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def wait(self) -> None:
        while not self._stop.wait(1.0):
            pass

    # ---------------------------------------------------------- rank sockets

    def _accept(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            conn = _Conn(sock)
            threading.Thread(
                target=self._serve, args=(conn,), name="agent-conn", daemon=True
            ).start()

    def _serve(self, conn: _Conn) -> None:
        reader = frames.FrameReader(conn.sock)
        try:
            while not self._stop.is_set():
                f = reader.read()
                op = f["op"]
                if op == "hello" and conn.rank is None:
                    rank = f.get("rank")
                    if rank not in self.ranks:
                        log.error("agent_refused_rank", host=self.host, rank=rank)
                        return
                    conn.rank = rank
                    conn.pos = {s: parse_id(i) for s, i in dict(f.get("pos") or {}).items()}
                    self._hellos.put(conn)
                elif op == "up" and conn.rank is not None:
                    items = list(f["items"])
                    self._up.put((conn, int(f["n"]), items))
                    if any(it[2] not in LAZY_TYPES for it in items):
                        self._urgent.set()
                elif op == "dlq" and conn.rank is not None:
                    flat = list(f["fields"])
                    self._dead_letter(dict(zip(flat[::2], flat[1::2], strict=False)))
                else:
                    log.error("agent_bad_frame", host=self.host, op=op, rank=conn.rank)
                    return
        except (frames.FrameError, OSError, KeyError, TypeError, ValueError) as exc:
            if not self._stop.is_set():
                log.info("agent_rank_disconnected", rank=conn.rank, why=str(exc)[:120])
        finally:
            conn.close()

    def _dead_letter(self, fields: dict[Any, Any]) -> None:
        def op(retry: bool) -> None:
            self.client.xadd(self.dlq, fields, maxlen=self.config.maxlen, approximate=True)

        try:
            self._dlq_link.call(op, deadline=time.monotonic() + 2.0)
        except (BusUnavailable, BusClosed, redis.exceptions.RedisError) as exc:
            log.error("agent_dead_letter_failed", error=str(exc)[:200])

    # --------------------------------------------------------------- control

    def _streams_of(self, rank: int) -> list[str]:
        return [self.keys.ctl(rank), self.bcast]

    def _welcome(self, conn: _Conn) -> None:
        """Hand a (re)connected rank what went out before it came: everything up to
        what was released, from where it says it has read, merged by id."""
        assert conn.rank is not None
        merged: list[tuple[EntryId, str, Any]] = []
        for s in self._streams_of(conn.rank):
            lo = conn.pos.get(s, ZERO)
            hi = self.released[s]
            while lo < hi:
                got: Any = self.client.xrange(
                    s, min=f"({format_id(lo)}", max=format_id(hi), count=1000
                )
                if not got:
                    break
                for raw_id, fields in got:
                    eid = parse_id(raw_id)
                    merged.append((eid, s, [x for kv in dict(fields).items() for x in kv]))
                    lo = eid
            conn.pos[s] = max(conn.pos.get(s, ZERO), hi)
        merged.sort(key=lambda e: e[0])
        old = self._conns.get(conn.rank)
        if old is not None and old is not conn:
            old.close()
        self._conns[conn.rank] = conn
        if merged:
            conn.send({"op": "ctl", "entries": [[s, format_id(e), f] for e, s, f in merged]})

    def _check(self, stream: str, eid: EntryId, fields: Any) -> object:
        # Authentication is the rank's (the agent holds no rank key); only ids the
        # run's writers cannot have made are held back here, as a rank's reader does.
        if eid[0] > writer_limit(_now_ms()):
            return "an id beyond any the run writes (a foreign entry)"
        return fields

    def _control(self) -> None:
        block = self.config.max_block_ms
        while not self._stop.is_set():
            try:
                while True:
                    try:
                        conn = self._hellos.get_nowait()
                    except queue.Empty:
                        break
                    if conn.alive:
                        self._ctl_link.call(lambda retry, c=conn: self._welcome(c))  # type: ignore[misc]
                raw = self._ctl_link.call(self._read_op, deadline=time.monotonic() + 1.0)
            except BusUnavailable:
                continue
            except BusClosed:
                return
            before = self.cursor.positions()
            got = self.cursor.on_reply(_entries_of(raw), self._check)
            self._route(got)
            if (
                raw
                and self.cursor.positions() == before
                and not any(r.rejected is None for r in got)
            ):
                self._stop.wait(block / 1000)

    def _read_op(self, retry: bool) -> Any:
        wait = self.config.max_block_ms if self.cursor.can_block else None
        # A rank that says hello while we block waits at most one block for its welcome.
        ids: dict[Any, Any] = dict(self.cursor.request())
        return self._reads.xread(ids, count=self.config.read_count, block=wait)

    def _route(self, got: Sequence[Received]) -> None:
        out: dict[int, list[list[Any]]] = {}
        for r in got:
            if r.rejected is not None:
                if (r.stream, r.entry_id) not in self._far:
                    if len(self._far) > 10_000:
                        self._far.clear()
                    self._far.add((r.stream, r.entry_id))
                    self._dead_letter(
                        entries.dead_letter_fields(
                            r.stream,
                            format_id(r.entry_id),
                            r.rejected,
                            r.fields,
                            f"agent.{self.host}",
                        )
                    )
                continue
            self.released[r.stream] = r.entry_id
            flat = [x for kv in (r.fields or {}).items() for x in kv]
            for rank in self.targets[r.stream]:
                conn = self._conns.get(rank)
                if conn is None or not conn.alive or r.entry_id <= conn.pos.get(r.stream, ZERO):
                    continue
                conn.pos[r.stream] = r.entry_id
                out.setdefault(rank, []).append([r.stream, format_id(r.entry_id), flat])
        for rank, ents in out.items():
            self._conns[rank].send({"op": "ctl", "entries": ents})
            self.delivered += len(ents)

    # ------------------------------------------------------------------ fold

    def _fold(self) -> None:
        try:
            self._up_link.call(lambda retry: self._start_fold())
        except BusClosed:
            return
        get = self._up.get
        linger = self.config.publish_linger_s
        while True:
            first = get()
            if first is _STOP:
                return
            if linger > 0 and not self._urgent.is_set():
                # Only per-step reports so far: let the host's other ranks' reports of
                # this step join them in one entry (the ranks' publishers linger the same
                # way); anything the coordinator acts on ends the wait.
                self._urgent.wait(linger)
            self._urgent.clear()
            batch: list[Any] = [first]
            count = len(first[2])  # type: ignore[index]
            while count < fold.FOLD_SLOTS:
                try:
                    nxt = self._up.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    self._write(batch)
                    return
                batch.append(nxt)
                count += len(nxt[2])  # type: ignore[index]
            try:
                self._write(batch)
            except BusClosed:
                return

    def _start_fold(self) -> None:
        top = stream_top(self.client, self.fold_stream)
        if top[0] <= writer_limit(_now_ms()):
            self._clock.raise_floor(top)
        last: Any = self.client.xrevrange(self.fold_stream, "+", "-", count=1)
        for _, flds in last or ():
            with contextlib.suppress(KeyError, ValueError, TypeError):
                self._seq = int(dict(zip(flds[::2], flds[1::2], strict=False)).get(b"seq", 0))

    def _write(self, batch: list[Any]) -> None:
        items = [it for _, _, its in batch for it in its]
        # A frame with more items than one entry holds is split; the acks wait for all.
        for i in range(0, len(items), fold.FOLD_SLOTS):
            self._seq += 1
            fields = fold.fold_fields(self.host, self._seq, items[i : i + fold.FOLD_SLOTS])
            tried: list[str] = []

            def op(retry: bool, f: dict[bytes, bytes] = fields, t: list[str] = tried) -> None:
                if retry and t and landed(self.client, self.fold_stream, t[-1], f[entries.F_MAC]):
                    return
                while True:
                    eid = format_id(self._clock.next(_now_ms()))
                    t.append(eid)
                    try:
                        self.client.xadd(
                            self.fold_stream,
                            f,  # type: ignore[arg-type]
                            id=eid,
                            maxlen=self.config.maxlen,
                            approximate=True,
                        )
                        return
                    except redis.exceptions.ResponseError as exc:
                        if not id_refused(exc):
                            raise
                    top = stream_top(self.client, self.fold_stream)
                    if top[0] > writer_limit(_now_ms()):
                        raise BusUnavailable(f"{self.fold_stream}: a foreign entry at the top")
                    self._clock.raise_floor(top)

            self._up_link.call(op)
            self.folded_entries += 1
        self.folded_items += len(items)
        last: dict[int, tuple[_Conn, int]] = {}
        for conn, n, _ in batch:
            last[id(conn)] = (conn, n)
        for conn, n in last.values():
            conn.send({"op": "upack", "n": n})
