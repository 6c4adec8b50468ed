"""``flodl-bus bench scale --ranks N[,N...] [--step-ms 50]``: where the control plane breaks.

Per N: one redis-server, the real coordinator (core, loop, bus, recorder) in its own
process, and N simulated ranks spread over ``--procs`` processes (``bench.scale_roles``:
the real bus, runtime threads and ``WorkerControl``; a step is a sleep, a collective
returns at once). Every rank trains ``--steps`` batches per epoch for ``--epochs``
epochs, so an epoch ideally lasts steps x step time. Figures, each beside its reference
from the same run:

* epoch time (median of the epochs after the first, from the ranks' ``EpochAggregated``
  arrivals) vs the ideal; the excess is the control plane's cost plus the harness's;
* control dispatch latency (the coordinator's send → the rank's reader holding the
  entry, both on CLOCK_MONOTONIC), p50 and p99, vs a PING round trip on the same server;
* CPU share (cores) of the coordinator process, of redis-server (INFO), and of the
  simulation processes, over the training window; one core is where a single-threaded
  part saturates;
* Redis memory (INFO used_memory above the empty server) and the run's stream bytes per
  rank (MEMORY USAGE);
* coordinator record bytes per training step;
* where the coordinator's time went (``bench.scale_stages``, from the loop's own
  accounting): µs per upstream message and share of its wall time per stage (reads,
  ``core.handle``, the record, sends, ticks, acks, idle), beside the budget a step leaves
  one thread at N (step / 2N), and the largest stage;
* what a simulated rank costs the host (Redis clients, threads, memory), which sizes a
  large run: before starting, ``bench.scale_sizing`` checks that the host can carry the
  largest N (file descriptors, threads, memory, cores) and says what is short.

"Saturated" names the part at or near its CPU limit. Runs write JSON with ``--json``.

A large run says every ``PROGRESS_EVERY_S`` on stderr that it is still going; one still
going at ``--timeout`` plus ``START_GRACE_S`` is stopped and named on stderr, with no
figures and the fix, and the other rank counts still run: the bench then exits 1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from flodl_bus.bench.netns import DelayRelay
from flodl_bus.bench.scale_agents import Agents
from flodl_bus.bench.scale_sizing import (
    default_heartbeat_timeout,
    default_timeout,
    problems,
    raise_limits,
    redis_args,
)
from flodl_bus.bench.scale_stages import breakdown, stage_fields
from flodl_bus.bench.scale_watch import RedisWatch, busiest_commands, quantile, share
from flodl_bus.bus import cluster
from flodl_bus.bus.cluster_server import LocalCluster
from flodl_bus.bus.connection import connect
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer, free_port

#: what ``MAXLEN ~ 100000`` alone let each rank's streams hold (issue 21's soak)
MAXLEN_BYTES_PER_RANK = 16_000_000
SATURATED = 0.85
#: Redis memory per rank before issue 31 (H200 host, 256-1024 ranks), its goal's bound
REDIS_KB_PER_RANK_BEFORE = "60-72"
#: seconds a run gets beyond ``--timeout`` to start its processes before it is stopped
START_GRACE_S = 60.0
#: seconds between the lines that say a run is still going
PROGRESS_EVERY_S = 30.0


class ScaleTimeout(RuntimeError):
    """A rank count's run did not end within its time (its processes were stopped)."""


