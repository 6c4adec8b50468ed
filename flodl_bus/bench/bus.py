"""``flodl-bus bench bus``: the bus measured beside the raw Redis round trip.

Every figure is printed next to PING measured on the same server in the same run:

- control dispatch latency, coordinator ``send``/``broadcast`` → rank ``read_control``
  return, with 1, 8 and 32 rank processes (each its own connection); the send time
  travels inside the message (``SetGlobalStep.global_step`` = ``perf_counter_ns``,
  CLOCK_MONOTONIC, the same clock in every process);
- coordinator upstream ingest (read + authenticate + decode + ack) with 8 and 32 ranks'
  streams pre-filled, and with rank processes publishing concurrently;
- cost of ``publish()`` on the sending (training) thread, in a burst and paced.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from flodl_bus.bus import entries
from flodl_bus.bus.connection import connect
from flodl_bus.bus.ids import IdClock, format_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.lane import Lane
from flodl_bus.bus.server import RedisServer
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.protocol import messages as m
from flodl_bus.protocol.signing import fixed_keys, rank_keys_for


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _us(ns: float) -> str:
    return f"{ns / 1000:8.1f} µs"


def _batch(rank: int, i: int) -> m.Batch:
    return m.Batch(rank=rank, batch_ms=12.5, data_ms=0.8, step_count=i, batch_loss=0.25)


# ------------------------------------------------------------------ raw round trip


def measure_ping(url: str, n: int, *, lane: bool = True) -> list[int]:
    """PING round trips. ``lane``: on a kept connection (``bus.lane``), the path the
    bus's own hot commands take, so the "x PING" ratios compare like with like; without
    it, through redis-py's client call, which costs 25-40 µs of CPU more a command on a
    loaded host and would flatter every ratio."""
    client = connect(url)
    path = Lane(client) if lane else None
    out = []
    for i in range(n + 1):
        t0 = time.perf_counter_ns()
        if path is not None:
            path.call("PING")
        else:
            client.ping()
        if i:  # the first one connects
            out.append(time.perf_counter_ns() - t0)
    if path is not None:
        path.close()
    client.close()
    return out


# --------------------------------------------------------------- dispatch latency


def _rank_proc(url: str, run: str, rank: int, secret: bytes, conn: Connection) -> None:
    bus = RedisRankBus(connect(url), run, rank, rank_keys_for(fixed_keys(secret), rank))
    bus.read_control(0)  # create groups, drain pending
    conn.send("ready")
    lat: list[int] = []
    done = False
    while not done:
        got = bus.read_control(500)
        now = time.perf_counter_ns()
        for d in got:
            if isinstance(d.msg, m.SetGlobalStep):
                lat.append(now - d.msg.global_step)
            elif isinstance(d.msg, m.Shutdown):
                done = True
        bus.ack(got)
    bus.close()
    conn.send(lat)
    conn.close()


def _bare_rank_proc(url: str, run: str, rank: int, secret: bytes, conn: Connection) -> None:
    """The floor's rank: XREAD BLOCK on the same two streams, nothing checked."""
    keys = RunKeys(run)
    streams = [keys.ctl(rank), keys.ctl_all_of(rank)]
    last = dict.fromkeys(streams, "0-0")
    lane = Lane(connect(url))
    conn.send("ready")
    lat: list[int] = []
    done = False
    while not done:
        reply = lane.call("XREAD", "BLOCK", 500, "STREAMS", *last, *last.values())
        now = time.perf_counter_ns()
        for name, items in reply or ():
            for eid, flat in items:
                last[name.decode()] = eid.decode()
                sent = int(flat[1])
                if sent < 0:
                    done = True
                else:
                    lat.append(now - sent)
    lane.close()
    conn.send(lat)
    conn.close()


