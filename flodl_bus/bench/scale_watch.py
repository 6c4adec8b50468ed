"""What ``bench scale`` samples while a run goes: Redis (INFO cpu/memory/clients, PING,
the run's stream bytes) and the host's busy CPU, and the shares computed from them.
Moved out of ``bench.scale`` (its size)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from flodl_bus.bus.keys import RunKeys


def quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, int(q * len(s)))]


def share(samples: Sequence[Sequence[float]], a: float, b: float) -> float:
    """Mean CPU share (cores) over [a, b] from (time, cpu seconds) samples."""

    def at(t: float) -> float:
        prev = samples[0]
        for cur in samples:
            if cur[0] >= t:
                if cur[0] == prev[0]:
                    return float(cur[1])
                w = (t - prev[0]) / (cur[0] - prev[0])
                return float(prev[1] + w * (cur[1] - prev[1]))
            prev = cur
        return float(samples[-1][1])

    if not samples or b <= a:
        return float("nan")
    return (at(b) - at(a)) / (b - a)


class RedisWatch:
    """INFO cpu/memory, PING round trips and the run's stream bytes, sampled. On a Redis
    Cluster: INFO of every master (``nodes``), CPU per master, memory summed."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        ranks: int,
        nodes: Sequence[redis.Redis] = (),
        client_for: Callable[[str], redis.Redis] | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.ranks = ranks
        self.nodes = list(nodes) or [client]
        self.client_for = client_for or (lambda key: client)
        #: (time, CPU seconds) of each node
        self.node_cpu: list[list[tuple[float, float]]] = [[] for _ in self.nodes]
        self.cpu: list[tuple[float, float]] = []
        self.memory: list[tuple[float, int]] = []
        #: samples lost to a Redis too busy to answer in time
        self.missed = 0
        #: most clients connected at once (every master summed)
        self.peak_clients = 0
        self.stream_bytes: list[tuple[float, int]] = []
        self.pings: list[float] = []
        #: (time, busy CPU seconds of the whole host) from /proc/stat
        self.host: list[tuple[float, float]] = []
        #: (time, {command: (calls, µs inside Redis)}) summed over the masters
        self.commands: list[tuple[float, dict[str, tuple[int, int]]]] = []

    def sample(self) -> None:
        # A Redis busy with thousands of ranks connecting may miss a sample's reply: the
        # watch skips it rather than end the bench.
        try:
            self._sample()
        except (redis.exceptions.TimeoutError, redis.exceptions.ConnectionError):
            self.missed += 1

    def _sample(self) -> None:
        t = time.monotonic()
        cpu, memory, clients = 0.0, 0, 0
        commands: dict[str, tuple[int, int]] = {}
        for i, node in enumerate(self.nodes):
            info: Any = node.info("all")
            used = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
            self.node_cpu[i].append((t, used))
            cpu += used
            memory += int(info["used_memory"])
            clients += int(info["connected_clients"])
            for key, stat in info.items():
                if key.startswith("cmdstat_") and isinstance(stat, dict):
                    calls, usec = commands.get(key[8:], (0, 0))
                    commands[key[8:]] = (calls + int(stat["calls"]), usec + int(stat["usec"]))
        self.commands.append((t, commands))
        self.peak_clients = max(self.peak_clients, clients)
        self.cpu.append((t, cpu))
        self.memory.append((t, memory))
        for _ in range(5):
            t0 = time.perf_counter()
            self.client.ping()
            self.pings.append((time.perf_counter() - t0) * 1000.0)
        self.stream_bytes.append((t, self._stream_bytes()))
        busy = host_busy()
        if busy is not None:
            self.host.append((t, busy))

    def _stream_bytes(self) -> int:
        """Bytes of the run's streams per rank: a sample of ranks, plus ctl:all / N."""
        picks = sorted({0, self.ranks // 2, self.ranks - 1, *range(0, self.ranks, 97)})
        names = [k for r in picks for k in (self.keys.up(r), self.keys.ctl(r))]
        got = [int(self.client_for(k).memory_usage(k) or 0) for k in names]  # type: ignore[arg-type]
        bcast = sum(int(self.client_for(k).memory_usage(k) or 0) for k in self.keys.broadcasts)  # type: ignore[arg-type]
        return int(sum(got) / len(picks) + bcast / self.ranks)


def busiest_commands(
    samples: Sequence[tuple[float, dict[str, tuple[int, int]]]], a: float, b: float, top: int = 5
) -> list[tuple[str, int, float, float]]:
    """Redis's busiest commands over [a, b] (the samples nearest inside it): (command,
    calls, µs inside Redis a call, share of the time Redis spent in commands), most time
    first; a window too short for two samples inside it takes the two around it. Redis
    times a command from its start to its reply being queued, so a figure far below what
    a client waits for a reply is time the client spent queued behind other clients'
    commands, not time in this one. A transaction's ``exec`` and a script's ``evalsha``
    count the commands they ran again (Redis times both), so the shares overlap."""
    if not samples:
        return []
    inside = [s for s in samples if a <= s[0] <= b]
    if len(inside) < 2:
        before = [s for s in samples if s[0] <= a]
        after = [s for s in samples if s[0] >= b]
        inside = [before[-1] if before else samples[0], after[0] if after else samples[-1]]
    if inside[0] is inside[-1]:
        return []
    first, last = inside[0][1], inside[-1][1]
    delta = {
        name: (calls - first.get(name, (0, 0))[0], usec - first.get(name, (0, 0))[1])
        for name, (calls, usec) in last.items()
    }
    total = sum(usec for _, usec in delta.values())
    ranked = sorted(((u, c, n) for n, (c, u) in delta.items() if c > 0), reverse=True)
    return [(n, c, u / c, u / total if total else 0.0) for u, c, n in ranked[:top]]


def host_busy() -> float | None:
    """Busy CPU seconds of every core of the host since boot (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / (os.sysconf("SC_CLK_TCK") or 100)