@dataclass(frozen=True)
class ScaleResult:
    ranks: int
    procs: int
    step_ms: float
    steps: int
    epochs: int
    epoch_s: float
    ideal_s: float
    overhead: float
    #: the median rank's own time in its plans per epoch (sleeps plus its per-step work
    #: in a shared sim process): the epoch a control plane that never made it wait gives
    trained_s: float
    #: CPU share of the busiest sim process (its threads share one GIL: at 1 it is the
    #: harness, not the control plane, that slows the steps)
    sim_process_cpu: float
    dispatch_p50_ms: float
    dispatch_p99_ms: float
    dispatches_timed: int
    ping_p50_ms: float
    coordinator_cpu: float
    redis_cpu: float
    harness_cpu: float
    host_cpu: float
    host_cores: int
    redis_memory_bytes: int
    stream_bytes_per_rank: int
    record_bytes_per_step: float
    recorded: bool
    steps_done: int
    ranks_clean: int
    declared_dead: int
    wall_s: float
    saturated: str
    network: str
    heartbeat_timeout_s: float
    #: from cutting a rank's link to the coordinator's DeclareDead (None: no cut)
    dead_after_cut_s: float | None
    #: Redis masters the run's control plane was spread over (1: one Redis)
    redis_masters: int = 1
    #: CPU of the busiest master (``redis_cpu`` sums every master)
    redis_cpu_busiest: float = float("nan")
    #: what a simulated rank costs the harness, for sizing a large run: Redis clients
    #: (peak connected over N), threads and memory (sim processes' peak, above their
    #: imports, over N)
    clients_per_rank: float = float("nan")
    threads_per_rank: float = float("nan")
    sim_bytes_per_rank: float = float("nan")
    #: the coordinator loop's own accounting over its run (``LoopProfile.to_dict``)
    loop: dict[str, float] = field(default_factory=dict)
    #: µs per upstream message of each stage (``other`` included), and share of the
    #: loop's wall time
    stage_us: dict[str, float] = field(default_factory=dict)
    stage_share: dict[str, float] = field(default_factory=dict)
    #: what a message may cost one thread at this N: step / 2N (``bench path``)
    budget_us: float = float("nan")
    #: the working stage (not ``idle``) with the most time
    busiest_stage: str = ""
    #: ranks a host agent speaks for (1: no agent, each rank on Redis itself)
    ranks_per_host: int = 1
    #: CPU of every host agent together (0 without agents)
    agents_cpu: float = 0.0
    #: upstream items an agent folded into one entry, on average (0 without agents)
    items_per_fold: float = 0.0
    #: the coordinator's reader processes (``bus.ingest``; 0: its own thread)
    ingest_procs: int = 0
    #: Redis's busiest commands over the epochs: (command, calls, µs inside Redis a call,
    #: share of Redis's command time) (``scale_watch.busiest_commands``)
    redis_commands: list[tuple[str, int, float, float]] = field(default_factory=list)


