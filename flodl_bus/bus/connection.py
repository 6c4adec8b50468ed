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

import argparse
import os
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import structlog
from redis.backoff import NoBackoff
from redis.retry import Retry

from flodl_bus.bus.cluster import ClusterUrlError, is_cluster_url, pinned_client, split_url

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


# Anywhere in a text (a log field may hold a URL inside a sentence), not only at its start.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^@/\s]*)@")


def _mask(m: re.Match[str]) -> str:
    # Without a colon the userinfo is a user name (as redis-py reads it), not a secret.
    user, sep, _ = m.group("userinfo").partition(":")
    return f"{m.group('scheme')}{user}:***@" if sep else m.group(0)


def redact_url(url: str) -> str:
    """The URL (or every URL in a text) with any password replaced by ``***`` (also for
    URLs that do not parse). The one redaction of URLs: the record's ``redact`` uses it."""
    return _USERINFO.sub(_mask, url)


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
    key: str | None = None,
) -> redis.Redis:
    """A client (with its own connection pool) for ``url``; bytes in, bytes out.

    A Redis Cluster URL (``redis+cluster://``, ``bus.cluster``) gives a client pinned to
    the master of ``key``'s slot: the caller names the key (a run's meta, a rank's
    control stream) whose slot it works in."""
    if socket_timeout * 1000 <= 2 * MAX_BLOCK_MS:
        raise ValueError(
            f"socket_timeout {socket_timeout}s must exceed twice the longest BLOCK "
            f"({MAX_BLOCK_MS} ms), or a quiet stream would look like a dead server"
        )
    cluster_url = url
    if is_cluster_url(url):
        if key is None:
            raise BadRedisUrl(
                f"{redact_url(url)} is a Redis Cluster URL, which only `flodl-bus "
                "coordinator` and `worker` take: give this command a single Redis's "
                "redis:// URL"
            )
        try:
            url = split_url(url)[0]
        except ClusterUrlError as exc:
            raise BadRedisUrl(f"{exc} (in {redact_url(cluster_url)!r})") from None
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
        for name, value in t.ssl_options:
            tcp[name] = (
                value.lower() in ("1", "true", "yes") if name == "ssl_check_hostname" else value
            )
    if cluster_url is not url:
        if t.db != 0:
            raise BadRedisUrl(f"a Redis Cluster has database 0 only: {redact_url(cluster_url)}")
        assert key is not None
        return pinned_client(cluster_url, key, common=common, tcp=tcp)
    return redis.Redis(**common, **tcp)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- reconnects


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff schedule: ``base * factor**attempt``, capped, jittered.

    ``delay`` is the ceiling of one wait; ``Link`` waits a random time between
    ``(1 - jitter) * delay`` and ``delay``, so the ranks of a run that lost Redis together
    do not all knock at the same instant when it comes back.
    """

    base_s: float = 0.05
    factor: float = 2.0
    cap_s: float = 2.0
    jitter: float = 0.5

    def delay(self, attempt: int) -> float:
        return float(min(self.cap_s, self.base_s * self.factor ** min(attempt, 64)))

    def jittered(self, attempt: int, rand: float) -> float:
        """The wait before attempt ``attempt + 1``, for a uniform ``rand`` in [0, 1)."""
        return self.delay(attempt) * (1.0 - self.jitter * rand)


#: Replies under which Redis did not run a write and will again once the condition
#: passes: the server is full (noeviction), a replica (READONLY), its master is gone,
#: it runs a long script (BUSY), or its last snapshot failed (MISCONF, writes refused
#: until one succeeds). ``LOADING`` is a ``ConnectionError`` in redis-py and handled
#: as a lost connection. None of these replies means the command ran, so rerunning the
#: op is harmless; a pipeline may have run the commands before the refused one, which
#: is why a retried op is told ``retry=True`` like after a lost reply.
_TRANSIENT_CODES: Final = {
    "OOM": "out of memory",
    "READONLY": "read-only replica",
    "MASTERDOWN": "master down",
    "BUSY": "busy running a script",
    "MISCONF": "snapshot failing, writes refused",
    "TRYAGAIN": "try again",
    "CLUSTERDOWN": "cluster down",
    "MOVED": "slot served by another node (failover or resharding)",
    "ASK": "slot migrating to another node",
}
#: A pipeline's error reads "Command # 2 (XADD ...) of pipeline caused error: OOM ...";
#: a plain one "BUSY Redis is busy ..." (redis-py strips the codes it knows, so the
#: class says those; the others keep their code in the message).
_CODE_IN_MESSAGE: Final = re.compile(r"(?:^|caused error: |because of: )([A-Z]+) ")


def transient_kind(exc: BaseException) -> str | None:
    """The short name of a transient write refusal (``"OOM"``, ...), None for others."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return "OOM"
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return "READONLY"
    if isinstance(exc, redis.exceptions.MasterDownError):
        return "MASTERDOWN"
    if isinstance(exc, redis.exceptions.TryAgainError):
        return "TRYAGAIN"
    if isinstance(exc, redis.exceptions.ClusterDownError):
        return "CLUSTERDOWN"
    if isinstance(exc, redis.exceptions.AskError):  # MovedError subclasses AskError
        return "MOVED" if isinstance(exc, redis.exceptions.MovedError) else "ASK"
    if type(exc) is redis.exceptions.ResponseError:
        m = _CODE_IN_MESSAGE.search(str(exc))
        if m is not None and m.group(1) in ("BUSY", "MISCONF"):
            return m.group(1)
    if isinstance(exc, redis.exceptions.ExecAbortError):
        # EXEC refused whole ("Transaction discarded because of: OOM ..."): the
        # condition began after the commands were queued; nothing of it ran.
        m = _CODE_IN_MESSAGE.search(str(exc))
        if m is not None and m.group(1) in _TRANSIENT_CODES:
            return m.group(1)
    return None


