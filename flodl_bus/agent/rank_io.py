"""A rank's bus in a process of its own (issue 27): ``RankIoBus`` and the process it runs.

Why: a rank's Redis work (the publisher's encoding, signing and transactions, the
control reader's replies, cursor and MAC checks) runs on threads of the training
process, and every time one of them takes the GIL the training thread waits at its
next Python line; on the lent 16-core host each such wait cost about 360 µs, 267 times
a second (BENCHMARKS.md, 2026-12-06, sixth session). Here that work runs in a child
process with its own GIL: the rank's ``RedisRankBus``, unchanged, with every rule it
keeps (one writer of ``up:<r>`` in publish order, lingering step reports, the ordered
cursor over ``ctl:<r>`` and the broadcast, MAC and seq checks, the dlq). The training
process keeps a thin end of two Unix socket pairs (``agent.frames``, never a network
address): a publish is one frame written by the caller's thread (no thread of ours is
woken in the training process), and control arrives as frames the rank runtime's reader
thread reads, already verified and in id order, as cheap to take as a queue.

What each side holds:

* the child: the rank's Redis client and keys (the same trust as the rank: it is the
  rank's own process, started with its keys over a pipe, never over the network);
* the parent: where its runtime took control over (``ack``), which its heartbeats say
  (``control_read``), so the coordinator trims the control streams no further.

Order, loss and liveness (DESIGN §3):

* upstream: frames go on one stream socket in publish order under a lock, and the
  child publishes them in that order on the one publisher;
* control: the child reads with the rank's own cursor and forwards each read whole,
  in id order, on one socket; the parent takes frames in order;
* the child leads a session of its own and ignores the stop signals: the rank stops
  in order (its ``Exiting`` and last reports flushed by ``close``) and then closes it.
  It exits on the parent's close or on end-of-file (the parent died);
* the child's death is the bus's loss: reads raise ``BusLost`` (the runtime stops the
  rank in order, as when it loses its host agent), publishes raise ``BusError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Final, get_args

import structlog

from flodl_bus.agent import frames
from flodl_bus.agent.applied import AckedControl, Applied
from flodl_bus.bus.api import BusLost, Delivery
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.publisher import EPOCH_END, LAZY
from flodl_bus.bus.stream_ops import BusError, StreamsConfig
from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import Batch, Heartbeat, UpstreamMsg
from flodl_bus.protocol.signing import MacKey, RankKeys, VerifyKey

_log = structlog.get_logger("flodl_bus.agent")

#: the environment variable the child finds its two sockets' descriptors in
ENV_FDS: Final = "FLODL_RANK_IO_FDS"
#: how long a rank waits for its IO process to be up (imports, its Redis connection)
DEFAULT_START_TIMEOUT_S: Final = 60.0
#: a bus process that takes no upstream for this long (stopped, hung) is killed, and the
#: rank's bus is lost, rather than its publishes waiting on it for ever
DEFAULT_STALL_S: Final = 30.0
#: how long the child's control reads block (its close waits at most this long for them)
CHILD_BLOCK_MS: Final = 250
#: how long ``close`` lets the child flush and leave before it is killed
CLOSE_TIMEOUT_S: Final = 15.0
_UPSTREAM_CLASSES: Final[frozenset[type]] = frozenset(get_args(UpstreamMsg))


@dataclass(frozen=True)
class Setup:
    """What the child needs to be the rank's bus (pickled over its stdin)."""

    url: str
    keys: RunKeys
    rank: int
    rank_key: bytes
    broadcast_hex: str
    config: StreamsConfig
    where: str


