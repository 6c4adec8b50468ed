"""``flodl-bus bench path --ranks N[,N...]``: the coordinator's cost per message at N ranks.

What one coordinator thread pays for each upstream message, stage by stage, at world
size N, on a real ``redis-server`` (loopback) with every rank's upstream pre-filled with
``--steps`` training steps (a ``Batch`` each, and an ``LrUpdate`` with the first, as a
rank sends them at a constant LR):

* ``ingest``: ``RedisCoordinatorBus.read_upstream`` + ack (XREADGROUP, seq, MAC, decode);
* ``+ core``: the same through ``CoordinatorLoop``'s dispatch (``Coordinator.handle``,
  one ``tick`` per read) without a record;
* ``+ record``: the same with the dispatch record as the ``flodl-bus coordinator``
  command writes it: the state summary and delta on the thread, the line built by the
  record process (``record.process``); ``caught up`` is how long after the last message
  the record process had every line on disk;
* ``+ record in-thread``: the same with the whole line built on the thread
  (``FLODL_RECORD_PROCESS=0``), the reference of the one above;
* ``shadow core``: the same with the states rebuilt in the record process by a shadow
  core (``FLODL_RECORD_PROCESS=shadow``, ``coordinator.shadow``): no summary on the thread;
* ``send``: one ``StartEpoch`` to every rank in one batch (encode, MAC, XADD), per
  message; ``broadcast``: one signed ``CoordHeartbeat`` to every rank (MAC vector up to
  64 ranks, Ed25519 above);
* per read, whatever it holds: an XREADGROUP over the N upstream streams that finds
  nothing, and one ``Coordinator.tick`` (the loop runs one after every read).

Each stage's figure is the best of ``--repeats`` passes. References from the same run: a
PING round trip, and the budget: with ``--step-ms`` steps, N ranks send 2N messages a
step, so one thread keeps up only while a message costs less than step / 2N; ``cores``
is the share of one core the path needs.

``--ingest-procs 0,2``: every stage and the per-read cost again with the upstream read by
that many reader processes (``bus.ingest``), the passes of each K interleaved; beside
each wall figure, this process's CPU per message, which is what a host with cores to
spare for the readers pays on the dispatching thread.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flodl_bus.bench.bus import ingest_procs_list, measure_ping
from flodl_bus.bench.scale import rank_counts
from flodl_bus.bus import entries
from flodl_bus.bus.connection import connect
from flodl_bus.bus.ids import IdClock, format_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer
from flodl_bus.bus.stream_ops import StreamsConfig
from flodl_bus.bus.streams import RedisCoordinatorBus
from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.runtime import CoordinatorLoop
from flodl_bus.coordinator.shadow import ShadowRecorder
from flodl_bus.protocol import messages as m
from flodl_bus.protocol.signing import fixed_keys
from flodl_bus.record.dispatch import DispatchRecorder

SEED = b"flodl-bench-path"
#: no trimmer thread: the bench measures the dispatching thread alone
QUIET = StreamsConfig(trim_interval_s=0.0)


@dataclass(frozen=True)
class PathCosts:
    ranks: int
    messages: int
    ingest_us: float
    core_us: float
    record_us: float
    thread_us: float
    caught_up_ms: float
    #: CPU time of the bench's own process per message (every thread of it), the figure
    #: a shared host's load disturbs least: ``+ core``, ``+ record``, ``... in-thread``
    core_cpu_us: float
    record_cpu_us: float
    thread_cpu_us: float
    #: ``FLODL_RECORD_PROCESS=shadow``: the states rebuilt in the record process
    shadow_us: float
    shadow_cpu_us: float
    shadow_caught_up_ms: float
    send_us: float
    broadcast_us: float
    record_bytes: float
    read_us: float
    tick_us: float
    ping_us: float
    budget_us: float
    #: this process's CPU per message of the ingest stage
    ingest_cpu_us: float = math.nan


def _prefill(url: str, keys: RunKeys, ranks: int, steps: int) -> int:
    client = connect(url)
    signing = fixed_keys(SEED)
    clock = IdClock()
    n = 0
    pipe = client.pipeline(transaction=False)
    # rank-interleaved, as live ranks publish: step s of every rank, then step s + 1
    seqs = [0] * ranks
    for s in range(1, steps + 1):
        for r in range(ranks):
            stream = keys.up(r)
            batch = m.Batch(rank=r, batch_ms=50.0, data_ms=0.1, step_count=s, batch_loss=0.5)
            lr = (m.LrUpdate(rank=r, lr=0.1),) if s == 1 else ()
            for msg in (batch, *lr):
                seqs[r] += 1
                eid = format_id(clock.next(1))
                fields = entries.build(signing.rank(r), stream, eid, msg, str(r), seqs[r])
                pipe.xadd(stream, fields, id=eid)  # type: ignore[arg-type]
                n += 1
            if len(pipe) >= 2000:
                pipe.execute()
    pipe.execute()
    client.close()
    return n


def _ping_us(url: str, n: int = 500) -> float:
    return statistics.median(measure_ping(url, n)) / 1000


def _config(ranks: int, steps: int) -> CoordinatorConfig:
    # Chunks far longer than the pre-filled steps: no rank finishes one, so the run is
    # the steady state of an epoch (Batch/LrUpdate in, now and then a SyncNow out).
    return CoordinatorConfig(
        mode="nccl-cadence",
        world_size=ranks,
        total_samples=ranks * steps * 50,
        batch_size=1,
        num_epochs=1,
        heartbeat_timeout=3600.0,
    )


def _bus(url: str, keys: RunKeys, ranks: int, procs: int) -> RedisCoordinatorBus:
    bus = RedisCoordinatorBus(
        connect(url), keys, fixed_keys(SEED), ranks=range(ranks), config=QUIET, ingest_procs=procs
    )
    if bus.ingest is not None and not bus.ingest.wait_ready(120):
        raise RuntimeError("bench path: ingest reader processes did not start within 120 s")
    return bus


def _run(
    url: str, ranks: int, steps: int, stage: str, work: Path, procs: int = 0
) -> tuple[float, int, float, float, float]:
    """(µs per message, messages, record bytes per message, ms the record process took
    to catch up after the last message, CPU µs of this process per message) of one
    pre-filled pass."""
    keys = RunKeys(f"path-{uuid.uuid4().hex[:8]}")
    bus = _bus(url, keys, ranks, procs)
    for _ in range(3):
        bus.read_upstream(0)  # the first reads drain the (empty) pending lists: not timed
    total = _prefill(url, keys, ranks, steps)
    rec = None
    loop = None
    if stage != "ingest":
        core = Coordinator(_config(ranks, steps))
        if stage in ("record", "thread"):
            rec = DispatchRecorder(work / keys.run, "coordinator", process=stage == "record")
            rec.header(run=keys.run, bench="path", ranks=ranks)
        elif stage == "shadow":
            rec = ShadowRecorder(work / keys.run, config=core.config)
            rec.header(run=keys.run, bench="path", ranks=ranks)
        loop = CoordinatorLoop(core, bus, recorder=rec, rank_of=keys.rank_of)
        now = time.monotonic()
        before = core.state_summary()
        outs = core.start(now)
        if rec is not None:
            rec.core_call("start", now=now, before=before, after=core.state_summary(), out=outs)
        loop._apply(outs, now)
    got = 0
    c0 = time.process_time()
    t0 = time.perf_counter()
    while got < total:
        ds = bus.read_upstream(200)
        if not ds:
            raise RuntimeError(f"bench path: stalled at {got}/{total} messages")
        got += len(ds)
        if loop is None:
            bus.ack(ds)
            continue
        # one turn of CoordinatorLoop.run: every delivery of the read, then a tick
        loop._dispatch_all(ds)
        loop._tick()
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    size = caught_up = 0.0
    if rec is not None:
        rec.flush()
        caught_up = (time.perf_counter() - t0 - elapsed) * 1000
        rec.close()
        if rec.failure is not None:
            raise RuntimeError(f"bench path: {rec.failure}")
        size = rec.path.stat().st_size / got
    bus.flush_acks()
    bus.close()
    return elapsed * 1e6 / got, got, size, caught_up, cpu * 1e6 / got


def _sends(url: str, ranks: int) -> tuple[float, float]:
    """(µs per StartEpoch in one batch to every rank, µs per broadcast)."""
    keys = RunKeys(f"path-{uuid.uuid4().hex[:8]}")
    bus = RedisCoordinatorBus(
        connect(url), keys, fixed_keys(SEED), ranks=range(ranks), config=QUIET
    )
    plan = m.EpochPlan(epoch=0, partition_offset=0, partition_size=64)
    items: list[tuple[int | None, m.ControlWire]] = [(r, m.StartEpoch(plan)) for r in range(ranks)]
    best_send = best_cast = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        bus.send_batch(items)
        best_send = min(best_send, (time.perf_counter() - t0) * 1e6 / ranks)
        t0 = time.perf_counter()
        for _ in range(20):
            bus.broadcast(m.CoordHeartbeat())
        best_cast = min(best_cast, (time.perf_counter() - t0) * 1e6 / 20)
    bus.close()
    return best_send, best_cast


def _per_read(url: str, ranks: int, steps: int, procs: int = 0) -> tuple[float, float]:
    """(µs of an XREADGROUP over every rank's stream that finds nothing, µs of a tick).
    With reader processes: of a ``read_upstream`` that finds nothing in their pipes."""
    bus = _bus(url, RunKeys(f"path-{uuid.uuid4().hex[:8]}"), ranks, procs)
    for _ in range(3):
        bus.read_upstream(0)  # the first passes drain the (empty) pending lists
    read = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            bus.read_upstream(0)
        read = min(read, (time.perf_counter() - t0) * 1e5)
    bus.close()
    core = Coordinator(_config(ranks, steps))
    now = 100.0
    core.start(now)
    tick = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            now += 0.001
            core.tick(now)
        tick = min(tick, (time.perf_counter() - t0) * 5e4)
    return read, tick


def measure(
    url: str, ranks: int, steps: int, step_ms: float, work: Path, repeats: int = 3
) -> PathCosts:
    """Each stage's best of ``repeats`` passes (a shared host's noise only adds)."""
    return measure_procs(url, ranks, steps, step_ms, work, repeats, [0])[0]


def measure_procs(
    url: str,
    ranks: int,
    steps: int,
    step_ms: float,
    work: Path,
    repeats: int,
    procs: Sequence[int],
) -> list[PathCosts]:
    """``measure`` for each ingest reader count in ``procs``. Every pass of every stage
    and K is alternated, so that a shared host's load falls on each alike."""
    kinds = ("ingest", "core", "record", "thread", "shadow")
    runs: dict[tuple[str, int], list[tuple[float, int, float, float, float]]] = {}
    for _ in range(repeats):
        for k in procs:
            for st in kinds:
                runs.setdefault((st, k), []).append(_run(url, ranks, steps, st, work, k))
    send, cast = _sends(url, ranks)
    ping = _ping_us(url)
    out = []
    for k in procs:

        def best(st: str, k: int = k) -> tuple[float, int, float, float, float]:
            return min(runs[(st, k)])

        def cpu(st: str, k: int = k) -> float:
            return min(r[4] for r in runs[(st, k)])

        read, tick = _per_read(url, ranks, steps, k)
        record = best("record")
        shadow = best("shadow")
        out.append(
            PathCosts(
                ranks=ranks,
                messages=best("ingest")[1],
                ingest_us=best("ingest")[0],
                core_us=best("core")[0],
                record_us=record[0],
                thread_us=best("thread")[0],
                caught_up_ms=record[3],
                core_cpu_us=cpu("core"),
                record_cpu_us=cpu("record"),
                thread_cpu_us=cpu("thread"),
                shadow_us=shadow[0],
                shadow_cpu_us=cpu("shadow"),
                shadow_caught_up_ms=shadow[3],
                send_us=send,
                broadcast_us=cast,
                record_bytes=record[2],
                read_us=read,
                tick_us=tick,
                ping_us=ping,
                budget_us=step_ms * 1000 / (2 * ranks),
                ingest_cpu_us=cpu("ingest"),
            )
        )
    return out


