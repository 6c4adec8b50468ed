"""A rank's bus through its host agent (``RankBus``; the design is in ``flodl_bus.agent``).

The rank keeps everything that makes its control trustworthy: its own cursor per
control stream, the seq and MAC checks of ``entries.parse`` with its own keys, and the
signing of its upstream with its rank key. The agent only carries bytes.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import socket
import threading
import time
from typing import Any, Final

from flodl_bus.agent import frames
from flodl_bus.agent.applied import AckedControl, Applied
from flodl_bus.bus import entries, fold
from flodl_bus.bus.api import BusLost, Delivery
from flodl_bus.bus.connection import BusClosed
from flodl_bus.bus.ids import ZERO, EntryId, format_id, parse_id
from flodl_bus.bus.keys import BROADCAST, RunKeys
from flodl_bus.bus.publisher import LAZY
from flodl_bus.bus.stream_ops import StreamsConfig, log
from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import UpstreamMsg
from flodl_bus.protocol.signing import RankKeys, Verifier

#: how long a rank waits for its agent to come back before it stops (seconds)
DEFAULT_AGENT_GRACE_S: Final = 5.0
_LOST: Final = object()


class AgentRankBus(AckedControl):
    """``RankBus`` for rank ``rank`` whose agent listens on Unix socket ``path``."""

    def __init__(
        self,
        path: str,
        run: RunKeys,
        rank: int,
        keys: RankKeys,
        *,
        config: StreamsConfig | None = None,
        grace_s: float = DEFAULT_AGENT_GRACE_S,
    ) -> None:
        self.path = path
        self.keys = run
        self.rank = rank
        self.config = config or StreamsConfig()
        self.grace_s = grace_s
        self._ctl = run.ctl(rank)
        self._all = run.ctl_all_of(rank)
        self._up = run.up(rank)
        self._rank_fields = {self._ctl: str(rank), self._all: BROADCAST}
        self._verifiers: dict[str, Verifier] = {
            self._ctl: keys.rank_key,
            self._all: keys.broadcast_verifier(rank),
        }
        self._key = keys.rank_key
        self._dlq_by = f"rank{rank}.reader"
        #: the newest entry per stream received from the agent (what a hello asks after)
        self._received: dict[str, EntryId] = {self._ctl: ZERO, self._all: ZERO}
        #: the newest entry per stream checked (accepted or refused), and seq accepted
        self._checked: dict[str, EntryId] = {self._ctl: ZERO, self._all: ZERO}
        self._seqs: dict[str, int] = {}
        #: where the runtime took its control over (``ack``), for its heartbeats
        self._applied = Applied(self._ctl, self._all)
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        #: why the agent is gone for good (then reads raise ``BusLost``)
        self.lost: str | None = None
        self.reconnects = 0
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        # upstream: queued messages, then signed frames kept until the agent acks them
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._urgent = threading.Event()
        self._seq = 0
        self._n = 0
        self._unacked: collections.deque[tuple[int, list[Any]]] = collections.deque()
        self._up_cond = threading.Condition()
        self._queued = 0
        self._connect(time.monotonic() + grace_s)
        self._threads = [
            threading.Thread(target=self._receive, name=f"rank{rank}-agent-in", daemon=True),
            threading.Thread(target=self._publish, name=f"rank{rank}-agent-out", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ connection

    def _connect(self, deadline: float) -> None:
        """Connect and say hello (where this rank has read), then send again every
        upstream frame the agent has not acked, in order. Raises ``BusLost`` after
        ``deadline``."""
        delay = 0.01
        while True:
            if self._stop.is_set():
                raise BusClosed("closed")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
                # The hello is part of the attempt: a connection the dying agent's
                # listener still took is closed under it (a broken pipe), and that must
                # be retried like a refused connect, not end the receiving thread.
                self._hello(sock)
                return
            except OSError as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise BusLost(f"host agent at {self.path} unreachable: {exc}") from None
                self._stop.wait(delay)
                delay = min(delay * 2, 0.2)

    def _hello(self, sock: socket.socket) -> None:
        """Say where this rank has read, send every unacked upstream frame again, in
        order, and make ``sock`` the connection."""
        with self._send_lock:
            frames.send(
                sock,
                {
                    "op": "hello",
                    "rank": self.rank,
                    "pos": {s: format_id(e) for s, e in self._received.items()},
                },
            )
            with self._up_cond:
                resend = list(self._unacked)
            for n, items in resend:
                frames.send(sock, {"op": "up", "n": n, "items": items})
            self._sock = sock

    def _send(self, obj: dict[str, Any]) -> None:
        with self._send_lock:
            sock = self._sock
            if sock is None:
                return  # reconnecting: the hello's resend carries it
            # A failed send: the receiver sees the same loss and reconnects.
            with contextlib.suppress(OSError):
                frames.send(sock, obj)

    def _receive(self) -> None:
        while not self._stop.is_set():
            sock = self._sock
            assert sock is not None
            reader = frames.FrameReader(sock)
            try:
                while True:
                    f = reader.read()
                    if f["op"] == "ctl":
                        got = []
                        for stream, eid_text, flat in f["entries"]:
                            eid = parse_id(eid_text)
                            if stream in self._received and eid > self._received[stream]:
                                self._received[stream] = eid
                                fields = dict(zip(flat[::2], flat[1::2], strict=False))
                                got.append((stream, eid, fields))
                        if got:
                            self._inbox.put(got)
                    elif f["op"] == "upack":
                        self._upacked(int(f["n"]))
            except (frames.FrameError, OSError, KeyError, TypeError, ValueError) as exc:
                if self._stop.is_set():
                    return
                log.warning("agent_connection_lost", rank=self.rank, why=str(exc)[:120])
            with self._send_lock:
                self._sock = None
            with contextlib.suppress(OSError):
                sock.close()
            try:
                self._connect(time.monotonic() + self.grace_s)
                self.reconnects += 1
                log.info("agent_reconnected", rank=self.rank)
            except BusClosed:
                return
            except BusLost as exc:
                self.lost = str(exc)
                log.error("agent_lost", rank=self.rank, detail=self.lost, grace_s=self.grace_s)
                self._inbox.put(_LOST)
                with self._up_cond:
                    self._up_cond.notify_all()
                return

    # --------------------------------------------------------------- control

    def read_control(self, block_ms: int) -> list[Delivery]:
        if self.lost is not None:
            raise BusLost(self.lost)
        try:
            got = self._inbox.get(timeout=max(block_ms, 0) / 1000)
        except queue.Empty:
            return []
        if got is _LOST:
            self._inbox.put(_LOST)
            raise BusLost(self.lost or "host agent lost")
        out: list[Delivery] = []
        refused: list[dict[bytes, bytes]] = []
        for stream, eid, fields in got:  # type: ignore[attr-defined]
            if eid <= self._checked[stream]:
                continue  # handed again after a reconnect: dispatched already
            self._checked[stream] = eid
            eid_text = format_id(eid)
            p = entries.parse(
                self._verifiers[stream],
                stream,
                eid_text.encode(),
                fields,
                channel=wire.CONTROL,
                rank=self._rank_fields[stream],
                last_seq=self._seqs.get(stream, 0),
            )
            if isinstance(p, str):
                by = self._dlq_by
                log.error("bus_dead_letter", reader=by, stream=stream, entry=eid_text, reason=p)
                refused.append(entries.dead_letter_fields(stream, eid_text, p, fields, by))
                continue
            last = self._seqs.get(stream, 0)
            if last and p.seq != last + 1:
                log.error(
                    "bus_entries_missing",
                    reader=self._dlq_by,
                    stream=stream,
                    seqs=f"{last + 1}..{p.seq - 1}",
                    reason="trimmed before the agent read them, or withheld by it",
                )
            self._seqs[stream] = p.seq
            out.append(Delivery(stream, eid_text, p.msg))
        for f in refused:
            self._send({"op": "dlq", "fields": [x for kv in f.items() for x in kv]})
        return out

    # -------------------------------------------------------------- upstream

    def publish(self, msg: UpstreamMsg) -> None:
        if self._stop.is_set():
            raise BusClosed("publish after close")
        with self._up_cond:
            self._queued += 1
        self._q.put(msg)
        if type(msg) not in LAZY:
            self._urgent.set()

    def _publish(self) -> None:
        linger = self.config.publish_linger_s
        while True:
            first = self._q.get()
            if first is _LOST:
                return
            batch = [first]
            if linger > 0 and type(first) in LAZY:
                self._urgent.wait(linger)
            self._urgent.clear()
            while len(batch) < self.config.publish_batch:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = _LOST in batch
            items: list[Any] = []
            for msg in batch:
                if msg is _LOST:
                    continue
                try:
                    encoded = entries.encode(msg)
                except (TypeError, ValueError, OverflowError) as exc:
                    log.error("bus_publish_dropped", rank=self.rank, error=str(exc)[:200])
                    continue
                self._seq += 1
                items.append(fold.sign_item(self._key, self._up, self.rank, self._seq, encoded))
            with self._up_cond:
                self._queued -= len(batch) - (1 if stop else 0)
                if items:
                    self._n += 1
                    self._unacked.append((self._n, items))
                self._up_cond.notify_all()
            if items:
                self._send({"op": "up", "n": self._n, "items": items})
            if stop:
                return

    def _upacked(self, n: int) -> None:
        with self._up_cond:
            while self._unacked and self._unacked[0][0] <= n:
                self._unacked.popleft()
            self._up_cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """True once every message published so far is in Redis (the agent acked it)."""
        deadline = time.monotonic() + timeout
        self._urgent.set()
        with self._up_cond:
            while self._queued or self._unacked:
                left = deadline - time.monotonic()
                if left <= 0 or self.lost is not None:
                    return False
                self._up_cond.wait(min(left, 0.05))
        return True

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._q.put(_LOST)
        self._urgent.set()
        with self._send_lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for t in self._threads:
            t.join(2.0)
