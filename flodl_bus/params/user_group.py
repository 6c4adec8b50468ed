"""torch.distributed's default process group, set up for the job's own code (issue 30).

A job written for torchrun calls ``dist.all_reduce`` and friends on the default group.
The bus never averages over that group (its own are built beside it, ``groups``), so the
user's collectives cannot interleave with an averaging round; this module forms the
default group before the job's code runs and re-forms it over the survivors when the
bus's averaging session is re-formed after a death.

Rendezvous: rank 0 of each generation hosts a C++ ``TCPStore`` on an ephemeral port and
publishes its address through the run's Redis (a ``RedisStore`` under a prefix of its
own, one per generation, so an old generation's address can never be dialed by a new
one). A deployment still needs only the Redis address, ranks started by hand included;
``MASTER_ADDR``/``MASTER_PORT`` are then set to that store, as torchrun's are to its.
A C++ store rather than the ``RedisStore`` itself: NCCL calls store methods a Python
store cannot serve on every torch version (``forming._tcp_store_via`` says which).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

import redis
import structlog
import torch
import torch.distributed as dist

from flodl_bus.bus.store import RedisStore
from flodl_bus.job import GroupInfo, bind_process_group
from flodl_bus.params.forming import (
    backend_for,
    routable_host,
    serve_tcp_store,
    session_prefix,
    store_base,
)
from flodl_bus.params.groups import INITIAL_UID
from flodl_bus.params.hosts import ENV_BIND_HOST

log = structlog.get_logger("flodl_bus.params")

#: The key under a generation's prefix that holds rank 0's store address.
ADDRESS_KEY: Final = "user_group_store"
#: How long a rank waits for its peers to form a generation: the first one waits for
#: every rank to finish its imports and reach the run (ranks started by hand too).
FIRST_FORM_TIMEOUT_S: Final = 300.0
REFORM_TIMEOUT_S: Final = 60.0


class UserGroupError(RuntimeError):
    """The default group could not be formed (a peer never came, the store is gone)."""


@dataclass(frozen=True, slots=True)
class _Generation:
    uid: bytes
    rank: int
    world_size: int
    prefix: str


def user_store_base(run_id: str) -> str:
    """Beside the bus's own session prefixes, never one of them: ``user/`` is not a
    uid's hex, so no session of the averaging plane can share its keys."""
    return f"{store_base(run_id)}user/"


