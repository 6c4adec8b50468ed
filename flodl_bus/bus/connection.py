"""Connections to Redis from a URL, and the reconnect policy of every bus actor.

Two redis-py 8 defaults are wrong for a control plane and are overridden here:

- its silent retries: a write whose reply was lost would be re-sent behind our back.
  Retries are off (``Retry(NoBackoff(), 0)``); the bus retries itself, through ``Link``,
  and every write it retries is idempotent (explicit entry ids, see ``streams``).
- no explicit socket timeout: blocking reads use ``BLOCK`` of at most ``MAX_BLOCK_MS``,
  far below ``DEFAULT_SOCKET_TIMEOUT``, so a timeout always means a dead peer, never a
  quiet stream (DESIGN §3 rule 6).

Secrets never reach a log: URLs are logged through ``redact_url`` only.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import structlog
from redis.backoff import NoBackoff
from redis.retry import Retry

ENV_USERNAME: Final = "FLODL_REDIS_USERNAME"
ENV_PASSWORD: Final = "FLODL_REDIS_PASSWORD"
ENV_URL: Final = "FLODL_REDIS_URL"
DEFAULT_URL: Final = "redis://127.0.0.1:6379/0"
DEFAULT_SOCKET_TIMEOUT: Final = 10.0
DEFAULT_CONNECT_TIMEOUT: Final = 5.0
#: Upper bound of any BLOCK we issue: a tenth of the socket timeout.
MAX_BLOCK_MS: Final = 1000

#: Errors after which the connection is gone and the command may or may not have run.
#: ``AuthenticationError`` subclasses ``ConnectionError`` but retrying cannot fix it.
RETRYABLE: Final = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

_SSL_PARAMS: Final = {
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
}

log = structlog.get_logger("flodl_bus.bus")

T = TypeVar("T")


class BadRedisUrl(ValueError):
    pass


class BusUnavailable(ConnectionError):
    """Redis stayed unreachable until the caller's deadline (the link keeps retrying)."""


class BusClosed(RuntimeError):
    """The link was closed while waiting for Redis."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed Redis URL. ``password`` never appears in ``repr``."""

    scheme: str
    host: str | None
    port: int | None
    path: str | None
    db: int
    username: str | None
    password: str | None = field(repr=False)
    ssl_options: tuple[tuple[str, str], ...] = ()

    @property
    def redacted(self) -> str:
        auth = ""
        if self.username or self.password:
            auth = f"{self.username or ''}{':***' if self.password else ''}@"
        if self.scheme == "unix":
            return f"unix://{auth}{self.path}?db={self.db}"
        return f"{self.scheme}://{auth}{self.host}:{self.port}/{self.db}"


_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^@/]*)@")


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (also for URLs that do not parse)."""
    m = _USERINFO.match(url)
    if m is None:
        return url
    # Without a colon the userinfo is a user name (as redis-py reads it), not a secret.
    user, sep, _ = m.group("userinfo").partition(":")
    masked = f"{user}:***" if sep else user
    return f"{m.group('scheme')}{masked}@{url[m.end() :]}"


def parse_url(url: str, env: Mapping[str, str] | None = None) -> RedisTarget:
    """Parse ``redis://``, ``rediss://`` or ``unix://`` URLs.

    Credentials come from the URL, else from ``FLODL_REDIS_USERNAME`` /
    ``FLODL_REDIS_PASSWORD``. The database is the path (``/2``) or ``?db=2``.
    """
    env = os.environ if env is None else env
    try:
        parts = urlsplit(url)
        port_in_url = parts.port
    except ValueError as exc:
        raise BadRedisUrl(f"cannot parse Redis URL {redact_url(url)!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "unix"):
        raise BadRedisUrl(
            f"unsupported Redis URL scheme {parts.scheme!r} in {redact_url(url)!r}: "
            "use redis://, rediss:// or unix://"
        )
    query = dict(parse_qsl(parts.query))
    username = unquote(parts.username) if parts.username else env.get(ENV_USERNAME) or None
    password = unquote(parts.password) if parts.password else env.get(ENV_PASSWORD) or None
    db_text = query.pop("db", None)
    if scheme == "unix":
        if not parts.path:
            raise BadRedisUrl(f"unix URL without a socket path: {redact_url(url)!r}")
        host, port, path = None, None, unquote(parts.path)
    else:
        if not parts.hostname:
            raise BadRedisUrl(f"Redis URL without a host: {redact_url(url)!r}")
        host, port, path = parts.hostname, port_in_url or 6379, None
        tail = parts.path.lstrip("/")
        if tail and db_text is None:
            db_text = tail
    try:
        db = int(db_text) if db_text else 0
    except ValueError:
        raise BadRedisUrl(f"bad database number {db_text!r} in {redact_url(url)!r}") from None
    unknown = set(query) - _SSL_PARAMS
    if unknown:
        raise BadRedisUrl(f"unknown URL option(s) {sorted(unknown)} in {redact_url(url)!r}")
    if query and scheme != "rediss":
        raise BadRedisUrl(f"TLS options need a rediss:// URL: {redact_url(url)!r}")
    return RedisTarget(
        scheme=scheme,
        host=host,
        port=port,
        path=path,
        db=db,
        username=username,
        password=password,
        ssl_options=tuple(sorted(query.items())),
    )


def connect(
    url: str,
    *,
    socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    client_name: str | None = None,
    env: Mapping[str, str] | None = None,
) -> redis.Redis:
    """A client (with its own connection pool) for ``url``; bytes in, bytes out."""
    if socket_timeout * 1000 <= 2 * MAX_BLOCK_MS:
        raise ValueError(
            f"socket_timeout {socket_timeout}s must exceed twice the longest BLOCK "
            f"({MAX_BLOCK_MS} ms), or a quiet stream would look like a dead server"
        )
    t = parse_url(url, env)
    common: dict[str, object] = {
        "db": t.db,
        "username": t.username,
        "password": t.password,
        "socket_timeout": socket_timeout,
        "decode_responses": False,
        # No silent retries: a lost reply must surface, so the bus can retry idempotently.
        "retry": Retry(NoBackoff(), 0),
        "client_name": client_name,
        # The bus parses RESP2 reply shapes (XREADGROUP as a list of [stream, entries]).
        "protocol": 2,
    }
    if t.scheme == "unix":
        return redis.Redis(unix_socket_path=t.path, **common)  # type: ignore[arg-type]
    tcp: dict[str, object] = {
        "host": t.host,
        "port": t.port,
        "socket_connect_timeout": connect_timeout,
        "socket_keepalive": True,
    }
    if t.scheme == "rediss":
        tcp["ssl"] = True
        for key, value in t.ssl_options:
            tcp[key] = (
                value.lower() in ("1", "true", "yes") if key == "ssl_check_hostname" else value
            )
    return redis.Redis(**common, **tcp)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- reconnects


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff schedule: ``base * factor**attempt``, capped."""

    base_s: float = 0.05
    factor: float = 2.0
    cap_s: float = 2.0

    def delay(self, attempt: int) -> float:
        return float(min(self.cap_s, self.base_s * self.factor ** min(attempt, 64)))


