"""The two process roles of ``flodl-bus bench scale``: the coordinator and a sim host.

* ``coordinator``: the real ``Coordinator`` core driven by the real ``CoordinatorLoop``
  over the real ``RedisCoordinatorBus``, recording every dispatch as production does.
  Its bus notes when each control entry was handed to Redis (CLOCK_MONOTONIC, which
  every process of one host shares) and under which id.
* ``sim``: many ranks in one process. Each rank is the real ``RedisRankBus`` with the
  real ``RankRuntime`` (reader, heartbeat and session threads) and the real
  ``WorkerControl``; its training thread is the loop of ``worker.loop`` without torch: a
  step is a sleep of the given length, and a collective returns at once. Each rank notes
  when each control entry reached its reader.

Both write what they measured as JSON for the driver (``bench.scale``), with samples of
their own CPU time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flodl_bus.agent.rank_bus import AgentRankBus
from flodl_bus.bench.scale_agents import hosts, socket_of
from flodl_bus.bus import cluster
from flodl_bus.bus.api import Delivery
from flodl_bus.bus.connection import connect
from flodl_bus.bus.ids import format_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.sharded import ShardedCoordinatorBus
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.runtime import CoordinatorLoop, LoopOptions
from flodl_bus.coordinator.shadow import ShadowRecorder
from flodl_bus.params.port import SyncResult
from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import (
    AveragedParams,
    ControlMsg,
    ControlWire,
    EpochPlan,
    Exiting,
    MetricsMsg,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
)
from flodl_bus.protocol.signing import fixed_keys, rank_keys_for
from flodl_bus.record.dispatch import DispatchRecorder
from flodl_bus.record.process import process_mode
from flodl_bus.worker.control import WorkerControl
from flodl_bus.worker.inbox import Closed, Inbox
from flodl_bus.worker.runtime import RankRuntime, RuntimeConfig

SEED = b"flodl-bench-scale"


def raise_fd_limit() -> None:
    """Hundreds of ranks hold hundreds of sockets: lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class CpuSampler:
    """(monotonic, process CPU seconds) every ``every`` seconds, on a thread; and the
    most threads the process ran at once."""

    def __init__(self, every: float = 0.25) -> None:
        self.samples: list[tuple[float, float]] = []
        self.peak_threads = 0
        self._stop = threading.Event()
        self._every = every
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), time.process_time()))
            self.peak_threads = max(self.peak_threads, threading.active_count())
            if self._stop.wait(self._every):
                self.samples.append((time.monotonic(), time.process_time()))
                return

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join()
        return self.samples


# ------------------------------------------------------------------ coordinator


class _PutClock:
    """When a write began, for a dispatch's latency: when the loop handed its oldest
    item to its sender thread (``coordinator.sender`` calls ``put_at``), so the wait in
    that queue counts; else the write's own start."""

    _handed: float | None = None

    def put_at(self, at: float) -> None:
        self._handed = at

    def _t0(self) -> float:
        at, self._handed = self._handed, None
        return time.monotonic() if at is None else at