class UserGroup:
    """This rank's place in the default group, from its first form to its close.

    ``form`` runs on the training thread before the job's code; ``reform`` on the
    runtime's session thread after a re-session; ``close`` at the rank's end. One lock
    keeps the three in order (a late re-session never races the close).
    """

    def __init__(
        self,
        redis_client: redis.Redis,
        run_id: str,
        bus_rank: int,
        device: torch.device,
        *,
        first_timeout: float = FIRST_FORM_TIMEOUT_S,
        reform_timeout: float = REFORM_TIMEOUT_S,
    ) -> None:
        self._redis = redis_client
        self._base = user_store_base(run_id)
        self.bus_rank = bus_rank
        self.device = device
        self.backend = backend_for(device)
        self.first_timeout = first_timeout
        self.reform_timeout = reform_timeout
        self._lock = threading.Lock()
        self._current: _Generation | None = None
        #: rank 0's store of the current generation (held: the group dials it until
        #: the group is destroyed)
        self._store: dist.TCPStore | None = None  # type: ignore[name-defined]
        self._generations = 0
        self._closed = False

    @property
    def info(self) -> GroupInfo | None:
        with self._lock:
            return self._info_locked()

    def _info_locked(self) -> GroupInfo | None:
        cur = self._current
        if cur is None:
            return None
        return GroupInfo(
            rank=cur.rank,
            world_size=cur.world_size,
            backend=self.backend,
            generation=self._generations - 1,
            bus_rank=self.bus_rank,
        )

    def form(self, rank: int, world_size: int) -> GroupInfo:
        """The first generation, over the run's world as assigned."""
        with self._lock:
            if dist.is_initialized():
                # The script built one itself before its ``Rank``: that group is the
                # user's, and the bus leaves it alone (nor re-forms it).
                raise UserGroupError(
                    "torch.distributed's default group is already initialized (by the "
                    "script's own init_process_group?): drop that call, or run with "
                    "--user-group false to keep your own"
                )
            self._form_locked(INITIAL_UID, rank, world_size, self.first_timeout)
            info = self._info_locked()
        assert info is not None
        return info

    def reform(self, uid: bytes, rank: int, world_size: int) -> None:
        """Destroy the current generation and form the next over the survivors (the
        averaging session's uid, ranks and world). A collective of the job's still in
        flight on the old group fails; one issued meanwhile finds no group."""
        with self._lock:
            if self._closed or self._current is None or self._current.uid == uid:
                return
            old = self._current
            self._destroy_locked()
            self._form_locked(uid, rank, world_size, self.reform_timeout)
            if rank == 0:
                # Every survivor left the old generation's rendezvous long ago.
                RedisStore(self._redis, old.prefix).clear()

    def close(self) -> None:
        """Destroy the group (a gloo group alive at interpreter teardown ends the
        process in ``std::terminate``). Idempotent."""
        with self._lock:
            self._closed = True
            cur = self._current
            self._destroy_locked()
            if cur is not None and cur.rank == 0:
                try:
                    RedisStore(self._redis, cur.prefix).clear()
                except redis.RedisError as exc:  # the run's end stands without it
                    log.warning("user_group_keys_not_cleared", error=repr(exc)[:200])

    # -- forming --------------------------------------------------------------------------

    def _form_locked(self, uid: bytes, rank: int, world_size: int, timeout_s: float) -> None:
        if not 0 <= rank < world_size:
            raise UserGroupError(f"rank {rank} outside a world of {world_size}")
        prefix = session_prefix(self._base, uid)
        timeout = timedelta(seconds=timeout_s)
        started = time.monotonic()
        try:
            store, host, port = self._rendezvous(prefix, rank, world_size, timeout)
            if self.device.type == "cuda":
                # The current device is per thread: a re-form runs on the session thread.
                torch.cuda.set_device(self.device)
            dist.init_process_group(
                self.backend,
                store=store,
                rank=rank,
                world_size=world_size,
                device_id=self.device if self.device.type == "cuda" else None,
            )
        except (RuntimeError, ValueError, redis.RedisError) as exc:
            raise UserGroupError(
                f"the default process group (generation {uid.hex()[:12]}, rank {rank} of "
                f"{world_size}) did not form within {timeout_s:.0f}s: {exc}"
            ) from exc
        self._store = store
        self._current = _Generation(uid, rank, world_size, prefix)
        self._generations += 1
        # torchrun's convention: the default group's store is at MASTER_ADDR:MASTER_PORT.
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
        bind_process_group(self._info_locked())
        log.info(
            "user_group_formed",
            bus_rank=self.bus_rank,
            rank=rank,
            world_size=world_size,
            backend=self.backend,
            generation=self._generations - 1,
            form_s=round(time.monotonic() - started, 4),
        )

    def _rendezvous(
        self, prefix: str, rank: int, world_size: int, timeout: timedelta
    ) -> tuple[dist.TCPStore, str, int]:  # type: ignore[name-defined]
        redis_store = RedisStore(self._redis, prefix, timeout)
        if rank == 0:
            # Listen only where the peers are told to dial (loopback on one host).
            host = os.environ.get(ENV_BIND_HOST) or routable_host()
            tcp = serve_tcp_store(host, world_size, timeout)
            redis_store.set(ADDRESS_KEY, f"{host}:{tcp.port}")
            return tcp, host, int(tcp.port)
        addr = redis_store.get(ADDRESS_KEY).decode()
        host, _, port = addr.rpartition(":")
        tcp = dist.TCPStore(host, int(port), world_size, False, timeout=timeout)  # type: ignore[attr-defined]
        return tcp, host, int(port)

    def _destroy_locked(self) -> None:
        bind_process_group(None)
        if self._current is None:
            return
        self._current = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # its peers may be gone; the next generation stands
                log.warning(
                    "user_group_not_destroyed", bus_rank=self.bus_rank, error=repr(exc)[:200]
                )
        self._store = None
