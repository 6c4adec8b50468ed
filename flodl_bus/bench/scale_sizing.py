"""What ``bench scale`` at N ranks needs from the host, checked before anything starts.

A simulated rank is a Redis client of its own (its control reader, its publisher and its
heartbeats each take a connection from the rank's pool), a handful of threads, and some
memory in its sim process; redis-server holds a socket per client. So 4,096 ranks need
on the order of 10,000 connections at once, as many file descriptors in redis-server
(``maxclients`` plus the 32 Redis keeps for itself) and in the sim processes together,
some 25,000 threads, and several GB of memory. A host that cannot give them fails late
and obscurely (redis-server silently lowers ``maxclients``, a sim process dies with
EMFILE or "can't start new thread" minutes into the run); ``problems`` says so up front.

The per-rank figures are what ``bench scale`` itself prints ("per simulated rank": 2.1
to 2.4 clients, 5.1 to 5.5 threads, 0.6 to 1.6 MB at 8 to 32 ranks on the dev box), with
headroom. Waits that a large world makes longer (everyone's first contact, an epoch, the
coordinator reading a backlog of heartbeats) scale with N here too.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
from typing import Final

#: Redis connections a simulated rank holds at most (measured: 2.1-2.4 on average)
CLIENTS_PER_RANK: Final = 3
#: threads a simulated rank runs (measured 5.1-5.5: reader, heartbeat, publisher,
#: training, the session's)
THREADS_PER_RANK: Final = 6
#: memory of a simulated rank in its sim process (measured 0.6-1.6 MB at 8-32 ranks;
#: its arrival notes grow with the run's length)
SIM_BYTES_PER_RANK: Final = 3_000_000
#: Redis memory per rank, clients and streams (measured 70-120 kB), with headroom
REDIS_BYTES_PER_RANK: Final = 250_000
#: file descriptors redis-server keeps beyond ``maxclients`` (its CONFIG_MIN_RESERVED_FDS)
REDIS_RESERVED_FDS: Final = 32
#: what a sim process opens beside its ranks' sockets (imports, pipes, epoll)
SIM_BASE_FDS: Final = 64


#: simulated ranks one core carries: 1,024 ranks kept 1-9 of 16 cores busy on the H200
#: host (BENCHMARKS.md); past this the host, not the control plane, is measured
RANKS_PER_CORE: Final = 300


def clients_needed(n: int) -> int:
    """Redis clients N ranks hold at most, with the coordinator's and the bench's."""
    return CLIENTS_PER_RANK * n + 256


def maxclients(n: int) -> int:
    """redis-server's ``maxclients`` for N ranks (its default, 10,000, below 3,300);
    redis-server lowers it itself to what its file descriptors allow."""
    return max(10_000, clients_needed(n) + n)


def tcp_backlog(n: int) -> int:
    """redis-server's listen backlog: every rank's connections arrive within seconds of
    each other (the default, 511, drops SYNs past it: a second's retransmit each)."""
    return max(511, min(65_535, CLIENTS_PER_RANK * n))


def redis_args(n: int) -> list[str]:
    return ["--maxclients", str(maxclients(n)), "--tcp-backlog", str(tcp_backlog(n))]


def default_timeout(n: int) -> float:
    """Seconds a rank count may take (first contact included): 240 s, plus 0.1 s a rank
    (starting thousands of ranks and their slower epochs)."""
    return 240.0 + 0.1 * n


def default_heartbeat_timeout(n: int) -> float:
    """30 s up to 1,024 ranks, then growing with sqrt(N) (60 s at 4,096): a coordinator
    that falls behind reads heartbeats late, and judges staleness when it reads them."""
    return max(30.0, 30.0 * math.sqrt(n / 1024))


def raise_limits() -> None:
    """Soft limits up to the hard ones (file descriptors, and processes, which bound
    threads): redis-server, the coordinator and the sim processes inherit them."""
    for what in (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC):
        soft, hard = resource.getrlimit(what)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            # NOFILE's hard limit may exceed what the kernel allows (nr_open)
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(what, (hard, hard))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _limit(what: int) -> float:
    hard = resource.getrlimit(what)[1]
    return math.inf if hard == resource.RLIM_INFINITY else float(hard)


def problems(n: int, procs: int, *, cluster: bool = False, own_redis: bool = True) -> list[str]:
    """Why this host cannot run N ranks over ``procs`` sim processes (empty: it can try).
    ``cluster``: also a local Redis Cluster (3 masters + 3 replicas) of the same N;
    ``own_redis``: the bench starts redis-server here (not ``--redis-url``)."""
    out: list[str] = []
    cores = os.cpu_count() or 1
    if n > RANKS_PER_CORE * cores:
        out.append(
            f"CPU: {n} simulated ranks on {cores} cores; past {RANKS_PER_CORE} ranks a core "
            f"the sim processes, not the control plane, set the figures (and the host "
            f"stalls): {RANKS_PER_CORE * cores} ranks at most here"
        )
    per_proc = -(-n // max(1, min(procs, n)))
    redis_fds = clients_needed(n) + REDIS_RESERVED_FDS if own_redis else 0
    sim_fds = CLIENTS_PER_RANK * per_proc + SIM_BASE_FDS
    nofile = _limit(resource.RLIMIT_NOFILE)
    if nofile < max(redis_fds, sim_fds):
        out.append(
            f"file descriptors: the hard limit (ulimit -Hn) is {int(nofile)}; {n} ranks need "
            + (
                f"{redis_fds} in redis-server ({clients_needed(n)} clients + "
                f"{REDIS_RESERVED_FDS}) and "
                if own_redis
                else ""
            )
            + f"{sim_fds} in a sim process of {per_proc} ranks. Raise it (ulimit -Hn as "
            f"root, the container's nofile ulimit) or run fewer ranks / more --procs"
        )
    file_max = _read_int("/proc/sys/fs/file-max")
    host_fds = (2 if own_redis else 1) * CLIENTS_PER_RANK * n * (2 if cluster else 1)
    if file_max is not None and file_max < host_fds:
        out.append(
            f"file descriptors: the host allows {file_max} open files (fs.file-max); {n} "
            f"ranks need about {host_fds} (each connection's two ends)"
        )
    threads = THREADS_PER_RANK * n + 64 * (procs + 2)
    for path, what in (
        ("/proc/sys/kernel/threads-max", "kernel.threads-max"),
        ("/proc/sys/kernel/pid_max", "kernel.pid_max (every thread takes an id)"),
    ):
        cap = _read_int(path)
        if cap is not None and cap < threads:
            out.append(f"threads: {what} is {cap}; {n} ranks run about {threads} threads")
    nproc = _limit(resource.RLIMIT_NPROC)
    if os.geteuid() != 0 and nproc < threads:
        out.append(
            f"threads: the hard process limit (ulimit -Hu, which counts threads) is "
            f"{int(nproc)}; {n} ranks run about {threads} threads"
        )
    in_redis = (3 if cluster else 1) if own_redis else 0
    need = n * (SIM_BYTES_PER_RANK + REDIS_BYTES_PER_RANK * in_redis)
    avail = _mem_available()
    if avail is not None and avail < need:
        out.append(
            f"memory: {avail / 2**30:.1f} GiB available; {n} ranks need about "
            f"{need / 2**30:.1f} GiB ({SIM_BYTES_PER_RANK / 1e6:g} MB a simulated rank, "
            f"{REDIS_BYTES_PER_RANK / 1e3:g} kB a rank in Redis"
            + (", thrice on a cluster with replicas)" if cluster else ")")
        )
    return out
