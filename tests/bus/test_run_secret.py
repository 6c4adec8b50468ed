"""The per-run secret: from the environment, or created once in meta."""

from __future__ import annotations

import pytest

from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.run_secret import SecretError, ensure_run_secret, fetch_run_secret
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
