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
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Final

#: ``1``: the rank sizes its threads to the work (``worker.threads``) although a launcher
#: set ``OMP_NUM_THREADS`` (its default split); ``0``: never; unset: only at the default
ENV_TUNE: Final = "FLODL_TUNE_THREADS"
#: Cores left to the control plane (see the module's docstring) ...
CONTROL_CORES: Final = 1
#: ... on hosts with at least this many: on fewer, the ranks need every core they have.
RESERVE_FROM: Final = 4
#: ``1``: ``up`` lays the host's cores out (``cpu_layout``): the kept core(s) for the
#: control plane (Redis, the coordinator, every rank's own threads), the rest split
#: among the ranks' training threads. Off by default until measured on a host.
ENV_PIN: Final = "FLODL_PIN_CPUS"
#: what ``up`` gives each rank under ``FLODL_PIN_CPUS``: its training cores ...
ENV_COMPUTE_CPUS: Final = "FLODL_COMPUTE_CPUS"
#: ... and the control plane's
ENV_CONTROL_CPUS: Final = "FLODL_CONTROL_CPUS"


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def usable_cores_list() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


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


def pins_cpus(env: Mapping[str, str]) -> bool:
    flag = env.get(ENV_PIN, "").strip()
    if flag not in ("", "0", "1"):
        raise ValueError(f"{ENV_PIN}={flag!r}: use 1 (cores laid out for control) or 0")
    return flag == "1"


def cpu_layout(
    cpus: Sequence[int], workers: int, control: int = CONTROL_CORES
) -> tuple[list[int], list[list[int]]] | None:
    """(the control plane's cores, each rank's training cores), or None where the host
    is too small to keep a core (the ranks then share every core, as unpinned).

    Why: the kept core only helps if the control plane runs there. Left to the
    scheduler, a reader or publisher woken by the training thread (or Redis, the
    coordinator) lands beside a spinning intra-op thread and every parallel region then
    waits for it (a world of one at 15 threads: 1.48 s against the plain loop's 0.78 s)."""
    ordered = sorted(set(cpus))
    if len(ordered) < RESERVE_FROM or len(ordered) - control < workers:
        return None
    kept, rest = ordered[-control:], ordered[:-control]
    per = len(rest) // workers
    return kept, [rest[r * per : (r + 1) * per] for r in range(workers)]


def format_cpus(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in cpus)


def parse_cpus(text: str) -> set[int]:
    try:
        cpus = {int(c) for c in text.split(",") if c.strip()}
    except ValueError:
        raise ValueError(f"{text!r}: use a comma-separated list of CPU numbers") from None
    if not cpus:
        raise ValueError("an empty CPU list")
    return cpus


def pin_training_thread(env: Mapping[str, str]) -> bool:
    """At a rank's start, before torch runs a parallel region: the calling thread (the
    training thread, whose intra-op team inherits its mask) to the rank's training
    cores. False where ``up`` laid out none."""
    given = env.get(ENV_COMPUTE_CPUS, "").strip()
    if not given or not hasattr(os, "sched_setaffinity"):
        return False
    os.sched_setaffinity(0, parse_cpus(given))
    return True


def pin_control_threads(env: Mapping[str, str]) -> int:
    """Every other live Python thread of this process (reader, heartbeat, publisher,
    record writer) to the control plane's cores; how many were moved. Threads started
    later inherit the training mask until this runs again."""
    given = env.get(ENV_CONTROL_CPUS, "").strip()
    if not given or not hasattr(os, "sched_setaffinity"):
        return 0
    cpus = parse_cpus(given)
    me = threading.get_ident()
    moved = 0
    for t in threading.enumerate():
        tid = t.native_id
        if t.ident == me or tid is None or not t.is_alive():
            continue
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError, OSError):
            continue  # ended meanwhile
        moved += 1
    return moved
