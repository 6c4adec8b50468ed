"""The per-run secret that keys every entry's MAC.

Either given to every process (``FLODL_RUN_SECRET``, hex), or created once by the
coordinator at ``RunKeys.secret`` (SET NX, so two racing coordinators agree) and read
from there by the workers. That key lies outside ``flodl:*``, which the read-only
observer user may read. The secret is never logged.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Final

import redis

from flodl_bus.bus.keys import RunKeys
from flodl_bus.protocol.signing import SECRET_BYTES, new_secret

ENV_SECRET: Final = "FLODL_RUN_SECRET"


class SecretError(RuntimeError):
    pass


def _from_hex(text: str | bytes, where: str) -> bytes:
    try:
        secret = bytes.fromhex(text.decode() if isinstance(text, bytes) else text)
    except (ValueError, UnicodeDecodeError):
        raise SecretError(f"run secret from {where} is not hex") from None
    if len(secret) < SECRET_BYTES:
        raise SecretError(f"run secret from {where} is shorter than {SECRET_BYTES} bytes")
    return secret


def secret_from_env(env: Mapping[str, str] | None = None) -> bytes | None:
    text = (os.environ if env is None else env).get(ENV_SECRET)
    return _from_hex(text, ENV_SECRET) if text else None


def ensure_run_secret(
    client: redis.Redis, keys: RunKeys, env: Mapping[str, str] | None = None
) -> bytes:
    """The coordinator's secret: from the environment, else created once in Redis."""
    given = secret_from_env(env)
    if given is not None:
        return given
    client.set(keys.secret, new_secret().hex(), nx=True)
    stored = client.get(keys.secret)
    if stored is None:
        raise SecretError(f"{keys.secret} lost its secret right after it was set")
    return _from_hex(stored, keys.secret)  # type: ignore[arg-type]


def fetch_run_secret(
    client: redis.Redis,
    keys: RunKeys,
    env: Mapping[str, str] | None = None,
    *,
    timeout: float = 30.0,
    poll: float = 0.05,
) -> bytes:
    """A worker's secret: from the environment, else wait for the coordinator's."""
    given = secret_from_env(env)
    if given is not None:
        return given
    deadline = time.monotonic() + timeout
    while True:
        stored = client.get(keys.secret)
        if stored is not None:
            return _from_hex(stored, keys.secret)  # type: ignore[arg-type]
        if time.monotonic() > deadline:
            raise SecretError(
                f"no run secret at {keys.secret} after {timeout:.0f}s: is the coordinator "
                f"of run {keys.run!r} up? (or set {ENV_SECRET})"
            )
        time.sleep(poll)