class _BareCoordinator:
    """The floor's sender: one XADD a message on a kept connection, no MAC, no seq."""

    def __init__(self, url: str, run: str) -> None:
        self.keys = RunKeys(run)
        self.lane = Lane(connect(url))

    def _add(self, stream: str, msg: object) -> None:
        sent = msg.global_step if isinstance(msg, m.SetGlobalStep) else -1
        self.lane.call("XADD", stream, "*", "t", sent)

    def send(self, rank: int, msg: object) -> None:
        self._add(self.keys.ctl(rank), msg)

    def broadcast(self, msg: object) -> None:
        self._add(self.keys.ctl_all, msg)

    def close(self) -> None:
        self.lane.close()


def measure_dispatch(url: str, ranks: int, messages: int, *, bare: bool = False) -> list[int]:
    """Latency of every delivery (ns). ``bare``: the floor under the bus on the same
    server, processes and pacing: a bare XADD to a rank blocked in XREAD on the same two
    streams (no MAC, no seq, no id checks, no decode), what any Redis Streams control
    plane in Python pays before it checks anything."""
    run = f"bench-{uuid.uuid4().hex[:8]}"
    secret = os.urandom(32)  # the seed of fixed keys
    coord: RedisCoordinatorBus | _BareCoordinator
    if bare:
        coord = _BareCoordinator(url, run)
    else:
        coord = RedisCoordinatorBus(connect(url), run, fixed_keys(secret), ranks=range(ranks))
    target = _bare_rank_proc if bare else _rank_proc
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for r in range(ranks):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(url, run, r, secret, child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    for parent in pipes:
        parent.recv()
    # Each message is sent once the previous one has had time to land everywhere, so
    # the figure is latency, not queueing: ~0.5 ms plus the time `ranks` processes
    # need to wake on two cores.
    gap = 0.0005 + 0.00005 * ranks
    unicast_sent = 0
    for i in range(messages):
        msg = m.SetGlobalStep(global_step=time.perf_counter_ns())
        if i % 4 == 3:
            coord.broadcast(msg)
        else:
            coord.send(unicast_sent % ranks, msg)
            unicast_sent += 1
        deadline = time.perf_counter() + gap
        while time.perf_counter() < deadline:
            time.sleep(0.0001)
    coord.broadcast(m.Shutdown())
    all_lat: list[int] = []
    for parent in pipes:
        all_lat += parent.recv()
    for p in procs:
        p.join(10)
    coord.close()
    bcast_n = messages // 4
    expected = (messages - bcast_n) + bcast_n * ranks
    if len(all_lat) != expected:
        raise RuntimeError(f"dispatch bench lost messages: {len(all_lat)} != {expected}")
    return all_lat


# ------------------------------------------------------------------------- ingest


def _prefill(url: str, keys: RunKeys, ranks: int, per_rank: int, secret: bytes) -> None:
    client = connect(url)
    signing = fixed_keys(secret)
    for r in range(ranks):
        stream = keys.up(r)
        clock = IdClock()
        pipe = client.pipeline(transaction=False)
        for i in range(per_rank):
            eid = format_id(clock.next(1))
            fields = entries.build(signing.rank(r), stream, eid, _batch(r, i), str(r), i + 1)
            pipe.xadd(stream, fields, id=eid)  # type: ignore[arg-type]
            if len(pipe) >= 1000:
                pipe.execute()
        pipe.execute()
    client.close()


def _ingest(coord: RedisCoordinatorBus, total: int, timeout: float = 120.0) -> float:
    got = 0
    t0 = time.perf_counter()
    while got < total:
        ds = coord.read_upstream(200)
        coord.ack(ds)
        got += len(ds)
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"ingest bench stalled at {got}/{total}")
    return time.perf_counter() - t0


def ingest_procs_list(text: str) -> list[int] | None:
    """``--ingest-procs 0,2``; None (the one-line error printed) when it is not counts."""
    try:
        procs = [int(x) for x in text.split(",") if x]
    except ValueError:
        procs = []
    if not procs or min(procs) < 0:
        print(f"--ingest-procs: expected counts >= 0 like 0,2, got {text!r}", file=sys.stderr)
        return None
    return procs


