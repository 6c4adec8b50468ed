"""SIGTERM, SIGINT and SIGHUP handled by the process itself, whatever it inherited.

A process never relies on the disposition it was started with: one started in the
background from a script inherits SIGINT *ignored*, and one running as PID 1 in a
container has SIGTERM ignored by the kernel unless it installs a handler. Every
``flodl-bus`` command therefore installs its own handlers for the three stop signals
(``exits.STOP_SIGNALS``) and stops in order on the first of them.

Two phases:

* until ``call_on_stop`` is given a callback, a stop signal raises ``SignalStop`` in
  the main thread (setup code is plain blocking code: imports, connects, waits);
* afterwards a signal never raises: the handler only writes a byte to a pipe, and a
  thread of its own calls the callback. A Python signal handler runs between two
  bytecodes of the main thread, which may be holding a lock the callback needs (a queue,
  the inbox, a recorder); running the callback elsewhere cannot deadlock on it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from flodl_bus.exits import STOP_SIGNALS


class SignalStop(BaseException):
    """A stop signal arrived during setup. A BaseException, like KeyboardInterrupt, so
    the ``except Exception`` of setup code does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


#: callback(signum of the first stop signal, how many have arrived so far)
StopCallback = Callable[[int, int], None]


class StopSignals:
    """Install with ``with StopSignals() as stop:``; the previous handlers come back on
    exit (``main`` functions also run inside test processes)."""

    def __init__(self) -> None:
        #: the first stop signal received, if any
        self.signum: int | None = None
        #: how many stop signals arrived (a second one hurries the stop)
        self.count = 0
        self._callback: StopCallback | None = None
        self._wake_w: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[int(sig)] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        _t: type[BaseException] | None,
        _e: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        w, self._wake_w = self._wake_w, None
        if w is not None:
            with contextlib.suppress(OSError):
                os.close(w)  # the watcher thread reads EOF and ends

    @property
    def exit_code(self) -> int | None:
        return None if self.signum is None else 128 + self.signum

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
        w = self._wake_w
        if w is not None:
            # os.write takes no Python-level lock: safe between any two bytecodes.
            with contextlib.suppress(OSError):
                os.write(w, b"\0")
            return
        raise SignalStop(signum)

    def call_on_stop(self, callback: StopCallback) -> None:
        """From now on a stop signal calls ``callback`` on the watcher thread instead of
        raising. A signal that already arrived is acted on at once."""
        self._callback = callback
        r, w = os.pipe()
        os.set_blocking(w, False)
        threading.Thread(target=self._watch, args=(r,), name="stop-signals", daemon=True).start()
        self._wake_w = w
        if self.signum is not None:
            with contextlib.suppress(OSError):
                os.write(w, b"\0")

    def _watch(self, r: int) -> None:
        seen = 0
        try:
            while True:
                data = os.read(r, 64)
                if not data:
                    return
                callback, signum = self._callback, self.signum
                if callback is None or signum is None:
                    continue
                for _ in data:
                    seen += 1
                    callback(signum, seen)
        finally:
            os.close(r)