def rank_counts(text: str) -> list[int] | None:
    """``--ranks 64,256``; None (the one-line error printed) when it is not numbers."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        print(f"--ranks: expected numbers like 64,256, got {text!r}", file=sys.stderr)
        return None


def _where(watch: RedisWatch, keys: RunKeys, args: argparse.Namespace) -> str:
    """Where a run has got to, in a few words: the clients connected (the ranks' start)
    and the entries rank 0 has sent in all (a step's Batch each, its heartbeats and the
    rest: the stream is trimmed as it is read, so its length says less), so a long
    run's wait shows whether it is still starting or under way."""
    key = keys.up(0)
    try:
        info: Any = watch.client_for(key).xinfo_stream(key)
        sent = int(info.get("entries-added", 0))
    except redis.exceptions.TimeoutError:
        return "Redis too busy to say where the run is"
    except (redis.exceptions.RedisError, OSError):
        sent = 0
    return (
        f"{watch.peak_clients} clients at most so far, rank 0 has sent {sent} entries "
        f"(steps, heartbeats and the rest; its run has {args.steps * args.epochs} steps)"
    )


def _trained_an_epoch(watch: RedisWatch, keys: RunKeys, args: argparse.Namespace) -> bool:
    """Whether the rank to cut off has published a whole epoch's steps (a Batch each; its
    LrUpdate goes once, with the first, as the LR is constant)."""
    key = keys.up(args.cut_rank)
    try:
        info: Any = watch.client_for(key).xinfo_stream(key)
    except redis.exceptions.ResponseError:
        return False
    return bool(int(info.get("entries-added", 0)) >= args.steps + 4)


def _spawn(
    role: str, base: list[str], extra: Sequence[str] = (), prefix: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    cmd = [*prefix, sys.executable, "-m", "flodl_bus.bench.scale_roles", "--role", role, *base,
           *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def run_one(
    args: argparse.Namespace, n: int, on_cluster: bool = False, per_host: int = 1
) -> ScaleResult:
    # the waits a large world makes longer, unless given
    args = argparse.Namespace(
        **{
            **vars(args),
            "timeout": default_timeout(n) if args.timeout is None else args.timeout,
            "heartbeat_timeout": default_heartbeat_timeout(n)
            if args.heartbeat_timeout is None
            else args.heartbeat_timeout,
        }
    )
    procs = max(1, min(args.procs, n))
    work = Path(tempfile.mkdtemp(prefix=f"flodl-scale-{n}-"))
    server: RedisServer | None = None
    local: LocalCluster | None = None
    relay = None
    url = args.redis_url
    nets = [pair.split("=", 1) for pair in args.rank_netns.split(",")] if args.rank_netns else []
    if on_cluster and url is None:
        local = LocalCluster(masters=3, replicas=1, extra_args=redis_args(n)).start()
        url = local.url
    elif url is None:
        extra = redis_args(n)
        if nets:
            extra += ["--bind", " ".join(["127.0.0.1", *(h for _, h in nets)])]
        server = RedisServer(extra_args=extra).start()
        url = server.url
    rank_port = server.port if server is not None else 0
    if nets and args.relay_ms:
        rank_port = free_port()
        assert server is not None
        relay = DelayRelay([h for _, h in nets], rank_port, ("127.0.0.1", server.port),
                           args.relay_ms)  # fmt: skip
    run = f"scale{n}-{os.getpid()}"
    keys = RunKeys(run, cluster.plan_shards(url, run))
    admin = connect(url, client_name="bench-scale-driver", key=keys.meta)
    nodes: list[redis.Redis] = []
    pinned: dict[str, redis.Redis] = {}
    if keys.shards:
        nodes = [
            redis.Redis(host=m.node[0], port=m.node[1], socket_timeout=10)
            for m in cluster.topology_of(url).masters()
        ]
        for b in keys.broadcasts:
            pinned[keys.short(b)] = connect(url, key=b)

    def client_for(key: str) -> redis.Redis:
        shard = keys.shard_of_key(key)
        if shard is None:
            return admin
        return pinned[keys.short(keys.broadcast_of_shard(shard))]

    base_memory = sum(int(c.info("memory")["used_memory"]) for c in nodes or [admin])  # type: ignore[index]
    common = [
        "--url", url, "--run", run, "--dir", str(work), "--ranks", str(n),
        "--steps", str(args.steps), "--epochs", str(args.epochs),
        "--step-ms", str(args.step_ms), "--mode", args.mode,
        "--heartbeat-timeout", str(args.heartbeat_timeout), "--timeout", str(args.timeout),
        *(["--no-record"] if args.no_record else []),
        *(["--profile", str(Path(args.profile).resolve())] if args.profile else []),
        "--ranks-per-host", str(per_host),
        "--ingest-procs", str(args.ingest_procs),
    ]  # fmt: skip
    agents = Agents(url, run, work, n, per_host) if per_host > 1 else None
    started = time.monotonic()
    children = [_spawn("coordinator", common)]
    # a sim process holds whole hosts
    per = math.ceil(math.ceil(n / procs) / per_host) * per_host
    for i, lo in enumerate(range(0, n, per)):
        extra = ["--slice", f"{lo}:{min(n, lo + per)}"]
        prefix: list[str] = []
        if nets:
            ns, host = nets[i % len(nets)]
            prefix = ["ip", "netns", "exec", ns]
            extra += ["--url", f"redis://{host}:{rank_port}/0"]
        children.append(_spawn("sim", common, extra, prefix))
    watch = RedisWatch(admin, keys, n, nodes, client_for)
    deadline = started + args.timeout + START_GRACE_S
    next_word = started + PROGRESS_EVERY_S
    cut_at: float | None = None
    overran = False
    try:
        while any(c.poll() is None for c in children):
            now = time.monotonic()
            if now >= deadline:
                overran = True
                break
            if now >= next_word:
                # A large run says nothing else until its end: minutes at 4,096 ranks.
                next_word = now + PROGRESS_EVERY_S
                print(
                    f"bench scale: {n} ranks, {now - started:.0f} s in, still running "
                    f"({_where(watch, keys, args)}; stopped at "
                    f"{args.timeout + START_GRACE_S:.0f} s: --timeout + "
                    f"{START_GRACE_S:.0f} s to start)",
                    file=sys.stderr,
                    flush=True,
                )
            watch.sample()
            if agents is not None:
                agents.sample()
            if args.cut is not None and cut_at is None and _trained_an_epoch(watch, keys, args):
                subprocess.run(shlex.split(args.cut), check=True)
                cut_at = time.monotonic()
            time.sleep(0.2 if args.cut is not None and cut_at is None else 0.5)
    finally:
        # where the run had got to, for the line that names a run stopped at its deadline
        where = _where(watch, keys, args) if overran else ""
        if agents is not None:
            agents.close()
        if relay is not None:
            relay.close()
        for c in children:
            if c.poll() is None:
                c.kill()
            c.wait()
        wall = time.monotonic() - started
        admin.close()
        if server is not None:
            server.stop()
            server.cleanup()
        if local is not None:
            local.cleanup()
    if overran:
        shutil.rmtree(work, ignore_errors=True)
        raise ScaleTimeout(
            f"{n} ranks: not done {wall:.0f} s after the start (--timeout {args.timeout:.0f} s "
            f"and {START_GRACE_S:.0f} s to start; {where}); stopped, no figures: "
            "raise --timeout"
        )
    failed = [c for c in children if c.returncode != 0]
    if failed:
        err = (failed[0].stderr.read() if failed[0].stderr else b"").decode(errors="replace")
        shutil.rmtree(work, ignore_errors=True)
        raise RuntimeError(f"a bench process failed (rc {failed[0].returncode}): {err[-2000:]}")
    coord = json.loads((work / "coordinator.json").read_text())
    sims = [json.loads(p.read_text()) for p in sorted(work.glob("sim*.json"))]
    if args.keep:
        shutil.copytree(work, Path(args.keep) / f"ranks{n}", dirs_exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    return _figures(args, n, procs, wall, coord, sims, watch, base_memory, cut_at, agents, per_host)


def _figures(
    args: argparse.Namespace,
    n: int,
    procs: int,
    wall: float,
    coord: dict[str, Any],
    sims: list[dict[str, Any]],
    watch: RedisWatch,
    base_memory: int,
    cut_at: float | None = None,
    agents: Agents | None = None,
    per_host: int = 1,
) -> ScaleResult:
    # Latency counts from the first StartEpoch: before it, ranks still starting up hold
    # the coordinator's early heartbeats unread.
    first = min((t for _, _, k, t in coord["sent"] if k == "StartEpoch"), default=0.0)
    sent = {(s, e): t for s, e, _, t in coord["sent"] if t >= first}
    latencies: list[float] = []
    starts: list[float] = []
    ends: dict[int, list[float]] = {}
    ranks = [r for sim in sims for r in sim["ranks"]]
    for r in ranks:
        epoch = 0
        started = False
        for stream, eid, kind, t in r["arrivals"]:
            t0 = sent.get((stream, eid))
            if t0 is not None:
                latencies.append((t - t0) * 1000.0)
            if kind == "StartEpoch" and not started:
                started = True
                starts.append(t)
            if kind == "EpochAggregated":
                ends.setdefault(epoch, []).append(t)
                epoch += 1
    start = min(starts) if starts else float("nan")
    marks = [start] + [min(ends[e]) for e in sorted(ends)]
    epochs = [b - a for a, b in itertools.pairwise(marks)]
    epoch_s = statistics.median(epochs[1:]) if len(epochs) > 1 else (epochs or [float("nan")])[0]
    ideal = args.steps * args.step_ms / 1000.0
    a, b = marks[0], marks[-1]
    if not ends:
        # No epoch completed (the coordinator fell behind): the window runs to its end.
        b = coord["cpu"][-1][0] if coord["cpu"] else b
    coord_cpu = share(coord["cpu"], a, b)
    sim_shares = [share(sim["cpu"], a, b) for sim in sims]
    harness = sum(sim_shares)
    trained = [r.get("trained_s", float("nan")) / args.epochs for r in ranks]
    redis_cpu = share(watch.cpu, a, b)
    busiest_cpu = max(share(nc, a, b) for nc in watch.node_cpu)
    host_cpu = share(watch.host, a, b) if watch.host else float("nan")
    mem = [m for t, m in watch.memory if a <= t <= b] or [m for _, m in watch.memory]
    # a short run may fall between two samples: then every sample taken while the run's
    # streams existed (before the ranks start there are none)
    stream = [x for t, x in watch.stream_bytes if a <= t <= b and x] or [
        x for _, x in watch.stream_bytes if x
    ]
    steps_done = sum(r["steps"] for r in ranks)
    cores = os.cpu_count() or 1
    shares = {
        "coordinator (one core)": coord_cpu,
        "redis-server (one core)": busiest_cpu,
        "a sim process (one GIL)": max(sim_shares, default=0.0),
    }
    worst = max(shares, key=lambda k: shares[k])
    if shares[worst] >= SATURATED:
        saturated = worst
        if coord["dead"]:
            saturated += f"; {len(coord['dead'])} ranks declared dead unheard"
    elif max(host_cpu, coord_cpu + redis_cpu + harness) >= SATURATED * cores:
        saturated = f"host CPUs ({cores} cores shared by the ranks, coordinator and Redis)"
    else:
        saturated = "none"
    return ScaleResult(
        ranks=n,
        procs=procs,
        step_ms=args.step_ms,
        steps=args.steps,
        epochs=args.epochs,
        epoch_s=epoch_s,
        ideal_s=ideal,
        overhead=epoch_s / ideal - 1.0,
        trained_s=statistics.median(trained) if trained else float("nan"),
        sim_process_cpu=max(sim_shares, default=float("nan")),
        dispatch_p50_ms=quantile(latencies, 0.5),
        dispatch_p99_ms=quantile(latencies, 0.99),
        dispatches_timed=len(latencies),
        ping_p50_ms=quantile(watch.pings, 0.5),
        coordinator_cpu=coord_cpu,
        redis_cpu=redis_cpu,
        harness_cpu=harness,
        host_cpu=host_cpu,
        host_cores=cores,
        redis_memory_bytes=int(statistics.median(mem)) - base_memory if mem else 0,
        stream_bytes_per_rank=int(statistics.median(stream)) if stream else 0,
        record_bytes_per_step=coord["record_bytes"] / steps_done if steps_done else float("nan"),
        recorded=not args.no_record,
        steps_done=steps_done,
        ranks_clean=sum(1 for r in ranks if r["clean"]),
        declared_dead=len(coord["dead"]),
        wall_s=wall,
        saturated=saturated,
        network=args.network,
        heartbeat_timeout_s=args.heartbeat_timeout,
        dead_after_cut_s=(
            min((t for _, _, k, t in coord["sent"] if k == "DeclareDead"), default=float("nan"))
            - cut_at
            if cut_at is not None
            else None
        ),
        redis_masters=len(watch.nodes),
        redis_cpu_busiest=busiest_cpu,
        clients_per_rank=watch.peak_clients / n,
        threads_per_rank=sum(s.get("peak_threads", 0) for s in sims) / n,
        sim_bytes_per_rank=sum(s.get("peak_rss", 0) - s.get("base_rss", 0) for s in sims) / n,
        **stage_fields(coord.get("profile"), args.step_ms, n),
        ranks_per_host=per_host,
        agents_cpu=share(agents.cpu, a, b) if agents is not None else 0.0,
        items_per_fold=agents.items_per_fold if agents is not None else 0.0,
        ingest_procs=args.ingest_procs,
        redis_commands=busiest_commands(watch.commands, a, b),
    )


def report(r: ScaleResult) -> str:
    return "\n".join(
        [
            f"ranks {r.ranks} ({r.procs} sim processes, {r.host_cores} cores"
            + (f", {r.ranks_per_host} a host agent" if r.ranks_per_host > 1 else "")
            + (f", {r.ingest_procs} ingest reader processes" if r.ingest_procs else "")
            + "), "
            f"step {r.step_ms:g} ms x {r.steps} steps x {r.epochs} epochs, wall {r.wall_s:.1f} s, "
            f"network: {r.network}, "
            + (
                "one Redis"
                if r.redis_masters == 1
                else f"Redis Cluster of {r.redis_masters} masters"
            ),
            f"  epoch time        {r.epoch_s:8.3f} s   ideal {r.ideal_s:.3f} s   "
            f"overhead {100 * r.overhead:+.1f}%",
            f"  ranks' own time   {r.trained_s:8.3f} s   per epoch in their plans "
            f"({100 * (r.trained_s / r.ideal_s - 1):+.1f}%: the harness; the rest of the "
            f"overhead is waiting on control)",
            f"  dispatch p50      {r.dispatch_p50_ms:8.2f} ms  PING p50 {r.ping_p50_ms:.3f} ms  "
            f"({r.dispatch_p50_ms / r.ping_p50_ms:.1f}x)   p99 {r.dispatch_p99_ms:.2f} ms "
            f"({r.dispatches_timed} deliveries)",
            f"  coordinator CPU   {r.coordinator_cpu:8.2f} cores (saturates at 1)",
            *(
                [
                    f"  host agents CPU   {r.agents_cpu:8.2f} cores "
                    f"({-(-r.ranks // r.ranks_per_host)} agents of {r.ranks_per_host} ranks; "
                    f"{r.items_per_fold:.1f} upstream messages a folded entry)"
                ]
                if r.ranks_per_host > 1
                else []
            ),
            f"  redis-server CPU  {r.redis_cpu:8.2f} cores (saturates at 1)"
            if r.redis_masters == 1
            else f"  redis CPU         {r.redis_cpu:8.2f} cores over {r.redis_masters} masters, "
            f"busiest {r.redis_cpu_busiest:.2f} (saturates at 1)",
            f"  sim ranks CPU     {r.harness_cpu:8.2f} cores of {r.host_cores}   "
            f"(host busy: {r.host_cpu:.2f} cores, every process; busiest sim process "
            f"{r.sim_process_cpu:.2f})",
            f"  redis memory      {r.redis_memory_bytes / 1e6:8.2f} MB above empty "
            f"({r.redis_memory_bytes / r.ranks / 1e3:.1f} kB per rank, clients included; "
            f"issue 31 goal: no more than {REDIS_KB_PER_RANK_BEFORE} kB)",
            f"  stream bytes      {r.stream_bytes_per_rank / 1e3:8.1f} kB per rank  "
            f"(MAXLEN cap alone: {MAXLEN_BYTES_PER_RANK / 1e6:.0f} MB per rank)",
            f"  record            {r.record_bytes_per_step:8.0f} B per step (coordinator)",
            f"  per simulated rank {r.clients_per_rank:7.1f} Redis clients, "
            f"{r.threads_per_rank:.1f} threads, {r.sim_bytes_per_rank / 1e6:.2f} MB of sim "
            f"process memory (what sizes a large run: see --ranks 4096)",
            f"  ranks clean {r.ranks_clean}/{r.ranks}, declared dead {r.declared_dead}, "
            f"steps {r.steps_done}/{r.ranks * r.steps * r.epochs}",
            f"  saturated: {r.saturated}",
            *(
                [
                    "  redis commands    "
                    + ", ".join(
                        f"{name} {us:.1f} µs x {calls:,} ({100 * part:.0f}%)"
                        for name, calls, us, part in r.redis_commands
                    )
                    + " (µs inside Redis a call; exec and scripts hold what they ran)"
                ]
                if r.redis_commands
                else []
            ),
            *breakdown(r),
            *(
                [
                    f"  partition         rank {r.ranks - 1} cut off: declared dead "
                    f"{r.dead_after_cut_s:.2f} s later (heartbeat timeout "
                    f"{r.heartbeat_timeout_s:g} s; goal: within timeout + 1 s)"
                ]
                if r.dead_after_cut_s is not None
                else []
            ),
        ]
    )


def compare(one: ScaleResult, on: ScaleResult) -> str:
    """The cluster's figures beside one Redis's, same rank count, same host."""
    return (
        f"  cluster vs one Redis at {one.ranks} ranks: epoch overhead "
        f"{100 * on.overhead:+.1f}% vs {100 * one.overhead:+.1f}%, dispatch p50/p99 "
        f"{on.dispatch_p50_ms:.2f}/{on.dispatch_p99_ms:.2f} vs "
        f"{one.dispatch_p50_ms:.2f}/{one.dispatch_p99_ms:.2f} ms, busiest Redis CPU "
        f"{on.redis_cpu_busiest:.2f} vs {one.redis_cpu_busiest:.2f} cores, coordinator CPU "
        f"{on.coordinator_cpu:.2f} vs {one.coordinator_cpu:.2f}"
    )


def compare_agents(base: ScaleResult, on: ScaleResult) -> str:
    """Host agents' figures beside no agents, same rank count, same host."""
    return (
        f"  {on.ranks_per_host} ranks a host agent vs none at {base.ranks} ranks: epoch "
        f"overhead {100 * on.overhead:+.1f}% vs {100 * base.overhead:+.1f}%, dispatch p50/p99 "
        f"{on.dispatch_p50_ms:.2f}/{on.dispatch_p99_ms:.2f} vs "
        f"{base.dispatch_p50_ms:.2f}/{base.dispatch_p99_ms:.2f} ms, coordinator CPU "
        f"{on.coordinator_cpu:.2f} vs {base.coordinator_cpu:.2f}, redis CPU "
        f"{on.redis_cpu:.2f} vs {base.redis_cpu:.2f}, agents CPU {on.agents_cpu:.2f}, "
        f"sim CPU {on.harness_cpu:.2f} vs {base.harness_cpu:.2f} cores"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flodl-bus bench scale", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64", help="comma-separated rank counts (64,256,1024)")
    ap.add_argument("--step-ms", type=float, default=50.0, help="simulated step time")
    ap.add_argument("--steps", type=int, default=40, help="batches per rank per epoch")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--procs", type=int, default=max(2, os.cpu_count() or 2))
    ap.add_argument("--mode", default="nccl-cadence", choices=("nccl-cadence", "nccl-sync"))
    ap.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        help="seconds (default: 30 up to 1,024 ranks, then 30 x sqrt(N / 1024))",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per rank count (default: 240 + 0.1 per rank); a run still going "
        "60 s past it is stopped without figures",
    )
    ap.add_argument(
        "--no-checks",
        action="store_true",
        help="start even where the host looks too small for the largest rank count "
        "(file descriptors, threads, memory)",
    )
    ap.add_argument(
        "--no-record", action="store_true", help="coordinator without its dispatch record"
    )
    ap.add_argument("--profile", default=None, help="cProfile the coordinator into this file")
    ap.add_argument(
        "--redis-url",
        default=None,
        help="an existing server, or a cluster's redis+cluster:// URL (default: start one)",
    )
    ap.add_argument(
        "--cluster",
        action="store_true",
        help="per rank count, also run on a local Redis Cluster (3 masters + 3 replicas) "
        "and print its figures beside the single Redis's",
    )
    ap.add_argument(
        "--ranks-per-host",
        default="1",
        help="ranks a host agent speaks for (flodl_bus.agent); 1: no agent. A list "
        "(1,8) runs each per rank count, interleaved, each beside the first",
    )
    ap.add_argument(
        "--ingest-procs",
        type=int,
        default=0,
        help="the coordinator's upstream read by this many reader processes (bus.ingest; "
        "0: on its own thread)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="repeat the interleaved runs")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--keep", default=None, help="copy every process's raw timings here")
    # set by `bench latency` (which makes the namespaces), not meant to be typed
    ap.add_argument("--rank-netns", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--relay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--cut", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cut-rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--network", default="loopback", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    counts = rank_counts(args.ranks)
    if counts is None:
        return 2
    if not counts or min(counts) < 1 or args.steps < 1 or args.epochs < 1 or args.step_ms <= 0:
        print("--ranks, --steps, --epochs and --step-ms must be positive", file=sys.stderr)
        return 2
    # redis-server, the coordinator and every sim process inherit the raised limits
    raise_limits()
    if not args.no_checks:
        short = problems(
            max(counts),
            args.procs,
            cluster=args.cluster and args.redis_url is None,
            own_redis=args.redis_url is None,
        )
        if short:
            print(f"bench scale: this host cannot run {max(counts)} ranks:", file=sys.stderr)
            for p in short:
                print(f"  {p}", file=sys.stderr)
            print("  (--no-checks starts anyway)", file=sys.stderr)
            return 2
    per_host = rank_counts(args.ranks_per_host)
    if per_host is None or min(per_host) < 1:
        print("--ranks-per-host: expected positive numbers like 1,8", file=sys.stderr)
        return 2
    if args.ingest_procs < 0:
        print("--ingest-procs: 0 or more", file=sys.stderr)
        return 2
    if max(per_host) > 1 and (args.cluster or args.rank_netns):
        print("--ranks-per-host above 1: one Redis on loopback only", file=sys.stderr)
        return 2
    results = []
    overran = False
    for n in counts:
        try:
            results += _run_count(args, n, per_host)
        except ScaleTimeout as exc:
            # The other rank counts still run: a sweep's smaller sizes keep their figures.
            print(f"bench scale: {exc}", file=sys.stderr, flush=True)
            overran = True
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 1 if overran else 0


def _run_count(args: argparse.Namespace, n: int, per_host: list[int]) -> list[ScaleResult]:
    """Every run of ``n`` ranks the arguments ask for, each reported as it ends."""
    results: list[ScaleResult] = []
    if per_host != [1]:
        for _ in range(args.rounds):
            runs = [run_one(args, n, per_host=k) for k in per_host]
            for r in runs:
                print(report(r), flush=True)
            for r in runs[1:]:
                print(compare_agents(runs[0], r), flush=True)
            results += runs
        return results
    r = run_one(args, n)
    results.append(r)
    print(report(r), flush=True)
    if args.cluster and args.redis_url is None:
        c = run_one(args, n, on_cluster=True)
        results.append(c)
        print(report(c), flush=True)
        print(compare(r, c), flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
