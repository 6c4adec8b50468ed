"""A coordinator record written by a process of its own (``FLODL_RECORD_PROCESS``).

Building a record line (JSON of the message and the effects, the digest chain, zstd,
the timeline fold into ``events.jsonl``) is Python work on the coordinator's one
thread; a thread of its own would still hold the GIL. So the dispatching thread only
hands each recorded call to a child process over a pipe, in call order, in the cheapest
form that still says everything (``bench path`` prints what it saves):

* the call's record number ``i``, stream, entry id, sender, ``now``;
* the message as its class's index and its field values (``pack_msg``), rebuilt as the
  same object in the child, so the line and the timeline see exactly what the core saw;
* the state as the line holds it: the delta (``record.states``) computed on the
  dispatching thread, which alone still holds the previous state (a whole summary is
  too dear to pickle); the child applies it to its own copy for the timeline;
* effects, ``extra`` fields and free-form events already in record form
  (``record_value``): they are rare, and the record layer must not import the
  coordinator's effect classes to rebuild them.

The child (``python -m flodl_bus.record.process``) runs an ordinary in-thread
``DispatchRecorder`` on the same directory and writes every line exactly as the
in-thread recorder does; a record from either replays the same way.

Calls are queued and go down the pipe ``BATCH_ITEMS`` at a time, or at most ``GATHER_S``
after they were made (a gatherer thread): a write per call woke the child per call.
``events.jsonl`` therefore lags the core by about that much.

Ordering and loss: one queue, one pipe, one writer at a time (the pipe's lock, taken
before a batch leaves the queue), read by one loop: lines keep the order of the calls.
A coordinator killed loses the calls of its last
``GATHER_S`` (the child writes everything it got, then stops at the end of its input),
as an in-thread record loses its last ``record.chain.FLUSH_S``. ``flush`` returns once
the child has put every earlier line on disk (``record.chain``'s block), ``close`` once
it exited having closed the record. The pipe holds up to ``PIPE_BYTES``; a child that
falls further behind holds the writer back (back pressure, never a drop), for at most
``STALL_S`` without taking a byte: a child alive but hung (stopped, deadlocked) is then
killed and counts as a failure, as a dead one does, instead of the dispatching thread
waiting on it for ever. The write end stays blocking (a non-blocking flag would sit on
the open file description, shared with any process forked while it is open): each write
is sized so that it cannot block, after a ``poll`` for room bounded by ``STALL_S``
(``_write_all``). Stop signals do not reach the child (it ignores them and ends at the
end of its input), so a Ctrl-C stops the coordinator in order and the record with it. A
child that dies anyway (killed, crashed) is noticed at once by a watcher thread (and by
the next write's broken pipe): ``failure`` says why, the coordinator
loop stops the run in order and exits ``FAILED``, and the record is left as a kill
leaves it, without its ``end`` line, which ``flodl-bus replay`` reports as incomplete
up to its last verified line. Nothing is written on after a failure: the lines the
child had not yet written are gone, and a continuation could not be chained to a
record whose last frame the kill cut.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import operator
import os
import pickle
import select
import signal
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, get_args

import structlog

from flodl_bus.exits import STOP_SIGNALS, describe
from flodl_bus.protocol.messages import WireMsg

log = structlog.get_logger("flodl_bus.record")

#: ``0`` records the coordinator on its own thread; ``shadow`` in a record process that
#: rebuilds the core's states itself (``coordinator.shadow``); anything else (the default
#: of the ``flodl-bus coordinator`` command) in a record process fed the state deltas.
ENV_PROCESS: Final = "FLODL_RECORD_PROCESS"
#: how long the child may take to start (imports on a loaded host) before the record
#: falls back to the dispatching thread (nothing was written yet)
START_S: Final = 60.0
#: how long ``flush`` waits for the child to say the lines are on disk
FLUSH_S: Final = 30.0
#: most items queued before they are written down the pipe at once
BATCH_ITEMS: Final = 64
#: longest an item waits in the dispatching process before it is written
GATHER_S: Final = 0.02
#: the pipe's capacity (Linux caps it at ``/proc/sys/fs/pipe-max-size``, 1 MiB by default)
PIPE_BYTES: Final = 1 << 20
#: how long the pipe may stay full with the child taking nothing before the child counts
#: as hung (``RecordProcess.stall_s`` is this unless a caller set another)
STALL_S: Final = 30.0
_F_SETPIPE_SZ: Final = 1031
_F_GETPIPE_SZ: Final = 1032

# what one pipe item is (its first element)
HEADER, DISPATCH, CORE, EVENT, PORT, END, FLUSH, CLOSE = range(8)

_CLASSES: Final[tuple[type, ...]] = tuple(get_args(WireMsg))
_INDEX: Final[dict[type, int]] = {c: k for k, c in enumerate(_CLASSES)}
_NAMES: Final[tuple[tuple[str, ...], ...]] = tuple(
    tuple(f.name for f in dataclasses.fields(c)) for c in _CLASSES
)


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    if not names:
        return lambda _m: ()
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda m: (one(m),)
    return operator.attrgetter(*names)


_GETTERS: Final = tuple(_getter(n) for n in _NAMES)


def process_default(env: Mapping[str, str] | None = None) -> bool:
    """Whether the coordinator's record goes to a record process (either kind)."""
    return process_mode(env) != "thread"