class RankIoBus(AckedControl):
    """``RankBus`` for rank ``rank`` whose Redis work runs in a child process."""

    def __init__(
        self,
        url: str,
        run: RunKeys,
        rank: int,
        keys: RankKeys,
        *,
        config: StreamsConfig | None = None,
        where: str = "",
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        stall_s: float = DEFAULT_STALL_S,
    ) -> None:
        self.keys = run
        self.rank = rank
        self.config = config or StreamsConfig()
        self._ctl_stream = run.ctl(rank)
        self._all_stream = run.ctl_all_of(rank)
        #: where the runtime took its control over (``ack``), for its heartbeats
        self._applied = Applied(self._ctl_stream, self._all_stream)
        self._send_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._tokens = itertools.count(1)
        # Upstream waits here, encoded, under the publisher's own rules (``bus.publisher``):
        # a message the coordinator acts on goes at once with all before it; step reports
        # wait for company, up to the linger while they flow. Sent from the publishing
        # thread, never by a thread of ours: no wake of another thread in this process.
        # When reports stop flowing they wait for the next report, a ``hurry`` (the rank
        # is about to wait on control), a flush, or the next heartbeat, which goes at
        # once (a second at the latest): the coordinator's next decision never hangs on
        # them alone (LAZY), and a rank parked in a collective still looks alive.
        self._buffer: list[tuple[str, bytes]] = []
        self._buffered_at = 0.0
        self._linger = self.config.publish_linger_s
        self._lazy = LAZY | EPOCH_END if self.config.publish_epoch_end_lazy else LAZY
        self._first_step = self.config.publish_first_step
        #: whether the next ``Batch`` is the first after a message the coordinator acts on
        self._news = self._first_step
        #: why the child can no longer publish (then publishes raise ``BusError``)
        self.error: str | None = None
        #: why the child is gone or can no longer read (then reads raise ``BusLost``)
        self.lost: str | None = None
        self._closed = False
        #: the child's reconnects to Redis, as it last said
        self.reconnects = 0
        up, child_up = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ctl, child_ctl = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        setup = Setup(
            url=url,
            keys=run,
            rank=rank,
            rank_key=keys.rank_key.key,
            broadcast_hex=keys.broadcast.hex,
            # Batched here already: the child writes what it is handed at once.
            config=dataclasses.replace(
                self.config,
                publish_linger_s=0.0,
                publish_first_step=False,
                publish_epoch_end_lazy=False,
            ),
            where=where,
        )
        fds = (child_up.fileno(), child_ctl.fileno())
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "flodl_bus.agent.rank_io"],
                stdin=subprocess.PIPE,
                pass_fds=fds,
                # Out of the rank's process group: a Ctrl-C to the group (a terminal,
                # ``up``) must not cut off the rank's last reports, even while the child
                # is still importing, before it ignores the stop signals itself.
                start_new_session=True,
                env={**os.environ, ENV_FDS: f"{fds[0]},{fds[1]}"},
            )
        finally:
            child_up.close()
            child_ctl.close()
        assert self._proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self._proc.stdin.write(pickle.dumps(setup))
        self._proc.stdin.close()
        self._up = up
        self._stall_s = stall_s
        # Bounds a send to a child that takes nothing (``_send``); every read of this
        # socket waits on its poll first, so no read meets the timeout.
        up.settimeout(stall_s)
        self._ctl = ctl
        self._up_frames = frames.FrameReader(up)
        self._ctl_frames = frames.FrameReader(ctl)
        self._wait_ready(start_timeout)

    # ------------------------------------------------------------------ life

    @property
    def pid(self) -> int:
        """The bus process's pid."""
        return self._proc.pid

    def _wait_ready(self, timeout: float) -> None:
        try:
            frame = self._ctl_frames.read_by(time.monotonic() + timeout)
        except frames.FrameError:
            frame = None
        if frame is not None and frame.get("op") == "r":
            return
        why = (
            str(frame.get("why"))
            if frame is not None and frame.get("op") == "x"
            else f"no answer within {timeout:.0f}s"
            if frame is None and self._proc.poll() is None
            else f"it exited with code {self._proc.poll()}"
        )
        self._stop_child()
        raise BusError(f"rank {self.rank}'s bus process did not start: {why}")

    def close(self) -> None:
        """Flush upstream in the child, close its bus and wait for it to leave."""
        with self._send_lock:
            if self._closed:
                return
            with contextlib.suppress(BusError):
                self._send_buffer()
                self._send({"op": "c"})
            self._closed = True
        try:
            self._proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _log.error("rank_io_close_timeout", rank=self.rank, timeout_s=CLOSE_TIMEOUT_S)
        self._stop_child()

    def _stop_child(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for sock in (getattr(self, "_up", None), getattr(self, "_ctl", None)):
            if sock is not None:
                sock.close()

    def _gone(self) -> str:
        """Why the bus is lost: its process's exit, once reaped (end-of-file on its
        sockets comes first, its exit status an instant later)."""
        try:
            code: int | None = self._proc.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        return (
            f"rank {self.rank}'s bus process exited (code {code})"
            if code is not None
            else f"rank {self.rank}'s bus process closed its socket"
        )

    # --------------------------------------------------------------- control

    def read_control(self, block_ms: int) -> list[Delivery]:
        deadline = time.monotonic() + max(block_ms, 0) / 1000.0
        while True:
            got = self._take(deadline)
            if got is not None:
                return got

    def poll_control(self) -> list[Delivery]:
        """The control already here, without waiting (the training thread polls it
        between steps: ``worker.runtime``); empty when none is."""
        if not self._ctl_frames.waiting():
            return []
        out: list[Delivery] = []
        while True:
            got = self._take(0.0)
            if got is None:
                continue  # a frame that was not control: look again
            if not got:
                return out
            out += got

    def _take(self, deadline: float) -> list[Delivery] | None:
        """The next control frame's deliveries ([] at ``deadline``; None for a frame
        that says something else, taken note of here)."""
        if self.lost is not None:
            raise BusLost(self.lost)
        try:
            frame = self._ctl_frames.read_by(deadline)
        except frames.FrameError:
            self.lost = self.lost or self._gone()
            self.error = self.error or self.lost
            raise BusLost(self.lost) from None
        except OSError as exc:
            self.lost = self.lost or f"{self._gone()} ({exc})"
            self.error = self.error or self.lost
            raise BusLost(self.lost) from None
        if frame is None:
            return []
        op = frame.get("op")
        if op == "d":
            return [
                Delivery(str(stream), str(eid), wire.decode_local(name, raw))
                for stream, eid, name, raw in frame["e"]
            ]
        if op == "x":
            # The child's publisher failed: publishes raise from now on; its reads go
            # on (the rank stops on its next publish, as with a thread publisher).
            self.error = str(frame.get("why"))
        elif op == "n":
            self.reconnects = int(frame.get("n", 0))
        return None

    # -------------------------------------------------------------- upstream

    def publish(self, msg: UpstreamMsg) -> None:
        kind = type(msg)
        if kind not in _UPSTREAM_CLASSES:
            raise TypeError(f"{kind.__name__} is not an upstream message")
        if self.error is not None:
            raise BusError(f"upstream of rank {self.rank} failed: {self.error}")
        try:
            body = wire.encode_local(msg)
        except (TypeError, ValueError, OverflowError) as exc:
            # e.g. an int beyond 64 bits: one message lost, loudly, as the publisher
            # thread of ``RedisRankBus`` does; the stream goes on
            _log.error("bus_publish_dropped", rank=self.rank, error=str(exc)[:200])
            return
        now = time.monotonic()
        with self._send_lock:
            buffer = self._buffer
            if not buffer:
                self._buffered_at = now
            buffer.append(body)
            if kind not in self._lazy:
                self._news = self._first_step
            elif kind is Batch:
                if not self._news and now - self._buffered_at < self._linger:
                    return
                self._news = False
            elif kind is Heartbeat:
                pass  # goes now, once a second: what waits here never waits longer
            else:
                if kind in EPOCH_END:
                    self._news = self._first_step
                if now - self._buffered_at < self._linger:
                    return
            self._send_buffer()

    def hurry(self) -> None:
        """What waits goes now: the rank is about to block on its control, whose next
        message may answer it."""
        with contextlib.suppress(BusError), self._send_lock:
            self._send_buffer()

    def flush(self, timeout: float) -> bool:
        with self._flush_lock:
            token = next(self._tokens)
            try:
                with self._send_lock:
                    self._send_buffer()
                    self._send({"op": "f", "t": token, "s": timeout})
            except BusError:
                return False
            deadline = time.monotonic() + timeout + 1.0
            while True:
                try:
                    frame = self._up_frames.read_by(deadline)
                except (frames.FrameError, OSError):
                    return False
                if frame is None:
                    return False
                if frame.get("t") == token:
                    return bool(frame.get("ok")) and self.error is None

    def _send_buffer(self) -> None:
        """Hand what waits to the child (the send lock held)."""
        if self._buffer:
            bodies, self._buffer = self._buffer, []
            self._send({"op": "m", "b": bodies})

    def _send(self, frame: dict[str, Any]) -> None:
        """One frame to the child (the send lock held: frames never interleave)."""
        if self._closed:
            raise BusError(f"rank {self.rank}'s bus is closed")
        try:
            self._up.sendall(frames.pack(frame))
        except TimeoutError:
            # Alive but taking nothing (stopped, hung), with a frame cut short: killed,
            # so the rank's reads meet its end and the rank stops in order.
            self.error = (
                f"rank {self.rank}'s bus process took no upstream for {self._stall_s:.0f}s "
                "(stopped or hung); killed"
            )
            self._proc.kill()
            raise BusError(f"upstream of rank {self.rank} failed: {self.error}") from None
        except OSError as exc:
            self.error = self.error or f"{self._gone()} ({exc})"
            raise BusError(f"upstream of rank {self.rank} failed: {self.error}") from None


# ------------------------------------------------------------------- the child


def _child(setup: Setup, up: socket.socket, ctl: socket.socket) -> int:
    from flodl_bus.bus.connection import connect
    from flodl_bus.bus.streams import RedisRankBus

    keys = setup.keys
    ctl_lock = threading.Lock()

    def tell(frame: dict[str, Any]) -> None:
        with ctl_lock:
            frames.send(ctl, frame)

    try:
        client = connect(
            setup.url, client_name=f"flodl-rank{setup.rank}-io", key=keys.ctl(setup.rank)
        )
        bus = RedisRankBus(
            client,
            keys,
            setup.rank,
            RankKeys(MacKey(setup.rank_key), VerifyKey.from_hex(setup.broadcast_hex)),
            config=setup.config,
            where=setup.where,
        )
    except Exception as exc:
        with contextlib.suppress(OSError):
            tell({"op": "x", "why": f"{type(exc).__name__}: {exc}"[:500]})
        return 3
    stop = threading.Event()

    def read() -> None:
        said = 0
        while not stop.is_set():
            try:
                got = bus.read_control(CHILD_BLOCK_MS)
            except Exception as exc:
                # The transport reconnects with backoff on its own; a persistent failure
                # is silence, which the rank's liveness clock handles.
                _log.warning("control_read_failed", rank=setup.rank, error=repr(exc))
                stop.wait(CHILD_BLOCK_MS / 1000.0)
                continue
            try:
                if got:
                    entries = [[d.stream, d.entry_id, *wire.encode_local(d.msg)] for d in got]
                    tell({"op": "d", "e": entries})
                if bus.reconnects != said:
                    said = bus.reconnects
                    tell({"op": "n", "n": said})
            except OSError:
                return  # the rank is gone: the main loop sees end-of-file too

    reader = threading.Thread(target=read, name=f"rank{setup.rank}-io-reader", daemon=True)
    tell({"op": "r"})
    reader.start()
    failed = False
    inbox = frames.FrameReader(up)
    try:
        while True:
            try:
                frame = inbox.read()
            except (frames.FrameError, OSError):
                break  # the rank died: nothing more can come
            op = frame.get("op")
            if op == "m":
                if failed:
                    continue
                try:
                    # Queued together, written together: the publisher thread waits for
                    # the GIL this loop holds until it blocks on the next frame.
                    for name, raw in frame["b"]:
                        if wire.channel_of(name) != wire.UPSTREAM:
                            raise BusError(f"{name} is not an upstream message")
                        bus.publish(wire.decode_local(name, raw))
                except Exception as exc:
                    failed = True
                    with contextlib.suppress(OSError):
                        tell({"op": "x", "why": str(exc)[:500]})
            elif op == "f":
                ok = bus.flush(float(frame.get("s", 5.0)))
                with contextlib.suppress(OSError):
                    frames.send(up, {"op": "f", "t": frame.get("t"), "ok": ok})
            elif op == "c":
                break
    finally:
        stop.set()
        if not bus.flush(5.0):
            _log.error("upstream_flush_timeout", rank=setup.rank, timeout_s=5.0)
        bus.close()
        reader.join(2 * CHILD_BLOCK_MS / 1000.0 + 1.0)
        client.close()
    return 0


def main() -> int:
    # The rank stops in order on a signal and closes this process after its last
    # reports; a signal to the whole process group must not cut them off.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        up_fd, ctl_fd = (int(x) for x in os.environ[ENV_FDS].split(","))
    except (KeyError, ValueError):
        print(f"{ENV_FDS} must name two descriptors: this runs under RankIoBus", file=sys.stderr)
        return 2
    up = socket.socket(fileno=up_fd)
    ctl = socket.socket(fileno=ctl_fd)
    setup = pickle.load(sys.stdin.buffer)
    if not isinstance(setup, Setup):
        print(f"expected a Setup on stdin, got {type(setup).__name__}", file=sys.stderr)
        return 2
    return _child(setup, up, ctl)


if __name__ == "__main__":
    # Run as ``-m``, this file is ``__main__``; the parent pickled the module's own
    # ``Setup``, so the entry point is taken from the module by its name.
    from flodl_bus.agent.rank_io import main as _main

    sys.exit(_main())