class TimedCoordinatorBus(_PutClock, RedisCoordinatorBus):
    """Notes (stream, entry id, type, monotonic time before the write) of every send."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[tuple[str, str, str, float]] = []
        super().__init__(*args, **kwargs)

    def _timed(self, stream: str, msg: ControlWire, t0: float) -> None:
        top = self._tops.get(stream)
        if top is not None:
            self.sent.append((stream, format_id(top), wire.type_name(msg), t0))

    def send(self, rank: int, msg: ControlWire) -> None:
        t0 = self._t0()
        super().send(rank, msg)
        self._timed(self.keys.ctl(rank), msg, t0)

    def broadcast(self, msg: ControlWire) -> None:
        t0 = self._t0()
        super().broadcast(msg)
        self._timed(self.keys.ctl_all, msg, t0)

    def send_batch(self, items: Sequence[tuple[int | None, ControlWire]]) -> list[str]:
        t0 = self._t0()
        ids = super().send_batch(items)
        for (rank, msg), eid in zip(items, ids, strict=True):
            stream = self.keys.ctl_all if rank is None else self.keys.ctl(rank)
            self.sent.append((stream, eid, wire.type_name(msg), t0))
        return ids


class TimedShardedBus(_PutClock, ShardedCoordinatorBus):
    """``TimedCoordinatorBus`` on a Redis Cluster: each shard's copy of a broadcast is
    its own entry (id) on its own stream, each timed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[tuple[str, str, str, float]] = []
        super().__init__(*args, **kwargs)

    def send(self, rank: int, msg: ControlWire) -> None:
        t0 = self._t0()
        super().send(rank, msg)
        part = self._part(rank)
        stream = self.keys.ctl(rank)
        self.sent.append((stream, format_id(part._tops[stream]), wire.type_name(msg), t0))

    def broadcast(self, msg: ControlWire) -> None:
        t0 = self._t0()
        super().broadcast(msg)
        for part in self.parts:
            top = part._tops[part._bcast]
            self.sent.append((part._bcast, format_id(top), wire.type_name(msg), t0))

    def send_batch(self, items: Sequence[tuple[int | None, ControlWire]]) -> list[str]:
        t0 = self._t0()
        ids = super().send_batch(items)
        if items and items[0][0] is None:
            for part, shard_ids in zip(self.parts, self.broadcast_ids, strict=True):
                for (_, msg), eid in zip(items, shard_ids, strict=True):
                    self.sent.append((part._bcast, eid, wire.type_name(msg), t0))
            return ids
        for (rank, msg), eid in zip(items, ids, strict=True):
            assert rank is not None
            self.sent.append((self.keys.ctl(rank), eid, wire.type_name(msg), t0))
        return ids


_KEYS: dict[tuple[str, str], RunKeys] = {}


def run_keys(args: argparse.Namespace) -> RunKeys:
    """The run's keys; on a Redis Cluster every process plans the same shards (the plan
    is a function of the run id and the cluster's masters)."""
    at = (args.url, args.run)
    if at not in _KEYS:
        _KEYS[at] = RunKeys(args.run, cluster.plan_shards(args.url, args.run))
    return _KEYS[at]


def run_coordinator(args: argparse.Namespace) -> int:
    raise_fd_limit()
    out = Path(args.dir)
    keys = run_keys(args)
    ck = fixed_keys(SEED)
    n = args.ranks
    config = CoordinatorConfig(
        mode=args.mode,
        world_size=n,
        total_samples=n * args.steps,
        batch_size=1,
        num_epochs=args.epochs,
        heartbeat_timeout=args.heartbeat_timeout,
    )
    core = Coordinator(config)
    bus: TimedCoordinatorBus | TimedShardedBus
    if keys.shards:
        clients = [
            connect(args.url, client_name="bench-coordinator", key=b) for b in keys.broadcasts
        ]
        bus = TimedShardedBus(clients, keys, ck, ranks=range(n), wait_ms=cluster.DEFAULT_WAIT_MS)
    else:
        client = connect(args.url, client_name="bench-coordinator")
        k = args.ranks_per_host
        bus = TimedCoordinatorBus(
            client, keys, ck, ranks=range(n) if k == 1 else (), ingest_procs=args.ingest_procs
        )
        if bus.ingest is not None and not bus.ingest.wait_ready(args.timeout):
            raise RuntimeError("bench scale: the ingest reader processes did not start")
        if k > 1:
            # each host agent's ranks come folded in its one stream (``flodl_bus.agent``)
            for j, ranks in enumerate(hosts(n, k)):
                bus.add_fold(f"h{j}", ranks)
            for r in range(n):
                bus.add_rank(r)
    rec = None
    if not args.no_record:
        # as the coordinator command records: the line built by a record process unless
        # FLODL_RECORD_PROCESS says otherwise (``record.process``)
        mode = process_mode()
        rec = (
            ShadowRecorder(out, config=config)
            if mode == "shadow"
            else DispatchRecorder(out, "coordinator", process=mode == "process")
        )
        rec.header(
            run=args.run,
            bench="scale",
            ranks=n,
            mode=args.mode,
            clock="time.monotonic",
            # the run's config makes the record replayable (``flodl-bus replay``)
            config=dataclasses.asdict(config),
            ranks_per_host=args.ranks_per_host,
        )
    loop = CoordinatorLoop(
        core,
        bus,
        recorder=rec,
        options=LoopOptions(first_contact=args.timeout, exit_grace=30.0),
        rank_of=keys.rank_of,
    )
    cpu = CpuSampler()
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        code = prof.runcall(loop.run)
        prof.dump_stats(args.profile)
    else:
        code = loop.run()
    samples = cpu.stop()
    if rec is not None:
        rec.close()
    bus.close()
    result = {
        "code": code,
        "dead": [r for r in range(n) if core.live.dead[r]],
        "dispatches": loop.dispatches,
        "sent": bus.sent,
        "cpu": samples,
        "record_bytes": rec.path.stat().st_size if rec is not None else 0,
        "trim_passes": bus.trimmed_passes,
        "profile": loop.profile.to_dict(),
    }
    (out / "coordinator.json").write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------ sim