class Link:
    """One bus actor's way to Redis: run an operation, reconnecting with backoff.

    ``call(op)`` runs ``op(retry)``; on a lost connection it waits (backoff), checks the
    server with PING, logs exactly one ``redis_reconnected`` line, and runs ``op(True)``.
    ``retry=True`` tells the op its previous attempt may have been applied without a
    reply, so it must be idempotent. ``on_lost`` runs once per lost connection (a reader
    uses it to re-read its pending entries: a lost XREADGROUP reply leaves entries
    delivered to it but never seen).
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        name: str,
        where: str = "",
        backoff: Backoff | None = None,
        on_lost: Callable[[], None] | None = None,
        sleep: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.name = name
        self.where = where
        self.backoff = backoff or Backoff()
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._sleep = sleep or self._interruptible_sleep
        self._clock = clock
        self._down_since: float | None = None
        self._down_error = ""
        self._attempts = 0
        self.reconnects = 0

    def _interruptible_sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    @property
    def is_down(self) -> bool:
        return self._down_since is not None

    def close(self) -> None:
        self._stop.set()

    def call(self, op: Callable[[bool], T], *, deadline: float | None = None) -> T:
        retry = False
        while True:
            if self._down_since is not None:
                self._wait_up(deadline)
            if self._stop.is_set():
                raise BusClosed(f"{self.name}: closed")
            try:
                return op(retry)
            except redis.exceptions.AuthenticationError:
                raise
            except RETRYABLE as exc:
                retry = True
                self._lost(exc)

    def _lost(self, exc: BaseException) -> None:
        self._down_since = self._clock()
        self._down_error = f"{type(exc).__name__}: {exc}"[:200]
        self._attempts = 0
        if self.on_lost is not None:
            self.on_lost()

    def _wait_up(self, deadline: float | None) -> None:
        assert self._down_since is not None
        while True:
            if self._stop.is_set():
                raise BusClosed(f"{self.name}: closed while reconnecting")
            delay = self.backoff.delay(self._attempts)
            if deadline is not None and self._clock() + delay > deadline:
                # Keep the backoff position: the next call continues the schedule.
                self._sleep(max(0.0, deadline - self._clock()))
                raise BusUnavailable(f"{self.name}: Redis unreachable ({self._down_error})")
            self._sleep(delay)
            self._attempts += 1
            try:
                self.client.ping()
            except redis.exceptions.AuthenticationError:
                raise
            except RETRYABLE:
                continue
            down_s = self._clock() - self._down_since
            self.reconnects += 1
            log.warning(
                "redis_reconnected",
                link=self.name,
                redis=self.where,
                attempts=self._attempts,
                down_s=round(down_s, 3),
                error=self._down_error,
            )
            self._down_since = None
            return


class RedisUnreachable(ValueError):
    """A command line's Redis cannot be used; the message is one line naming the fix."""


def connect_pinged(url: str, *, client_name: str) -> redis.Redis:
    """``connect`` plus a PING, for a command that cannot start without Redis: a bad URL
    or a server that does not answer becomes one ``RedisUnreachable`` line (the URL's
    password redacted), never a traceback."""
    try:
        client = connect(url, client_name=client_name)
        client.ping()
    except BadRedisUrl as exc:
        raise RedisUnreachable(f"--redis-url: {exc}") from None
    except Exception as exc:
        raise RedisUnreachable(
            f"cannot reach Redis at {redact_url(url)} ({type(exc).__name__}): "
            "start it or fix --redis-url"
        ) from None
    return client