def _coordinator(
    url: str, keys: str | RunKeys, secret: bytes, ranks: int, procs: int
) -> RedisCoordinatorBus:
    coord = RedisCoordinatorBus(
        connect(url), keys, fixed_keys(secret), ranks=range(ranks), ingest_procs=procs
    )
    # a reader process's start is not ingest: the timing begins once every one is up
    if coord.ingest is not None and not coord.ingest.wait_ready(120):
        raise RuntimeError("ingest bench: reader processes did not start within 120 s")
    return coord


def measure_ingest_prefilled(url: str, ranks: int, total: int, procs: int = 0) -> float:
    """Messages a second; ``procs`` > 0: read by that many reader processes."""
    keys = RunKeys(f"bench-{uuid.uuid4().hex[:8]}")
    secret = os.urandom(32)  # the seed of fixed keys
    per_rank = total // ranks
    _prefill(url, keys, ranks, per_rank, secret)
    coord = _coordinator(url, keys, secret, ranks, procs)
    elapsed = _ingest(coord, per_rank * ranks)
    coord.close()
    return per_rank * ranks / elapsed


def _publisher_proc(url: str, run: str, rank: int, secret: bytes, n: int, conn: Connection) -> None:
    bus = RedisRankBus(connect(url), run, rank, rank_keys_for(fixed_keys(secret), rank))
    conn.send("ready")
    conn.recv()
    for i in range(n):
        bus.publish(_batch(rank, i))
    bus.flush(120)
    bus.close()


def measure_ingest_concurrent(url: str, ranks: int, total: int, procs: int = 0) -> float:
    run = f"bench-{uuid.uuid4().hex[:8]}"
    secret = os.urandom(32)  # the seed of fixed keys
    per_rank = total // ranks
    coord = _coordinator(url, run, secret, ranks, procs)
    ctx = mp.get_context("fork")
    pipes, publishers = [], []
    for r in range(ranks):
        parent, child = ctx.Pipe()
        p = ctx.Process(
            target=_publisher_proc, args=(url, run, r, secret, per_rank, child), daemon=True
        )
        p.start()
        pipes.append(parent)
        publishers.append(p)
    for parent in pipes:
        parent.recv()
    for parent in pipes:
        parent.send("go")
    elapsed = _ingest(coord, per_rank * ranks)
    for p in publishers:
        p.join(30)
    coord.close()
    return per_rank * ranks / elapsed


# ---------------------------------------------------------------------- send cost