def describe_transient(kind: str, client: redis.Redis | None = None) -> str:
    """One line for a console: what refuses writes, with the memory figures for OOM
    when the user may read them (``INFO`` is denied to the ``worker`` ACL user)."""
    text = _TRANSIENT_CODES.get(kind, kind)
    if kind != "OOM" or client is None:
        return text
    try:
        info = client.info("memory")
    except redis.exceptions.RedisError:
        return f"{text} (maxmemory reached, noeviction)"
    return (
        f"{text} (maxmemory {info.get('maxmemory_human', '?')}, "
        f"used {info.get('used_memory_human', '?')})"
    )


class Link:
    """One bus actor's way to Redis: run an operation, retrying through outages.

    ``call(op)`` runs ``op(retry)``. Two kinds of episode make it wait and try again:

    - a lost connection (refused, reset, timed out, LOADING): it waits a jittered
      backoff, checks the server with PING and reruns ``op(True)`` once it answers;
    - a transient write refusal (OOM under noeviction, READONLY, MASTERDOWN, BUSY,
      MISCONF): the server answers PING all along, so the probe is the op itself.

    Each episode logs one line when it starts (``redis_unreachable`` /
    ``redis_write_blocked`` with the reason) and one when it ends (``redis_reconnected``
    / ``redis_write_resumed`` with how long it lasted), never one per attempt.

    A caller's ``deadline`` bounds the call, never the episode: the link sleeps at most
    until the deadline, always tries once more before giving up with ``BusUnavailable``,
    and the next call continues the same episode (backoff position included). So a
    reader polling with 1 s deadlines tries about once a second, and the time it stays
    deaf after Redis returns is at most one backoff ceiling (``cap_s``), however long the
    outage was. Nothing here gives up on its own: the liveness budget is the caller's
    (a rank's coordinator-liveness timeout, the coordinator's heartbeat timeout).

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
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.client = client
        self.name = name
        self.where = where
        self.backoff = backoff or Backoff()
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._sleep = sleep or self._interruptible_sleep
        self._clock = clock
        self._rand = rand
        self._down_since: float | None = None
        self._down_error = ""
        self._blocked_since: float | None = None
        self._blocked_kind = ""
        self._attempts = 0
        self.reconnects = 0
        #: transient write-refusal episodes seen (OOM, READONLY, ...)
        self.write_blocks = 0

    def _interruptible_sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    @property
    def is_down(self) -> bool:
        return self._down_since is not None

    @property
    def blocked(self) -> str | None:
        """The kind of the write refusal in progress (``"OOM"``, ...), else None."""
        return self._blocked_kind if self._blocked_since is not None else None

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
                result = op(retry)
            except (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError):
                raise  # retrying cannot fix credentials
            except RETRYABLE as exc:
                retry = True
                self._lost(exc)
                continue
            except redis.exceptions.ResponseError as exc:
                kind = transient_kind(exc)
                if kind is None:
                    raise
                retry = True
                self._refused(kind, exc)
                if kind in ("MOVED", "ASK"):
                    self._redirected()
                self._pause(deadline, f"writes refused ({self._blocked_kind})")
                continue
            if self._blocked_since is not None:
                self._unblocked()
            return result

    def _redirected(self) -> None:
        """The slot lives elsewhere now (a pinned cluster client, ``bus.cluster``):
        every connection of the client goes, so the next one asks where the slot is,
        and a reader re-reads its pending entries there."""
        self.client.connection_pool.disconnect()
        if self.on_lost is not None:
            self.on_lost()

    def _pause(self, deadline: float | None, why: str) -> None:
        """After a failed attempt: give up if ``deadline`` has passed, else wait the next
        backoff step, cut short at the deadline so one more attempt fits in the call."""
        if deadline is not None and self._clock() >= deadline:
            raise BusUnavailable(f"{self.name}: {why}")
        self._backoff_sleep(deadline, why)

    def _backoff_sleep(self, deadline: float | None, why: str) -> None:
        if self._stop.is_set():
            raise BusClosed(f"{self.name}: closed while {why}")
        delay = self.backoff.jittered(self._attempts, self._rand())
        if deadline is not None:
            delay = min(delay, max(0.0, deadline - self._clock()))
        self._sleep(delay)
        self._attempts += 1
        if self._stop.is_set():
            raise BusClosed(f"{self.name}: closed while {why}")

    def _lost(self, exc: BaseException) -> None:
        self._down_since = self._clock()
        self._down_error = f"{type(exc).__name__}: {exc}"[:200]
        self._attempts = 0
        log.warning("redis_unreachable", link=self.name, redis=self.where, error=self._down_error)
        if self.on_lost is not None:
            self.on_lost()

    def _refused(self, kind: str, exc: BaseException) -> None:
        if self._blocked_since is not None and kind == self._blocked_kind:
            return  # the same episode goes on
        self._blocked_since = self._clock()
        self._blocked_kind = kind
        self._attempts = 0
        self.write_blocks += 1
        log.warning(
            "redis_write_blocked",
            link=self.name,
            redis=self.where,
            kind=kind,
            reason=describe_transient(kind, self.client),
            error=f"{type(exc).__name__}: {exc}"[:200],
        )

    def _unblocked(self) -> None:
        assert self._blocked_since is not None
        log.warning(
            "redis_write_resumed",
            link=self.name,
            redis=self.where,
            kind=self._blocked_kind,
            attempts=self._attempts,
            blocked_s=round(self._clock() - self._blocked_since, 3),
        )
        self._blocked_since = None
        self._attempts = 0

    def _wait_up(self, deadline: float | None) -> None:
        """Back off, PING, until Redis answers (or the deadline passes, after at least
        one PING in this call)."""
        assert self._down_since is not None
        # The first PING of a call comes after at most one (deadline-cut) backoff step,
        # so a call never gives up without having tried.
        self._backoff_sleep(deadline, "reconnecting")
        while True:
            try:
                self.client.ping()
            except (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError):
                raise
            except RETRYABLE as exc:
                self._down_error = f"{type(exc).__name__}: {exc}"[:200]
                self._pause(deadline, f"Redis unreachable ({self._down_error})")
                continue
            except redis.exceptions.ResponseError as exc:
                # Up, but refusing even a PING for now (BUSY: a script runs): weather,
                # like a refused write, not a reason to stop the process.
                if transient_kind(exc) is None:
                    raise
                self._down_error = f"{type(exc).__name__}: {exc}"[:200]
                self._pause(deadline, f"Redis refuses commands ({self._down_error})")
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
            self._attempts = 0
            return


class RedisUnreachable(ValueError):
    """A command line's Redis cannot be used; the message is one line naming the fix."""


