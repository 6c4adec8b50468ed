"""What the launcher (``flodl-bus up``) tells the coordinator about the processes it
supervises, on a pipe the coordinator inherits (``--supervisor-fd``).

One JSON object per line: ``{"rank": R, "rc": CODE}`` when rank R's process exited with
CODE (negative: killed by that signal) without the run having told it to. The
coordinator hands it to the core as ``Coordinator.declare_dead`` (a recorded core call,
so a replay reproduces it): the survivors re-form at once instead of after the heartbeat
timeout. A rank that said Exiting first is already gone for the core, and the notice
changes nothing.

End of file means the launcher is gone (killed, crashed): nobody supervises the run
any more, so the coordinator stops it in order rather than leave orphans training.

The pipe is read on a thread of its own (a blocking readline); the loop takes what
arrived without blocking, from both of its phases.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import orjson
import structlog

log = structlog.get_logger("flodl_bus.coordinator")


@dataclass(frozen=True, slots=True)
class ChildExit:
    rank: int
    rc: int


def notice(rank: int, rc: int) -> bytes:
    """The line the launcher writes (the one home of the format)."""
    return orjson.dumps({"rank": rank, "rc": rc}) + b"\n"


class SupervisorFeed:
    def __init__(self, fd: int, on_eof: Callable[[], None]) -> None:
        self._q: queue.SimpleQueue[ChildExit] = queue.SimpleQueue()
        self._on_eof = on_eof
        self.gone = threading.Event()
        self._file = os.fdopen(fd, "rb", buffering=0)
        threading.Thread(target=self._read, name="supervisor-feed", daemon=True).start()

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                chunk = self._file.read(4096)
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    self._parse(line)
        except OSError as exc:
            log.warning("supervisor_feed_failed", error=repr(exc))
        finally:
            self.gone.set()
            self._on_eof()

    def _parse(self, line: bytes) -> None:
        try:
            obj = orjson.loads(line)
            rank, rc = int(obj["rank"]), int(obj["rc"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            log.warning("supervisor_notice_malformed", line=line[:200].decode(errors="replace"))
            return
        self._q.put(ChildExit(rank, rc))

    def take(self) -> list[ChildExit]:
        """Every notice that arrived so far; never blocks."""
        got: list[ChildExit] = []
        while True:
            try:
                got.append(self._q.get_nowait())
            except queue.Empty:
                return got
