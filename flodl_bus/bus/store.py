"""A ``torch.distributed.Store`` on Redis, so process groups form from the run's Redis alone.

torch's C++ side (gloo, NCCL, ``PrefixStore``) calls a Python subclass of ``Store``
through pybind's trampoline, so gloo's rendezvous (``set`` its address, ``get``/``wait``
for the peers') lands in the methods below.

Layout under ``prefix`` (one prefix per session; a re-session picks a new one, so keys of a
dead session can never satisfy a ``get`` of the new one):

- ``<prefix>k:<key>``  the value (a Redis string; counters are decimal strings, as torch's
  own stores keep them, so ``get`` of an ``add`` key gives ``b"3"``);
- ``<prefix>r:<key>``  a one-element list that exists exactly while the key exists. A
  waiter blocks on ``BLMOVE r r`` (a rotation, so it consumes nothing and any number of
  waiters wake), which gives event-driven waits instead of polling;
- ``<prefix>keys``     a set of the key names, for ``num_keys``.

Every blocking call is sliced into ``BLMOVE`` blocks well under the client's socket
timeout (redis-py 8 silently retries a timed-out read otherwise) and bounded overall by
the store's ``timeout`` or the caller's. Idempotent operations ride out a lost connection
or a transient write refusal through the bus's one retry policy (``connection.Link``)
until that timeout, then fail with ``DistStoreError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import redis
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from flodl_bus.bus.connection import BusUnavailable, Link

T = TypeVar("T")

DEFAULT_TIMEOUT = timedelta(seconds=30)
#: Socket timeout of a client this module builds from a URL.
SOCKET_TIMEOUT_S = 5.0


def _as_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _as_str(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode()


def _seconds(timeout: timedelta | float | None, default: timedelta) -> float:
    if timeout is None:
        return default.total_seconds()
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


class RedisStore(Store):
    """``torch.distributed.Store`` backed by Redis keys under ``prefix``."""

    def __init__(
        self,
        client_or_url: redis.Redis | str,
        prefix: str,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        *,
        cancelled: Callable[[], str | None] | None = None,
    ) -> None:
        """``cancelled``: asked between two slices of every wait; a reason given ends the
        wait at once with ``DistStoreError`` (a rendezvous that can never complete,
        because a newer session was offered, stops holding its caller)."""
        super().__init__()
        self._cancelled = cancelled
        if isinstance(client_or_url, str):
            self._client: redis.Redis = redis.Redis.from_url(
                client_or_url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=5.0
            )
            self._owns_client = True
            self._url: str | None = client_or_url
        else:
            self._client = client_or_url
            self._owns_client = False
            self._url = None
        self.prefix = prefix
        self._link = Link(self._client, name="rendezvous store", where=prefix)
        self.set_timeout(timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout))
        sock = self._client.connection_pool.connection_kwargs.get("socket_timeout")
        # A blocking read must return before the socket gives up on it; half the socket
        # timeout leaves room for the round trip, 1 s keeps timeouts responsive.
        self._block_slice = 1.0 if sock is None else max(0.01, min(1.0, float(sock) / 2))

    # -- key names ------------------------------------------------------------------------

    def _k(self, key: str) -> str:
        return f"{self.prefix}k:{key}"

    def _r(self, key: str) -> str:
        return f"{self.prefix}r:{key}"

    @property
    def _keys(self) -> str:
        return f"{self.prefix}keys"

    def _mark(self, pipe: Any, key: str) -> None:
        # DEL first so the ready list holds exactly one element however often it is set.
        pipe.delete(self._r(key))
        pipe.rpush(self._r(key), b"1")
        pipe.sadd(self._keys, key)

    # -- Store API ------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        def op() -> None:
            pipe = self._client.pipeline(transaction=True)
            pipe.set(self._k(key), _as_bytes(value))
            self._mark(pipe, key)
            pipe.execute()

        self._retrying(op, "set")

    def get(self, key: str) -> bytes:  # type: ignore[override]
        while True:
            got = self._retrying(lambda: self._client.get(self._k(key)), "get")
            if got is not None:
                return _as_bytes(got)
            # The key may be deleted between the wait and the GET; then wait again.
            self._wait_one(key, time.monotonic() + self._timeout_s())

    # add, append and compare_set are not retried: a reply lost after the server ran
    # them would make a retry count twice. A connection lost while idle is replaced by
    # redis-py before use, so what reaches the caller is a loss in mid-command.
    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        pipe = self._client.pipeline(transaction=True)
        pipe.incrby(self._k(key), int(amount))
        self._mark(pipe, key)
        return int(pipe.execute()[0])

    def compare_set(  # type: ignore[override]
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """torch semantics: set when the current value equals ``expected``, or when the key
        is missing and ``expected`` is empty; return the value now stored (or ``expected``
        when the key is missing and nothing was set)."""
        expected = _as_bytes(expected_value)
        desired = _as_bytes(desired_value)
        k = self._k(key)

        outcome: list[bytes] = []

        def attempt(pipe: Any) -> None:
            outcome.clear()
            current = pipe.get(k)
            if (current is None and expected == b"") or (
                current is not None and bytes(current) == expected
            ):
                pipe.multi()
                pipe.set(k, desired)
                self._mark(pipe, key)
                outcome.append(desired)
            else:
                outcome.append(expected if current is None else bytes(current))

        # WATCH/MULTI: a concurrent writer makes EXEC fail and the callable run again.
        self._client.transaction(attempt, k)
        return outcome[0]

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        deadline = time.monotonic() + _seconds(timeout, timedelta(seconds=self._timeout_s()))
        for key in keys:
            self._wait_one(key, deadline)

    def check(self, keys: Sequence[str]) -> bool:  # type: ignore[override]
        if not keys:
            return True
        names = [self._k(k) for k in keys]
        return int(self._retrying(lambda: self._client.exists(*names), "check")) == len(keys)

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        def op() -> bool:
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self._k(key))
            pipe.delete(self._r(key))
            pipe.srem(self._keys, key)
            return int(pipe.execute()[0]) > 0

        return self._retrying(op, "delete_key")

    def num_keys(self) -> int:  # type: ignore[override]
        return int(self._retrying(lambda: self._client.scard(self._keys), "num_keys"))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # type: ignore[override]
        deadline = time.monotonic() + self._timeout_s()
        for key in keys:
            self._wait_one(key, deadline)
        names = [self._k(k) for k in keys]
        values = self._retrying(lambda: self._client.mget(names), "multi_get")
        if any(v is None for v in values):  # deleted under us: fall back to blocking gets
            return [self.get(k) for k in keys]
        return [_as_bytes(v) for v in values if v is not None]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:  # type: ignore[override]
        if len(keys) != len(values):
            raise ValueError("multi_set: keys and values differ in length")

        def op() -> None:
            pipe = self._client.pipeline(transaction=True)
            for key, value in zip(keys, values):
                pipe.set(self._k(key), _as_bytes(value))
                self._mark(pipe, key)
            pipe.execute()

        self._retrying(op, "multi_set")

    def append(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        pipe = self._client.pipeline(transaction=True)
        pipe.append(self._k(key), _as_bytes(value))
        self._mark(pipe, key)
        pipe.execute()

    def list_keys(self) -> list[str]:  # type: ignore[override]
        members = self._retrying(lambda: self._client.smembers(self._keys), "list_keys")
        return sorted(_as_str(m) for m in members)

    def clone(self) -> RedisStore:  # type: ignore[override]
        """A store on the same keys with its own connections (safe from another thread)."""
        if self._url is not None:
            return RedisStore(self._url, self.prefix, self._timeout_s(), cancelled=self._cancelled)
        kwargs = dict(self._client.connection_pool.connection_kwargs)
        pool = self._client.connection_pool.__class__(
            connection_class=self._client.connection_pool.connection_class, **kwargs
        )
        return RedisStore(
            redis.Redis(connection_pool=pool),
            self.prefix,
            self._timeout_s(),
            cancelled=self._cancelled,
        )

    def has_extended_api(self) -> bool:
        return True

    # torch's trampoline looks some overrides up by their C++ names (PrefixStore and the
    # backends call these), so the snake_case methods are exposed under both.
    def getNumKeys(self) -> int:
        return self.num_keys()

    def deleteKey(self, key: str) -> bool:
        return self.delete_key(key)

    # -- helpers --------------------------------------------------------------------------

    def _timeout_s(self) -> float:
        # The C++ base owns the timeout (``set_timeout`` may come from torch itself);
        # torch's stub file does not declare the property, hence getattr.
        value: timedelta = getattr(self, "timeout")  # noqa: B009
        return value.total_seconds()

    def _retrying(self, op: Callable[[], T], what: str) -> T:
        """``op`` (idempotent), run again through outages until the store's timeout: a
        rendezvous that hit a dropped connection would otherwise fail its session for
        good, and every rank would wait for a new one that never comes."""
        try:
            return self._link.call(
                lambda _retry: op(), deadline=time.monotonic() + self._timeout_s()
            )
        except BusUnavailable as exc:
            raise dist.DistStoreError(f"RedisStore {what} under {self.prefix!r}: {exc}") from exc

    def _wait_one(self, key: str, deadline: float) -> None:
        ready = self._r(key)
        while True:
            if self._retrying(lambda: self._client.exists(self._k(key)), "wait"):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(
                    f"RedisStore: key {key!r} under {self.prefix!r} not set within the timeout"
                )
            why = None if self._cancelled is None else self._cancelled()
            if why is not None:
                raise dist.DistStoreError(
                    f"RedisStore: the wait for {key!r} under {self.prefix!r} was given up: {why}"
                )
            # Redis takes fractional BLMOVE timeouts; 0 would block forever.
            block = max(0.01, min(self._block_slice, left))
            # A rotation consumes nothing, so a BLMOVE whose reply was lost is harmless.
            self._retrying(
                lambda block=block: self._client.blmove(ready, ready, block, "LEFT", "RIGHT"),  # type: ignore[arg-type,misc]
                "wait",
            )

    def clear(self) -> int:
        """Delete every key of this prefix (a finished session's leftovers)."""
        names = [_as_str(m) for m in self._client.smembers(self._keys)]
        if not names:
            return 0
        pipe = self._client.pipeline(transaction=True)
        for name in names:
            pipe.delete(self._k(name), self._r(name))
        pipe.delete(self._keys)
        pipe.execute()
        return len(names)

    def close(self) -> None:
        self._link.close()
        if self._owns_client:
            self._client.close()