class NoParams:
    """A parameter plane whose collectives return at once (the bench measures control)."""

    def sync_now(self, steps_since_avg: int) -> SyncResult:
        return SyncResult(None, None, None)

    def snapshot(self, steps_since_avg: int) -> None:
        raise RuntimeError("bench scale runs the nccl backend only")

    def load_averaged(self, avg: AveragedParams) -> None:
        return None

    def param_norm(self) -> float:
        return 1.0

    def abort(self) -> None:
        return None

    def new_session(self, uid: bytes, new_rank: int, new_world_size: int) -> None:
        return None


def _noted(arrivals: list[tuple[str, str, str, float]], got: list[Delivery]) -> list[Delivery]:
    """``got``, each delivery noted with its arrival time."""
    if got:
        t = time.monotonic()
        note = arrivals.append
        for d in got:
            note((d.stream, d.entry_id, type(d.msg).__name__, t))
    return got


class TimedRankBus(RedisRankBus):
    """Notes (stream, entry id, type, monotonic arrival) of every control delivery."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.arrivals: list[tuple[str, str, str, float]] = []
        super().__init__(*args, **kwargs)

    def read_control(self, block_ms: int) -> list[Delivery]:
        return _noted(self.arrivals, super().read_control(block_ms))


class TimedAgentRankBus(AgentRankBus):
    """``TimedRankBus`` through a host agent."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.arrivals: list[tuple[str, str, str, float]] = []
        super().__init__(*args, **kwargs)

    def read_control(self, block_ms: int) -> list[Delivery]:
        return _noted(self.arrivals, super().read_control(block_ms))


