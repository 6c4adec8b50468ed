"""The run secret (membership) and the coordinator's identity (its public keys).

The secret is either given to every process (``FLODL_RUN_SECRET``, hex), or created
once by the coordinator at ``RunKeys.secret`` (SET NX, so two racing coordinators agree)
and read from there by workers whose Redis user may (per-run worker users may not: they
get it in the environment). That key lies outside ``flodl:*``, which the read-only
observer user may read. The secret is never logged.

The identity (``RunKeys.identity``) is the coordinator's Ed25519 and X25519 public keys
with a check MAC under the run secret; a worker reads it before it says Hello, so a wrong
secret is named at once (``authentication failed for run X``). ``FLODL_RUN_PUBKEY`` pins
the signing key where an operator wants more than the Redis ACL protecting the hash.
"""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import Mapping
from typing import Any, Final

import redis

from flodl_bus.bus.keys import RunKeys
from flodl_bus.protocol.signing import (
    SECRET_BYTES,
    BadKey,
    CoordinatorIdentity,
    RunIdentity,
    new_secret,
)

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
        try:
            stored = client.get(keys.secret)
        except redis.exceptions.NoPermissionError:
            raise SecretError(
                f"this Redis user may not read {keys.secret} (as a per-run worker user "
                f"should not): give the worker the run secret in {ENV_SECRET}"
            ) from None
        if stored is not None:
            return _from_hex(stored, keys.secret)  # type: ignore[arg-type]
        if time.monotonic() > deadline:
            raise SecretError(
                f"no run secret at {keys.secret} after {timeout:.0f}s: is the coordinator "
                f"of run {keys.run!r} up? (or set {ENV_SECRET})"
            )
        time.sleep(poll)


# ---------------------------------------------------------------- the run's identity

ENV_COORD_SEED: Final = "FLODL_COORDINATOR_KEY"
ENV_PUBKEY: Final = "FLODL_RUN_PUBKEY"


class AuthenticationFailed(SecretError):
    """This process's run secret is not the coordinator's."""


def coordinator_identity(env: Mapping[str, str] | None = None) -> CoordinatorIdentity:
    """Fresh keys, or the seed ``flodl-bus up`` hands its coordinator (hex, 32 bytes)."""
    text = (os.environ if env is None else env).get(ENV_COORD_SEED)
    if not text:
        return CoordinatorIdentity.generate()
    try:
        return CoordinatorIdentity.from_seed(bytes.fromhex(text))
    except (ValueError, BadKey) as exc:
        raise SecretError(f"{ENV_COORD_SEED}: {exc}") from None


def publish_identity(
    client: redis.Redis, keys: RunKeys, identity: CoordinatorIdentity, secret: bytes
) -> None:
    """Write the coordinator's public keys for the ranks (replacing an earlier
    coordinator's: only the coordinator credential may write the key)."""
    pipe = client.pipeline(transaction=True)
    pipe.delete(keys.identity)
    pipe.hset(keys.identity, mapping=identity.public.to_fields(secret, keys.run))  # type: ignore[arg-type]
    pipe.execute()


def fetch_identity(
    client: redis.Redis,
    keys: RunKeys,
    secret: bytes,
    env: Mapping[str, str] | None = None,
    *,
    timeout: float = 30.0,
    poll: float = 0.05,
) -> RunIdentity:
    """A worker's view of the coordinator's public keys, checked against its secret.

    A wrong secret is named as soon as the coordinator has published (within one poll),
    never discovered later as silence."""
    env = os.environ if env is None else env
    deadline = time.monotonic() + timeout
    while True:
        raw: Any = client.hgetall(keys.identity)
        if raw:
            fields = {k.decode(): v.decode() for k, v in raw.items()}
            try:
                ident = RunIdentity.from_fields(fields)
            except BadKey as exc:
                raise AuthenticationFailed(
                    f"authentication failed for run {keys.run!r}: {exc} at {keys.identity}"
                ) from None
            if not hmac.compare_digest(ident.check(secret, keys.run), fields.get("check", "")):
                raise AuthenticationFailed(
                    f"authentication failed for run {keys.run!r}: this worker's run secret "
                    f"is not the coordinator's (check {ENV_SECRET})"
                )
            pinned = env.get(ENV_PUBKEY)
            if pinned and pinned.lower() != ident.sign_pub.hex:
                raise AuthenticationFailed(
                    f"authentication failed for run {keys.run!r}: the coordinator's public key "
                    f"is not the one in {ENV_PUBKEY}"
                )
            return ident
        if time.monotonic() > deadline:
            raise SecretError(
                f"no coordinator identity at {keys.identity} after {timeout:.0f}s: is the "
                f"coordinator of run {keys.run!r} up?"
            )
        time.sleep(poll)
