"""A world on one host stays on loopback (``params.hosts``), and an operator's own
choice of address or interface is kept."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from flodl_bus.params.forming import _tcp_store_via
from flodl_bus.params.hosts import ENV_BIND_HOST, ONE_HOST_ENV, pin_one_host


def test_pinning_fills_what_is_unset_and_keeps_what_an_operator_set() -> None:
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    pin_one_host(env)
    assert env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert env[ENV_BIND_HOST] == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert set(env) == set(ONE_HOST_ENV)


def test_peers_dial_the_bootstrap_store_at_the_pinned_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # not 127.0.0.1, which is also what a host name may resolve to: the pin must be read
    monkeypatch.setenv(ENV_BIND_HOST, "127.0.0.2")
    rendezvous = dist.HashStore()  # type: ignore[attr-defined]
    tcp = _tcp_store_via(rendezvous, 0, 2, timedelta(seconds=10))
    host, _, port = rendezvous.get("nccl_bootstrap").decode().rpartition(":")
    assert host == "127.0.0.2"
    # the peer's side: it dials what was published and sees rank 0's writes
    peer = _tcp_store_via(rendezvous, 1, 2, timedelta(seconds=10))
    tcp.set("k", "v")
    assert peer.get("k") == b"v" and int(port) == tcp.port  # type: ignore[attr-defined]
