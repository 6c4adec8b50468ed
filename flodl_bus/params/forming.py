"""Forming a process group on a store: the backend, its keys and NCCL's bootstrap store.

Split from ``groups`` (which keeps the sessions and their retries): these functions hold
no state. A group is built directly on a ``Store`` (``ProcessGroupGloo`` /
``ProcessGroupNCCL``), never through torch's global default group.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from flodl_bus.params.hosts import ENV_BIND_HOST


def session_prefix(base: str, uid: bytes) -> str:
    return f"{base}{uid.hex()}/"


def store_base(run_id: str) -> str:
    """Rendezvous keys share the run's hash tag with its streams (DESIGN §3)."""
    return f"flodl:{{{run_id}}}:store:"


def backend_for(device: torch.device) -> str:
    """The ``nccl`` backend means "in-place collective": NCCL on CUDA, gloo on CPU."""
    if device.type == "cuda" and getattr(dist, "ProcessGroupNCCL", None) is not None:
        return "nccl"
    return "gloo"


def _tcp_store_via(store: Store, rank: int, world_size: int, timeout: timedelta) -> Store:
    """A C++ ``TCPStore`` for one session, its address published through ``store``."""
    if rank == 0:
        host = os.environ.get(ENV_BIND_HOST) or routable_host()
        tcp = serve_tcp_store(host, world_size, timeout)
        store.set("nccl_bootstrap", f"{host}:{tcp.port}")
        return tcp  # type: ignore[no-any-return]
    addr = store.get("nccl_bootstrap").decode()
    host, _, port = addr.rpartition(":")
    return dist.TCPStore(host, int(port), world_size, False, timeout=timeout)  # type: ignore[attr-defined,no-any-return]


def routable_host() -> str:
    """This host's address as its peers would dial it (loopback for a lone host)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def serve_tcp_store(host: str, world_size: int, timeout: timedelta) -> Any:
    """Rank 0's C++ ``TCPStore``, listening on ``host`` alone.

    Given an address, torch's store server still listens on every address of the host
    (``::``, dual-stack; torch 2.13): anything that reached the host could write into a
    rendezvous, or take the port. The socket is bound here, on the address the peers
    are told to dial, and handed to the store (``master_listen_fd``), which owns and
    closes it from then on."""
    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(address)
        sock.listen(max(128, world_size))
        tcp = dist.TCPStore(  # type: ignore[attr-defined]
            host,
            sock.getsockname()[1],
            world_size,
            True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return tcp


def form_process_group(
    store: Store,
    rank: int,
    world_size: int,
    *,
    backend: str,
    timeout: timedelta,
) -> Any:
    """Build a group directly on ``store`` (returns the backend object, which has the
    collective methods: ``allreduce``, ``abort``, ...)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    if backend == "nccl":
        # NCCL's communicator setup calls Store methods that a Python store cannot serve
        # on every torch version ("Not implemented" from the trampoline on torch 2.11), so
        # the group gets a C++ TCPStore hosted by rank 0, whose address travels through
        # the run's Redis store: a deployment still needs only the Redis address.
        store = _tcp_store_via(store, rank, world_size, timeout)
        # NCCL's heartbeat monitor polls the store for a "dump traces" flag with
        # Store::check, which a Python store cannot serve on every torch version (torch
        # 2.11 reports a pure virtual call every second). Our own watchdog (abort on a
        # dead peer) does not need it; a user who wants the dumps can set these.
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
        os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
        nccl = dist.ProcessGroupNCCL  # type: ignore[attr-defined]
        opts = nccl.Options()
        opts._timeout = timeout
        return nccl(store, rank, world_size, opts)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    raise ValueError(f"unknown backend {backend!r}")