def credentials_of(url: str, env: Mapping[str, str] | None = None) -> str:
    """Who a command talks to Redis as, and where that came from, for its error lines:
    ``user 'worker' (from FLODL_REDIS_USERNAME)``. Never the password."""
    env = os.environ if env is None else env
    try:
        parts = urlsplit(url)
        in_url_user, in_url_pass = parts.username, parts.password
    except ValueError:
        in_url_user = in_url_pass = None
    if in_url_user:
        user, where = unquote(in_url_user), "the URL"
    elif env.get(ENV_USERNAME):
        user, where = env[ENV_USERNAME], ENV_USERNAME
    else:
        user, where = "default", "no username given"
    if in_url_pass:
        pw = "password from the URL"
    elif env.get(ENV_PASSWORD):
        pw = f"password from {ENV_PASSWORD}"
    else:
        pw = "no password"
    return f"user {user!r} ({where}; {pw})"


def describe_refusal(exc: BaseException, url: str, env: Mapping[str, str] | None = None) -> str:
    """One line for Redis refusing who we are (wrong password, user off, an ACL that
    lacks a command or key), naming the user and where its credentials came from."""
    who = credentials_of(url, env)
    where = redact_url(url)
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return (
            f"Redis at {where} refused {who}: {detail}; give this user the role's rules "
            "(ops/users.acl, or `flodl-bus acl create RUN`) or use the role's own user"
        )
    return (
        f"Redis at {where} did not accept {who} ({detail}): fix the user or password "
        f"(URL, or {ENV_USERNAME} / {ENV_PASSWORD})"
    )


