"""A run directory belongs to one ``flodl-bus up`` while it runs.

Two launches with one run id pick the same directory when the first has not yet written
its coordinator's record (``record.dispatch.fresh_run_dir`` rotates only past a
record): the second then wrote into the first's files and, refused, deleted the
directory with the first run's records in it (issue 28). The launcher now holds an
exclusive ``flock`` on ``<run_dir>/.up.lock`` for its whole run; a second launch that
cannot take it refuses in one line and touches nothing. The kernel drops the lock when
the process ends, however it ends, so a killed launcher never leaves a stale one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
from pathlib import Path
from typing import Final

LOCK_NAME: Final = ".up.lock"
#: flock errors of a filesystem that has no locks at all (not of a held lock)
UNLOCKABLE: Final = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS})


class RunDirBusy(RuntimeError):
    """Another live launcher holds the run directory."""


class RunLock:
    """The held lock; ``release`` (or the process's end) lets it go."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def holder_of(run_dir: Path) -> str | None:
    """What the lock file says of its holder (a pid), if anything."""
    try:
        text = (run_dir / LOCK_NAME).read_text().strip()
    except OSError:
        return None
    return text or None


def take(run_dir: Path) -> RunLock:
    """Lock ``run_dir`` (made if absent) for this process, or raise ``RunDirBusy``.

    Opening never truncates: a busy directory's lock file keeps its holder's pid."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in UNLOCKABLE:
            # A filesystem without locks (some network mounts): the run goes on, said once.
            print(
                f"flodl-bus up: {run_dir} cannot be locked ({os.strerror(exc.errno)}): "
                "a second up with this run id would not be refused",
                file=sys.stderr,
            )
            return RunLock(fd, path)
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            who = holder_of(run_dir)
            raise RunDirBusy(
                f"{run_dir} is in use by another flodl-bus up"
                f"{f' (pid {who})' if who else ''}; use another --run or --run-dir, or "
                "wait for it to finish"
            ) from None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return RunLock(fd, path)