class SimRank:
    """One rank: real bus, runtime and control core; a sleep for a training step."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.rank = rank
        self.step_s = args.step_ms / 1000.0
        keys = run_keys(args)
        ck = fixed_keys(SEED)
        bus: TimedRankBus | TimedAgentRankBus
        if args.ranks_per_host > 1:
            bus = TimedAgentRankBus(
                socket_of(args.dir, rank, args.ranks_per_host), keys, rank, rank_keys_for(ck, rank)
            )
        else:
            bus = TimedRankBus(
                connect(args.url, key=keys.ctl(rank)), keys, rank, rank_keys_for(ck, rank)
            )
        self.bus = bus
        self.inbox = Inbox()
        params = NoParams()
        self.control = WorkerControl(
            rank=rank,
            params=params,
            batch_size=1,
            pick_space=args.ranks * args.steps,
            clock=time.perf_counter,
        )
        self.runtime = RankRuntime(
            bus=bus,
            inbox=self.inbox,
            params=params,
            world_size=args.ranks,
            config=RuntimeConfig(coord_liveness_timeout=args.heartbeat_timeout),
        )
        self.clean = False
        self.steps = 0
        #: seconds this rank spent in its plans (sleeps plus its own per-step work): the
        #: time an epoch takes with a control plane that never keeps a rank waiting
        self.trained_s = 0.0
        self.thread = threading.Thread(target=self.run, name=f"sim{rank}", daemon=True)

    def start(self) -> None:
        self.runtime.start()
        self.thread.start()

    # the loop of worker.loop.RankLoop, minus the model
    def _service(self, msg: ControlMsg) -> bool:
        out = self.control.dispatch(msg)
        for up in out.upstream:
            self.bus.publish(up)
        while out.throttled and not out.stop:
            nxt = self.inbox.get()
            if nxt is None or isinstance(nxt, Closed):
                return self.control.channel_closed().stop
            out = self.control.dispatch(nxt)
            for up in out.upstream:
                self.bus.publish(up)
        return out.stop

    def _wait_plan(self) -> EpochPlan | None:
        while True:
            plan = self.control.take_pending_plan()
            if plan is not None:
                return plan
            msg = self.inbox.get()
            if msg is None or isinstance(msg, (Closed, Shutdown)):
                return None
            if isinstance(msg, StartEpoch):
                return msg.plan
            if self._service(msg):
                return None

    def _train(self, plan: EpochPlan) -> bool:
        start = time.perf_counter()
        ctl = self.control
        ctl.begin_plan(plan)
        done = 0
        while done < ctl.num_batches:
            time.sleep(self.step_s)
            done += 1
            self.steps += 1
            batch, lr = ctl.step_done(0.5, self.step_s * 1000.0, 0.0, 0.1)
            self.bus.publish(batch)
            if lr is not None:
                self.bus.publish(lr)
            while (msg := self.inbox.poll()) is not None:
                if isinstance(msg, Closed) or self._service(msg):
                    return True
        ms = (time.perf_counter() - start) * 1000.0
        self.trained_s += ms / 1000.0
        self.bus.publish(
            MetricsMsg(
                rank=self.rank,
                epoch=plan.epoch,
                avg_loss=0.5 if done else 0.0,
                batches_processed=done,
                epoch_ms=ms,
                samples_processed=done,
                share_complete_ms=done * self.step_s * 1000.0,
                compute_only_ms=done * self.step_s * 1000.0,
                data_starve_ms=0.0,
                scalars={},
            )
        )
        return False

    def run(self) -> None:
        try:
            while (plan := self._wait_plan()) is not None:
                if self._train(plan):
                    break
            while (msg := self.inbox.poll()) is not None:
                if isinstance(msg, ShutdownWithSave):
                    self.control.dispatch(msg)
            self.bus.publish(Exiting(rank=self.rank))
            self.clean = True
        finally:
            self.runtime.close()


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


#: a sim thread's stack: thousands of ranks' threads in one process at the default 8 MiB
#: reserve tens of GB of address space (refused outright under strict overcommit)
SIM_THREAD_STACK = 1 << 20


def run_sim(args: argparse.Namespace) -> int:
    raise_fd_limit()
    threading.stack_size(SIM_THREAD_STACK)
    base_rss = _peak_rss_bytes()
    lo, hi = (int(x) for x in args.slice.split(":"))
    ranks = [SimRank(args, r) for r in range(lo, hi)]
    cpu = CpuSampler()
    for r in ranks:
        r.start()
    deadline = time.monotonic() + args.timeout
    for r in ranks:
        r.thread.join(max(0.0, deadline - time.monotonic()))
    samples = cpu.stop()
    result: dict[str, Any] = {
        "ranks": [
            {
                "rank": r.rank,
                # finished on the coordinator's word, not on losing it
                "clean": r.clean
                and not r.thread.is_alive()
                and not r.runtime.coordinator_lost.is_set()
                and not r.runtime.declared_dead.is_set(),
                "steps": r.steps,
                "trained_s": r.trained_s,
                "arrivals": r.bus.arrivals,
            }
            for r in ranks
        ],
        "cpu": samples,
        # what the ranks cost the host beyond the process's imports (memory, threads)
        "base_rss": base_rss,
        "peak_rss": _peak_rss_bytes(),
        "peak_threads": cpu.peak_threads,
    }
    Path(args.dir, f"sim{lo}.json").write_text(json.dumps(result))
    return 0


def role_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="flodl-bus bench scale --role")
    ap.add_argument("--role", choices=("coordinator", "sim"), required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--step-ms", type=float, required=True)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--heartbeat-timeout", type=float, required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--slice", default="0:0")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--ingest-procs", type=int, default=0)
    args = ap.parse_args(argv)
    return run_coordinator(args) if args.role == "coordinator" else run_sim(args)


if __name__ == "__main__":
    sys.exit(role_main(sys.argv[1:]))
