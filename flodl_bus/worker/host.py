"""A rank's place on its host: PyTorch's environment conventions and its share of cores.

Ranks see ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as under
torchrun. The rank and world come from the coordinator; ``LOCAL_*`` from the launcher
when it sets them (several hosts), else the world is taken as one host (``flodl-bus up``,
or workers started by hand on one machine).

Each rank takes its share of the host's cores for torch's threads, so ranks on one host do
not fight over them: ``FLODL_NUM_THREADS`` when set; else the launcher's
``OMP_NUM_THREADS`` when it set one (it split the cores already); else the usable cores,
less ``CONTROL_CORES`` on a host of ``RESERVE_FROM`` cores or more, divided by
``LOCAL_WORLD_SIZE``. The count always goes to ``torch.set_num_threads`` (``torch_threads``):
left to ``OMP_NUM_THREADS`` alone, torch sizes its pool by MKL's own count (capped at the
cores), not the configuration the baselines, which call it, train with.

Why a core is kept: intra-op threads wait for each other at the end of every parallel
region, spinning. When they fill every core, whatever else must run (the coordinator,
Redis, a rank's reader and publisher, the launcher) takes a core from one of them, and
every region then waits for that thread to be scheduled again: on a 16-core host a world
of one ran its first steps at 44 ms instead of 2 (issue 27). The control plane's work is
small but it must find a core when it wakes.

The share is where a rank starts: at the default (no ``FLODL_NUM_THREADS``, no launcher's
``OMP_NUM_THREADS``, or a launcher that says its split is only the default with
``FLODL_TUNE_THREADS=1``, as ``up`` does) a CPU rank then sizes its threads to the work
over its first steps (``worker.threads``); ``FLODL_TUNE_THREADS=0`` keeps the share.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Final

from flodl_bus.worker import cores

#: ``1``: the rank sizes its threads to the work (``worker.threads``) although a launcher
#: set ``OMP_NUM_THREADS`` (its default split); ``0``: never; unset: only at the default
ENV_TUNE: Final = "FLODL_TUNE_THREADS"
#: Cores left to the control plane (see the module's docstring) ...
CONTROL_CORES: Final = 1
#: ... on hosts with at least this many: on fewer, the ranks need every core they have.
RESERVE_FROM: Final = 4


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def rank_env(rank: int, world_size: int, env: Mapping[str, str]) -> dict[str, str]:
    """The four variables of rank ``rank`` of ``world_size`` (``LOCAL_*`` kept from
    ``env`` when the launcher set both)."""
    local_rank, local_world = env.get("LOCAL_RANK"), env.get("LOCAL_WORLD_SIZE")
    if local_rank is None or local_world is None:
        local_rank, local_world = str(rank), str(world_size)
    elif not (local_rank.isdigit() and local_world.isdigit()) or int(local_rank) >= int(
        local_world
    ):
        raise ValueError(
            f"LOCAL_RANK={local_rank!r} LOCAL_WORLD_SIZE={local_world!r}: use counts with "
            "0 <= LOCAL_RANK < LOCAL_WORLD_SIZE, or set neither"
        )
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": local_rank,
        "LOCAL_WORLD_SIZE": local_world,
    }


def set_rank_env(rank: int, world_size: int, env: MutableMapping[str, str] | None = None) -> None:
    """Put the four variables in ``env`` (the process's environment by default)."""
    env = os.environ if env is None else env
    env.update(rank_env(rank, world_size, env))


def torch_threads(env: Mapping[str, str], cores: int) -> int:
    """What a rank passes to ``torch.set_num_threads``: its share (``thread_share``), or
    the launcher's ``OMP_NUM_THREADS`` where it split the cores itself."""
    share = thread_share(env, cores)
    if share is not None:
        return share
    return launcher_threads(env) or max(1, cores)


def launcher_threads(env: Mapping[str, str]) -> int | None:
    """The launcher's ``OMP_NUM_THREADS``, or None when it set no usable count."""
    omp = env.get("OMP_NUM_THREADS", "").strip()
    return int(omp) if omp.isdigit() and int(omp) > 0 else None


def thread_share(env: Mapping[str, str], cores: int) -> int | None:
    """torch threads for this rank, or None to leave them as the launcher set them."""
    given = env.get("FLODL_NUM_THREADS", "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"FLODL_NUM_THREADS={given!r}: use a thread count of 1 or more")
        return int(given)
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    local_world = env.get("LOCAL_WORLD_SIZE", "1").strip()
    if not local_world.isdigit() or int(local_world) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_world!r}: use a count of ranks of 1 or more")
    usable = cores - CONTROL_CORES if cores >= RESERVE_FROM else cores
    return max(1, usable // int(local_world))


def tunes_threads(env: Mapping[str, str]) -> bool:
    """Whether a rank sizes its threads to the work (``worker.threads``): never with
    ``FLODL_NUM_THREADS`` (a count asked for is kept); else as ``FLODL_TUNE_THREADS``
    says; else only where no launcher set ``OMP_NUM_THREADS``."""
    if env.get("FLODL_NUM_THREADS", "").strip():
        return False
    flag = env.get(ENV_TUNE, "").strip()
    if flag:
        if flag not in ("0", "1"):
            raise ValueError(f"{ENV_TUNE}={flag!r}: use 1 (size threads to the work) or 0")
        return flag == "1"
    return not env.get("OMP_NUM_THREADS", "").strip()


def check_thread_env(env: Mapping[str, str]) -> None:
    """Raise ``ValueError`` naming a thread setting a rank could not read (a launcher
    says it once, before anything starts)."""
    thread_share(env, 1)
    tunes_threads(env)
    cores.wanted(env)
