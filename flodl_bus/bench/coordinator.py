"""``flodl-bus bench coordinator``: the core's cost per upstream message and per reduce.

Drives ``Coordinator`` directly with synthetic ranks (no Redis, no threads): every rank
trains the chunk it was given (one ``Batch`` per step, then its ``MetricsMsg``), the
gate fires, CPU ranks answer ``RequestParams`` with a bridge ``SyncAck`` and NCCL ranks
ack ``SyncNow``. Ranks run at four different speeds so ElChe calibrates real counts.

Reference measured in the same run: the wire codec's encode+decode of one ``Batch``
(what the runtime pays per message anyway), so the core's cost reads as a ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Broadcast, Out, Send
from flodl_bus.protocol import messages as m
from flodl_bus.protocol import wire

#: turns in a row without a reduce before the run is declared stuck
IDLE_TURNS = 1000


@dataclass(frozen=True, slots=True)
class Sample:
    msg_us: float
    batch_us: float
    reduce_us: float
    reduces: int
    messages: int


def _plans(outs: list[Out], plans: dict[int, list[int]]) -> None:
    """Track each rank's current chunk as [epoch, batches left, size]."""
    for o in outs:
        if isinstance(o, Send):
            plan = None
            if isinstance(o.msg, m.StartEpoch):
                plan = o.msg.plan
            elif isinstance(o.msg, m.WireUpdate):
                plan = o.msg.next_plan
            if plan is not None:
                plans[o.rank] = [plan.epoch, plan.partition_size, plan.partition_size]


def run_once(mode: str, ranks: int, reduces: int, dead: float = 0.0) -> Sample:
    """One run of ``reduces`` reduces. ``dead``: the share of the ranks (the highest)
    declared dead after the first reduce, the figures then taken from there on (a dead
    rank's count is kept and its speed forgotten: what the survivors' calls walk past)."""
    cfg = CoordinatorConfig(
        mode=mode,
        world_size=ranks,
        total_samples=ranks * 64 * (reduces + 4),
        batch_size=1,
        num_epochs=1,
    )
    core = Coordinator(cfg)
    sync = cfg.mode.endswith("sync")
    cpu = cfg.mode.startswith("cpu")
    plans: dict[int, list[int]] = {}
    _plans(core.start(0.0), plans)
    step = [0] * ranks
    now = 0.0
    handle_ns = batch_ns = reduce_ns = 0
    n_msgs = n_batches = 0
    clock = time.perf_counter_ns
    idle = first = 0
    to_kill = int(ranks * dead)
    while core.version < reduces:
        if to_kill and core.version >= 1:
            for r in range(ranks - to_kill, ranks):
                _plans(core.declare_dead(r, now), plans)
                plans.pop(r, None)
            to_kill = 0
            handle_ns = batch_ns = reduce_ns = 0
            n_msgs = n_batches = 0
            first = core.version
        now += 0.01
        # Every rank trains up to its window (one step under sync), in rank order.
        for r in range(ranks):
            cur = plans.get(r)
            if cur is None:
                continue
            take = min(cur[1], 1 if sync else core.elche.counts[r])
            ms = 1.0 + (r % 4)
            for _ in range(take):
                step[r] += 1
                msg = m.Batch(r, ms, 0.1, step[r], 0.5)
                t0 = clock()
                core.handle(r, msg, now)
                dt = clock() - t0
                batch_ns += dt
                handle_ns += dt
            n_batches += take
            n_msgs += take
            cur[1] -= take
            if cur[1] == 0:
                del plans[r]
                n = cur[2]
                done = m.MetricsMsg(r, cur[0], 0.5, n, 1.0, n, 1.0, 1.0, 0.0)
                t0 = clock()
                outs = core.handle(r, done, now)
                handle_ns += clock() - t0
                n_msgs += 1
                _plans(outs, plans)
        t0 = clock()
        outs = core.tick(now)
        reduce_ns += clock() - t0
        _plans(outs, plans)
        fired = any(
            isinstance(o, Broadcast) and isinstance(o.msg, (m.RequestParams, m.SyncNow))
            for o in outs
        )
        if not fired:
            # A probe chunk, a bridge or an epoch's tail can leave a window short of its
            # count for a turn: the ranks train on what they hold.
            idle += 1
            if idle > IDLE_TURNS:
                gate = core.state_summary()["gate"]
                raise RuntimeError(f"bench: no reduce in {IDLE_TURNS} turns: {gate}")
            continue
        idle = 0
        for r in range(ranks):
            if not core.alive(r):
                continue
            step[r] += 0 if cpu else 1
            t0 = clock()
            core.handle(r, m.SyncAck(r, step[r], 0.01, 1.0, 1.0), now)
            handle_ns += clock() - t0
            n_msgs += 1
        if cpu:
            t0 = clock()
            outs = core.tick(now + 0.001)
            reduce_ns += clock() - t0
            _plans(outs, plans)
    return Sample(
        msg_us=handle_ns / 1000 / max(n_msgs, 1),
        batch_us=batch_ns / 1000 / max(n_batches, 1),
        reduce_us=reduce_ns / 1000 / max(core.version - first, 1),
        reduces=core.version - first,
        messages=n_msgs,
    )


