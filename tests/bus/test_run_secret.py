"""The per-run secret: from the environment, or created once in meta."""

from __future__ import annotations

import time

import pytest

from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.run_secret import (
    AuthenticationFailed,
    SecretError,
    ensure_run_secret,
    fetch_identity,
    fetch_run_secret,
    publish_identity,
)
from flodl_bus.protocol.signing import CoordinatorIdentity
from tests.bus.conftest import Backend


def test_coordinator_creates_the_secret_once_and_workers_read_it(backend: Backend) -> None:
    keys = RunKeys("sec")
    first = ensure_run_secret(backend.make(), keys, env={})
    assert len(first) == 16
    assert ensure_run_secret(backend.make(), keys, env={}) == first  # HSETNX: one secret
    assert fetch_run_secret(backend.make(), keys, env={}, timeout=1) == first


def test_environment_secret_wins_and_bad_ones_are_refused(backend: Backend) -> None:
    keys = RunKeys("sec2")
    env = {"FLODL_RUN_SECRET": "ab" * 16}
    assert ensure_run_secret(backend.make(), keys, env=env) == bytes.fromhex("ab" * 16)
    assert backend.admin.get(keys.secret) is None  # never stored
    with pytest.raises(SecretError, match="not hex"):
        fetch_run_secret(backend.make(), keys, env={"FLODL_RUN_SECRET": "zz"})
    with pytest.raises(SecretError, match="is the coordinator"):
        fetch_run_secret(backend.make(), keys, env={}, timeout=0.1)


def test_the_secret_lives_outside_the_keys_an_observer_may_read(backend: Backend) -> None:
    keys = RunKeys("sec3")
    ensure_run_secret(backend.make(), keys, env={})
    assert backend.admin.exists(keys.secret)
    readable = [k.decode() for k in backend.admin.keys("flodl:*")]
    assert not any("secret" in k for k in readable)
    assert backend.admin.hget(keys.meta, "secret") is None
    assert keys.secret.startswith("flodl-secret:{sec3}")


def test_a_worker_with_the_wrong_secret_is_told_at_once_not_after_a_timeout(
    backend: Backend,
) -> None:
    keys = RunKeys("ident")
    secret = bytes(range(16))
    ident = CoordinatorIdentity.generate()
    publish_identity(backend.make(), keys, ident, secret)
    got = fetch_identity(backend.make(), keys, secret, env={}, timeout=1)
    assert got.sign_pub.hex == ident.public.sign_pub.hex
    t0 = time.monotonic()
    with pytest.raises(AuthenticationFailed, match="authentication failed for run 'ident'"):
        fetch_identity(backend.make(), keys, bytes(16), env={}, timeout=30)
    assert time.monotonic() - t0 < 5  # named at the first look, not at the timeout


def test_a_pinned_public_key_refuses_any_other_coordinator(backend: Backend) -> None:
    keys = RunKeys("pinned")
    secret = bytes(range(16))
    publish_identity(backend.make(), keys, CoordinatorIdentity.generate(), secret)
    other = CoordinatorIdentity.generate().public.sign_pub.hex
    with pytest.raises(AuthenticationFailed, match="FLODL_RUN_PUBKEY"):
        fetch_identity(backend.make(), keys, secret, env={"FLODL_RUN_PUBKEY": other}, timeout=1)


def test_no_identity_within_the_timeout_names_the_coordinator(backend: Backend) -> None:
    with pytest.raises(SecretError, match="is the coordinator"):
        fetch_identity(backend.make(), RunKeys("nobody"), bytes(16), env={}, timeout=0.2)