def process_mode(env: Mapping[str, str] | None = None) -> str:
    """``FLODL_RECORD_PROCESS``: ``thread`` (``0``, ``off``...), ``shadow`` (the record
    process rebuilds the states itself: ``coordinator.shadow``), else ``process``."""
    raw = (os.environ if env is None else env).get(ENV_PROCESS, "1").strip().lower()
    if raw in ("0", "no", "false", "off", "thread"):
        return "thread"
    return "shadow" if raw == "shadow" else "process"


def pack_msg(msg: object, encode: Callable[[Any], Any]) -> tuple[int, Any]:
    """(class index, field values) of a wire message; (-1, record form) of anything else."""
    k = _INDEX.get(type(msg))
    if k is None:
        return -1, encode(msg)
    return k, _GETTERS[k](msg)


def unpack_msg(k: int, values: Any) -> Any:
    if k < 0:
        return values
    cls = _CLASSES[k]
    # The very object, field for field: no __init__ or __post_init__ runs again.
    msg: Any = object.__new__(cls)
    for name, v in zip(_NAMES[k], values, strict=True):
        object.__setattr__(msg, name, v)
    return msg


class RecordProcessUnavailable(RuntimeError):
    """The record process did not start: record on the dispatching thread instead."""


class RecordProcess:
    """The dispatching process's end: ``send`` items, ``flush``, ``close``."""

    def __init__(self, spec: Mapping[str, Any], module: str = "flodl_bus.record.process") -> None:
        self.failure: str | None = None
        #: set the moment ``failure`` is
        self.dead = threading.Event()
        self._closing = False
        self._pipe_closed = False
        #: items not yet written down the pipe, in call order
        self._buf: list[tuple[Any, ...]] = []
        #: the queue's lock, never held across a write: ``send`` does not wait on the pipe
        self._lock = threading.Lock()
        #: one writer at a time, the batches in the order they were taken off the queue
        self._pipe_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        #: the longest the pipe may stay full before the child counts as hung
        self.stall_s = STALL_S
        self._proc = subprocess.Popen(
            [sys.executable, "-m", module, json.dumps(dict(spec))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            # The environment as an array of our own, never the process's ``environ``:
            # the child is made by vfork and reads the environment during its exec,
            # while another thread may change it (a setenv reallocates the array and
            # frees the old one); the exec then fails with EFAULT ("Bad address") and
            # the record falls back to the thread. Seen under load with a rank training
            # on a thread of the same process (test_runtime_record_process).
            env=dict(os.environ),
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._fd = self._proc.stdin.fileno()
        self._reply = self._proc.stdout.fileno()
        with contextlib.suppress(OSError):  # not Linux, or above the host's maximum
            fcntl.fcntl(self._fd, _F_SETPIPE_SZ, PIPE_BYTES)
        #: the pipe's capacity where the host says it (Linux), else 0: see ``_empty_room``
        self._capacity = 0
        with contextlib.suppress(OSError):
            self._capacity = fcntl.fcntl(self._fd, _F_GETPIPE_SZ)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLOUT)
        line = self._read_line(START_S)
        if not line.startswith(b"ready "):
            self._proc.kill()
            self._proc.wait()
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
            self._proc.stdout.close()
            raise RecordProcessUnavailable(
                f"the record process did not start ({describe(self._proc.returncode)})"
            )
        self.path = Path(line[6:].rstrip(b"\n").decode())
        self._watcher = threading.Thread(target=self._watch, name="flodl-record-watch")
        self._watcher.daemon = True
        self._watcher.start()
        self._stop = threading.Event()
        self._gatherer = threading.Thread(target=self._gather, name="flodl-record-send")
        self._gatherer.daemon = True
        self._gatherer.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read_line(self, timeout: float) -> bytes:
        """One reply line of the child, b"" when it sent none within ``timeout``."""
        # poll, not select: a coordinator holding a thousand ranks' sockets and pipes
        # hands the child descriptors above select's FD_SETSIZE (1024), where select
        # raises instead of waiting.
        reply = select.poll()
        reply.register(self._reply, select.POLLIN)
        deadline = time.monotonic() + timeout
        buf = b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not reply.poll(left * 1000.0):
                return b""
            chunk = os.read(self._reply, 1)
            if not chunk:
                return b""
            buf += chunk
        return buf

    def _watch(self) -> None:
        # Blocked in waitpid, without the GIL: a dead child is noticed the moment it dies.
        rc = self._proc.wait()
        if not self._closing:
            self._fail(f"the record process exited: {describe(rc)}")

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
            self.dead.set()
            log.error(
                "record_process_died",
                why=why,
                detail="the record is cut here (no end line); the run stops",
            )

    def send(self, item: tuple[Any, ...]) -> None:
        """Queue one item; it goes down the pipe with the next batch (``BATCH_ITEMS``
        queued, or the gatherer's next turn, at most ``GATHER_S`` later)."""
        # Under the lock: an item appended to a batch the gatherer has just taken, after
        # it pickled it, would be lost.
        with self._lock:
            buf = self._buf
            buf.append(item)
            full = len(buf) >= BATCH_ITEMS
        if full:
            self._write()

    def _write(self) -> None:
        # The pipe lock first, then the batch: batches reach the pipe in the order they
        # left the queue, and an item queued meanwhile waits for the next writer.
        with self._pipe_lock:
            with self._lock:
                buf = self._buf
                if not buf:
                    return
                self._buf = []
            if self.failure is not None or self._pipe_closed:
                return
            data = pickle.dumps(buf, protocol=5)
            try:
                if not self._write_all(memoryview(data)):
                    self._fail(
                        f"the record process took nothing for {self.stall_s:g} s with "
                        "the pipe full (hung: killed)"
                    )
                    # Killed, not left stopped or deadlocked: ``close`` must not wait on
                    # it, and a stopped process would outlive the run.
                    with contextlib.suppress(OSError):
                        self._proc.kill()
            except OSError as exc:
                # A broken pipe is usually seen before waitpid returns: name how the
                # process ended (a signal, an exit code) when it says so within a second.
                try:
                    how = describe(self._proc.wait(timeout=1.0))
                except subprocess.TimeoutExpired:
                    how = "still running"
                self._fail(f"the record process is gone ({exc!r}; {how})")

    def _empty_room(self) -> int:
        """The pipe's capacity when it is empty (every slot free), else 0."""
        if not self._capacity:
            return 0
        queued = fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0")
        return self._capacity if int.from_bytes(queued, sys.byteorder) == 0 else 0

    def _write_all(self, view: memoryview) -> bool:
        """Write ``view`` whole; False when the pipe stayed full for ``stall_s``.

        No write can block: an empty pipe takes up to its capacity; else ``poll`` waits
        for room (bounded by what is left of ``stall_s`` since the child last took
        something) and the write is at most ``PIPE_BUF``, which the one free slot that
        ``poll`` promises always holds (slots partly filled by earlier writes make the
        byte count ``FIONREAD`` gives no promise). Only this thread writes (the pipe lock)
        and only the child reads, so room found can only grow until the write. A broken pipe raises
        (``OSError``), from the write ``poll`` let through."""
        since = time.monotonic()
        while view:
            room = self._empty_room()
            if not room:
                left = since + self.stall_s - time.monotonic()
                if not self._poll.poll(max(0, int(left * 1000) + 1)):
                    if time.monotonic() - since >= self.stall_s:
                        return False
                    continue
                room = select.PIPE_BUF
            view = view[os.write(self._fd, view[:room]) :]
            since = time.monotonic()
        return True

    def _gather(self) -> None:
        # One wake-up per GATHER_S, not one write per line: each write wakes the child,
        # and a per-line hand-over cost the dispatching thread more than the line.
        while not self._stop.wait(GATHER_S):
            if self._buf:
                self._write()

    def flush(self) -> None:
        """Every line sent so far is on disk when this returns (unless the child died)."""
        with self._flush_lock:  # one reply per request, read by the thread that asked
            if self.failure is not None or self._closing:
                return
            self.send((FLUSH,))
            self._write()
            got = self._read_line(FLUSH_S) if self.failure is None else b""
            if got != b"flushed\n" and self.failure is None:
                log.warning("record_flush_slow", waited_s=FLUSH_S)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._stop.set()
        self._gatherer.join()
        self.send((CLOSE,))
        self._write()
        with self._pipe_lock:
            self._pipe_closed = True
            # Through its file object, never os.close: the object would close the fd
            # number again when collected, by then another file's.
            assert self._proc.stdin is not None
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        self._watcher.join(FLUSH_S)
        if self._proc.poll() is None:
            log.error("record_process_hung", detail="killed after it did not close in time")
            self._proc.kill()
            self._watcher.join()
        assert self._proc.stdout is not None
        self._proc.stdout.close()
        rc = self._proc.returncode
        if rc != 0 and self.failure is None:
            self._fail(f"the record process failed at close: {describe(rc)}")


#: the handler of the items a ``serve`` caller adds (their codes are ``EXTRA`` and up)
Extra = Callable[[Any, tuple[Any, ...]], None]
EXTRA: Final = 10


def serve(spec: Mapping[str, Any], extra: Extra | None = None) -> int:
    """The child's loop: write every item the pipe brings until the close or its end."""
    from flodl_bus.record import states
    from flodl_bus.record.dispatch import DispatchRecorder
    from flodl_bus.record.log import configure_console

    # The replies get stdout's pipe to themselves: anything printed or logged (structlog
    # prints to stdout unless configured) goes to the coordinator's stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    configure_console("warning")
    rec = DispatchRecorder(
        spec["run_dir"],
        spec["role"],
        spec["rank"],
        compress=spec["compress"],
        deltas=spec["deltas"],
        events=spec["events"],
        process=False,
    )
    out.write(b"ready " + str(rec.path).encode() + b"\n")
    out.flush()
    stdin = sys.stdin.buffer

    def load() -> Any:
        # A fresh unpickler per batch: each is a pickle of its own, with its own memo.
        return pickle.load(stdin)

    #: the last ``after``, whole: the timeline's view of each delta
    state: Mapping[str, Any] | None = None

    def whole(st: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        nonlocal state
        if states.CHANGED in st:
            assert state is not None
            before, state = state, states.apply(state, st)
            return before, state
        state = st["after"]
        return st["before"], st["after"]

    try:
        while True:
            try:
                batch = load()
            except EOFError:
                return 0  # the dispatching process is gone: keep what came, no end line
            for item in batch:
                if item[0] >= EXTRA and extra is not None:
                    extra(rec, item)
                elif _apply(rec, item, whole, out):
                    return 0
    finally:
        rec.close()


def _apply(
    rec: Any,
    item: tuple[Any, ...],
    whole: Callable[[Mapping[str, Any]], tuple[Mapping[str, Any], Mapping[str, Any]]],
    out: Any,
) -> bool:
    """Write one item; True for the close."""
    op = item[0]
    if op == DISPATCH:
        _, i, stream, entry_id, sender, k, values, now, st, outs, extra = item
        before, after = whole(st)
        rec.write_dispatch(
            i, stream, entry_id, sender, unpack_msg(k, values), now, st, outs, extra,
            before, after,
        )  # fmt: skip
    elif op == CORE:
        _, event, i, now, st, outs, extra = item
        before, after = whole(st)
        rec.write_core(event, i, now, st, outs, extra, before, after)
    elif op == EVENT:
        rec.write_event(item[1], item[2])
    elif op == PORT:
        _, i, call, args, result = item
        rec.write_port(i, call, args, result)
    elif op == HEADER:
        rec.header(**item[1])
    elif op == END:
        rec.end(**item[1])
    elif op == FLUSH:
        rec.flush()
        out.write(b"flushed\n")
        out.flush()
    elif op == CLOSE:
        return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    # A Ctrl-C or a TERM to the process group is the coordinator's to handle: it stops
    # the run and closes this record in order; the child ends with its input.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    args = sys.argv[1:] if argv is None else list(argv)
    return serve(json.loads(args[0]))


if __name__ == "__main__":
    sys.exit(main())
