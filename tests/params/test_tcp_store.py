"""Rank 0's rendezvous store (``params.forming.serve_tcp_store``) listens where its peers
are told to dial, and nowhere else."""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch.distributed as dist

from flodl_bus.bench.sockets import tcp_endpoints
from flodl_bus.params.forming import serve_tcp_store

TIMEOUT = timedelta(seconds=10)


def _listening() -> set[tuple[str, int]]:
    return {(e.local, e.local_port) for e in tcp_endpoints(os.getpid()) if e.listening}


def test_torch_alone_listens_on_every_address_given_loopback() -> None:
    # The control: what the helper exists for. If torch ever binds where it is told,
    # this fails and the helper can go.
    before = _listening()
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, 1, True, timeout=TIMEOUT, wait_for_workers=False
    )
    new = _listening() - before
    assert new and all(addr in ("::", "0.0.0.0") for addr, _ in new), new
    del store


def test_the_store_listens_on_the_bind_host_alone_and_serves_peers() -> None:
    before = _listening()
    store = serve_tcp_store("127.0.0.1", 2, TIMEOUT)
    assert _listening() - before == {("127.0.0.1", store.port)}
    peer = dist.TCPStore("127.0.0.1", store.port, 2, False, timeout=TIMEOUT)  # type: ignore[attr-defined]
    peer.set("k", b"v")
    assert store.get("k") == b"v"
    del peer, store
    gc.collect()
    # The store owned the socket: it is closed with it, nothing listens any more.
    assert _listening() == before


def test_an_ipv6_bind_host_is_served_on_ipv6_loopback() -> None:
    store = serve_tcp_store("::1", 1, TIMEOUT)
    assert ("::1", store.port) in _listening()
    peer = dist.TCPStore("::1", store.port, 1, False, timeout=TIMEOUT)  # type: ignore[attr-defined]
    peer.set("k", b"6")
    assert store.get("k") == b"6"