def measure_send_cost(url: str, n: int) -> tuple[float, list[int]]:
    """(burst mean ns per publish, paced per-call ns)."""
    secret = os.urandom(32)  # the seed of fixed keys
    bus = RedisRankBus(
        connect(url), f"bench-{uuid.uuid4().hex[:8]}", 0, rank_keys_for(fixed_keys(secret), 0)
    )
    msgs = [_batch(0, i) for i in range(n)]
    t0 = time.perf_counter_ns()
    for msg in msgs:
        bus.publish(msg)
    burst = (time.perf_counter_ns() - t0) / n
    bus.flush(60)
    paced = []
    for msg in msgs[: n // 4]:
        t0 = time.perf_counter_ns()
        bus.publish(msg)
        paced.append(time.perf_counter_ns() - t0)
        spin = time.perf_counter_ns() + 100_000  # a "training step" of 100 µs
        while time.perf_counter_ns() < spin:
            pass
    bus.flush(60)
    bus.close()
    return burst, paced


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flodl-bus bench bus", description=__doc__.split("\n")[0])
    ap.add_argument("--redis-url", help="use this server instead of starting one")
    ap.add_argument("--ranks", default="1,8,32", help="rank counts for dispatch latency")
    ap.add_argument("--ingest-ranks", default="8,32")
    ap.add_argument("--messages", type=int, default=2000, help="control messages per config")
    ap.add_argument("--ingest", type=int, default=100_000, help="upstream messages per config")
    ap.add_argument(
        "--ingest-procs",
        default="0",
        help="comma-separated reader process counts for ingest, each measured beside the "
        "others in the same run (0: the coordinator's own thread; e.g. 0,2)",
    )
    ap.add_argument("--publishes", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure (median taken)")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if ingest_procs_list(args.ingest_procs) is None:
        return 2

    server = None
    url = args.redis_url
    if url is None:
        server = RedisServer().start()
        url = server.url
    try:
        return _run(args, url)
    finally:
        if server is not None:
            server.cleanup()


def _run(args: Any, url: str) -> int:
    print(f"flodl-bus bench bus  (pid {os.getpid()}, {os.cpu_count()} CPUs)")
    pings = measure_ping(url, 3000)
    rtt = statistics.median(pings)
    client_rtt = statistics.median(measure_ping(url, 3000, lane=False))
    print(
        f"raw PING round trip          p50 {_us(rtt)}   p99 {_us(_pct(pings, 0.99))}   "
        f"(the reference below; through redis-py's client call: p50 {_us(client_rtt)})"
    )
    print()
    print("control dispatch latency, coordinator send -> rank read_control (1 in 4 broadcast)")
    print("  beside its floor: a bare XADD -> XREAD on the same streams, nothing checked")
    for ranks in [int(x) for x in args.ranks.split(",") if x]:
        got: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
        for _ in range(args.repeats):
            # alternated, so a shared host's drift falls on both alike
            for bare in (False, True):
                lat = measure_dispatch(url, ranks, args.messages, bare=bare)
                got[bare][0].append(_pct(lat, 0.5))
                got[bare][1].append(_pct(lat, 0.99))
        p50, p99 = (statistics.median(x) for x in got[False])
        f50, f99 = (statistics.median(x) for x in got[True])
        print(
            f"  {ranks:>3} rank(s)   p50 {_us(p50)} ({p50 / rtt:5.1f}x PING)   "
            f"p99 {_us(p99)} ({p99 / rtt:5.1f}x PING)   floor p50 {_us(f50)} "
            f"({f50 / rtt:4.1f}x PING), p99 {_us(f99)}"
        )
    print("  target (8 ranks): p50 <= 5x PING, p99 < 2000 µs")
    print()
    print("coordinator upstream ingest (read + verify + decode + ack), msgs/s")
    procs_list = ingest_procs_list(args.ingest_procs)
    assert procs_list is not None  # checked in main
    for ranks in [int(x) for x in args.ingest_ranks.split(",") if x]:
        # Interleaved: each repeat measures every K in turn, so a shared host's drift
        # falls on all of them alike.
        pre: dict[int, list[float]] = {k: [] for k in procs_list}
        conc: dict[int, list[float]] = {k: [] for k in procs_list}
        for i in range(args.repeats):
            for k in procs_list:
                pre[k].append(measure_ingest_prefilled(url, ranks, args.ingest, k))
                if i < max(1, args.repeats - 1):
                    conc[k].append(measure_ingest_concurrent(url, ranks, args.ingest // 2, k))
        base = statistics.median(pre[procs_list[0]])
        for k in procs_list:
            p = statistics.median(pre[k])
            c = statistics.median(conc[k])
            where = "in-thread" if k == 0 else f"{k} procs"
            ratio = "" if k == procs_list[0] else f"   {p / base:4.2f}x K={procs_list[0]}"
            print(
                f"  {ranks:>3} ranks {where:>9}   pre-filled {p:9.0f}/s "
                f"({1e9 / p / rtt:5.3f} PING/msg)   with live publishers {c:9.0f}/s{ratio}"
            )
    print("  target: >= 100,000 msgs/s at 8 and 32 ranks, signed (issue 27)")
    print()
    bursts, paced_all = [], []
    for _ in range(args.repeats):
        burst, paced = measure_send_cost(url, args.publishes)
        bursts.append(burst)
        paced_all += paced
    burst = statistics.median(bursts)
    print("publish() cost on the sending thread")
    print(f"  burst of {args.publishes}   mean {_us(burst)} ({burst / rtt:5.3f}x PING)")
    print(
        f"  paced (1 per 100 µs step)   p50 {_us(_pct(paced_all, 0.5))}   "
        f"p99 {_us(_pct(paced_all, 0.99))}"
    )
    print("  target: <= 20 µs per message")
    return 0