def report(c: PathCosts, step_ms: float, procs: int = 0) -> str:
    def cores(us: float) -> str:
        return f"{us / c.budget_us:5.2f} cores"

    def cpu(us: float) -> str:
        return "" if math.isnan(us) else f"   cpu {us:6.1f} µs/msg"

    where = "ingest on the dispatching thread" if procs == 0 else f"ingest in {procs} procs"
    return "\n".join(
        [
            f"ranks {c.ranks} ({c.messages} messages), {where}: budget {c.budget_us:.1f} µs "
            f"a message at {step_ms:g} ms steps (2 messages a rank a step); PING "
            f"{c.ping_us:.1f} µs",
            f"  ingest             {c.ingest_us:7.1f} µs/msg   {cores(c.ingest_us)}"
            f"{cpu(c.ingest_cpu_us)}",
            f"  ingest + core      {c.core_us:7.1f} µs/msg   {cores(c.core_us)}"
            f"{cpu(c.core_cpu_us)}",
            f"  ingest+core+record {c.record_us:7.1f} µs/msg   {cores(c.record_us)}   "
            f"(record {c.record_us - c.core_us:+.1f} µs, {c.record_bytes:.0f} B/msg on disk; "
            f"record process caught up {c.caught_up_ms:.0f} ms after the last message)",
            f"  ... in-thread      {c.thread_us:7.1f} µs/msg   {cores(c.thread_us)}   "
            f"(record {c.thread_us - c.core_us:+.1f} µs: the reference, FLODL_RECORD_PROCESS=0)",
            f"  ... shadow core    {c.shadow_us:7.1f} µs/msg   {cores(c.shadow_us)}   "
            f"(record {c.shadow_us - c.core_us:+.1f} µs: FLODL_RECORD_PROCESS=shadow; caught up "
            f"{c.shadow_caught_up_ms:.0f} ms after the last message)",
            f"  CPU of this process: + core {c.core_cpu_us:.1f} µs/msg, + record "
            f"{c.record_cpu_us:.1f} (record {c.record_cpu_us - c.core_cpu_us:+.1f}), in-thread "
            f"{c.thread_cpu_us:.1f} (record {c.thread_cpu_us - c.core_cpu_us:+.1f}), shadow "
            f"{c.shadow_cpu_us:.1f} (record {c.shadow_cpu_us - c.core_cpu_us:+.1f})",
            f"  send (batched)     {c.send_us:7.1f} µs/msg   broadcast {c.broadcast_us:.1f} µs",
            f"  per read           {c.read_us + c.tick_us:7.1f} µs      (empty XREADGROUP "
            f"{c.read_us:.1f} µs + tick {c.tick_us:.1f} µs, whatever the read holds)",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flodl-bus bench path", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,256,1024", help="comma-separated world sizes")
    ap.add_argument("--steps", type=int, default=8, help="pre-filled steps per rank")
    ap.add_argument("--step-ms", type=float, default=50.0, help="step time of the budget")
    ap.add_argument("--repeats", type=int, default=3, help="passes per stage (best kept)")
    ap.add_argument("--redis-url", default=None, help="an existing server (default: start one)")
    ap.add_argument(
        "--ingest-procs",
        default="0",
        help="comma-separated ingest reader process counts, each measured in the same run "
        "(0: the dispatching thread reads; e.g. 0,2)",
    )
    args = ap.parse_args(argv)
    counts = rank_counts(args.ranks)
    if counts is None:
        return 2
    procs = ingest_procs_list(args.ingest_procs)
    if procs is None:
        return 2
    if not counts or min(counts) < 1 or min(args.steps, args.repeats) < 1 or args.step_ms <= 0:
        print("--ranks, --steps, --repeats and --step-ms must be positive", file=sys.stderr)
        return 2
    server = None
    url = args.redis_url
    if url is None:
        server = RedisServer(extra_args=["--maxclients", "10000"]).start()
        url = server.url
    try:
        with tempfile.TemporaryDirectory(prefix="flodl-path-") as tmp:
            for n in counts:
                costs = measure_procs(
                    url, n, args.steps, args.step_ms, Path(tmp), args.repeats, procs
                )
                for k, c in zip(procs, costs, strict=True):
                    print(report(c, args.step_ms, procs=k), flush=True)
    finally:
        if server is not None:
            server.stop()
            server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