#: what ``describe_refusal`` explains: an answer about who we are, not a lost link
REFUSALS: Final = (
    redis.exceptions.AuthenticationError,
    redis.exceptions.AuthorizationError,
    redis.exceptions.NoPermissionError,
)


def connect_pinged(url: str, *, client_name: str, key: str | None = None) -> redis.Redis:
    """``connect`` plus a PING, for a command that cannot start without Redis: a bad URL,
    a server that does not answer, or one that refuses the credentials becomes one
    ``RedisUnreachable`` line (the URL's password redacted, the user and where its
    credentials came from named), never a traceback."""
    try:
        client = connect(url, client_name=client_name, key=key)
        client.ping()
    except BadRedisUrl as exc:
        raise RedisUnreachable(f"--redis-url: {exc}") from None
    except REFUSALS as exc:
        raise RedisUnreachable(describe_refusal(exc, url)) from None
    except Exception as exc:
        raise RedisUnreachable(
            f"cannot reach Redis at {redact_url(url)} ({type(exc).__name__}): "
            "start it or fix --redis-url"
        ) from None
    if not is_cluster_url(url) and _is_cluster_node(client):
        client.close()
        raise RedisUnreachable(
            f"Redis at {redact_url(url)} is a node of a Redis Cluster: give `flodl-bus "
            "coordinator` and `worker` the cluster's URL, redis+cluster://HOST:PORT; other "
            "commands take a single Redis"
        )
    return client


def _is_cluster_node(client: redis.Redis) -> bool:
    """Whether ``client``'s server runs in cluster mode (there, a plain client would meet
    MOVED on most keys). A user without INFO (the worker ACL user) is not asked."""
    try:
        info: Any = client.info("cluster")
    except redis.exceptions.RedisError:
        return False
    return bool(int(info.get("cluster_enabled", 0) or 0))


def add_url_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--redis-url``, defaulting to ``$FLODL_REDIS_URL``: every command that talks to
    a run's Redis takes it the same way."""
    parser.add_argument(
        "--redis-url",
        default=os.environ.get(ENV_URL, DEFAULT_URL),
        help=f"Redis URL (default: ${ENV_URL} or {DEFAULT_URL}); `coordinator` and "
        "`worker` also take a Redis Cluster's redis+cluster://HOST:PORT[,HOST:PORT]",
    )