def codec_us(samples: int = 20000) -> float:
    msg = m.Batch(3, 12.5, 0.4, 123456, 0.731, None, None)
    t0 = time.perf_counter_ns()
    for _ in range(samples):
        wire.decode(wire.encode(msg))
    return (time.perf_counter_ns() - t0) / 1000 / samples


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flodl-bus bench coordinator", description=__doc__)
    p.add_argument("--ranks", default="8,64,256", help="comma-separated world sizes")
    p.add_argument("--modes", default="nccl-cadence,cpu-cadence,cpu-sync")
    p.add_argument("--reduces", type=int, default=20, help="reduces per run")
    p.add_argument("--repeats", type=int, default=5, help="runs per point (median)")
    p.add_argument(
        "--dead",
        type=float,
        default=0.0,
        help="share of the ranks declared dead after the first reduce; the figures are "
        "taken from there on (default 0)",
    )
    args = p.parse_args(argv)
    if not 0.0 <= args.dead < 1.0:
        p.error(f"--dead {args.dead}: use a share of the ranks from 0 up to (not) 1")
    sizes = [int(x) for x in args.ranks.split(",")]
    ref = statistics.median(codec_us() for _ in range(args.repeats))
    print(f"reference: wire encode+decode of one Batch = {ref:.2f} us (median of {args.repeats})")
    if args.dead:
        print(f"{args.dead:.0%} of the ranks declared dead after the first reduce")
    header = f"{'mode':<13}{'ranks':>6}{'us/msg':>9}{'us/Batch':>10}{'x codec':>9}"
    header += f"{'us/reduce':>11}{'us/reduce/rank':>16}"
    print(header)
    for mode in args.modes.split(","):
        base = per_rank = 0.0
        for ws in sizes:
            runs = [run_once(mode, ws, args.reduces, args.dead) for _ in range(args.repeats)]
            msg_us = statistics.median(s.msg_us for s in runs)
            batch_us = statistics.median(s.batch_us for s in runs)
            red_us = statistics.median(s.reduce_us for s in runs)
            per_rank = red_us / ws
            base = base or per_rank
            print(
                f"{mode:<13}{ws:>6}{msg_us:>9.2f}{batch_us:>10.2f}{msg_us / ref:>9.2f}"
                f"{red_us:>11.1f}{per_rank:>16.2f}"
            )
        print(
            f"{'':<13}per-rank reduce cost at {sizes[-1]} vs {sizes[0]} ranks: "
            f"x{per_rank / base:.2f} (1.00 = linear growth)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
