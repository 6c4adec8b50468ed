"""``flodl-bus bench record``: what recording costs the dispatching thread, and how fast
a record replays.

Recording cost is measured as the difference between a recorded and a plain core call,
each on the same message sequence and core state, median over ``--repeats`` runs:

* rank: a dispatch observed by ``worker.recording.CoreRecorder`` (state before/after,
  the record line) vs ``WorkerControl.dispatch``; and a recorded training step vs a
  plain ``step_done``;
* coordinator: ``handle`` + one ``state_summary`` (the previous call's "after" is this
  call's "before") + ``DispatchRecorder.dispatch`` (what the coordinator runtime does per
  entry) vs ``handle`` alone.

Each figure is printed beside the core's own cost (the reference, same run) and its
target. Replay speed is core calls per second of ``replay`` on the records written here
(fakeredis transport included), or on ``--run-dir`` when given. A real digits run
(``flodl-bus up``) gives the bytes on disk per recorded core call of compressed records
and the replay's peak memory; replays of N and 4N synthetic dispatches show that memory
does not grow with the record.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Out, Send
from flodl_bus.params.port import SyncResult
from flodl_bus.protocol.messages import (
    AveragedParams,
    Batch,
    ControlMsg,
    EpochPlan,
    EvalBroadcast,
    ExtendPartition,
    Heartbeat,
    LrUpdate,
    MetricsMsg,
    SetGlobalStep,
    StartEpoch,
    UpstreamMsg,
)
from flodl_bus.record import chain, states
from flodl_bus.record.dispatch import DispatchRecorder
from flodl_bus.replay import load_run, replay
from flodl_bus.worker.control import WorkerControl
from flodl_bus.worker.inbox import Inbox
from flodl_bus.worker.recording import RankRecording

#: The targets of issue 16, printed beside the figures.
TARGET_RECORD_US = 15.0
TARGET_BYTES = 100.0
TARGET_REPLAY_RATE = 20_000
TARGET_PEAK_MB = 200.0


class _Params:
    """A param port with constant answers: the bench times the recorder, not torch."""

    def sync_now(self, steps_since_avg: int) -> SyncResult:
        return SyncResult(0.0, 1.0, 1.0)

    def snapshot(self, steps_since_avg: int) -> None:
        return None

    def load_averaged(self, avg: AveragedParams) -> None:
        return None

    def param_norm(self) -> float:
        return 1.0

    def abort(self) -> None:
        return None

    def new_session(self, uid: bytes, new_rank: int, new_world_size: int) -> None:
        return None


def _messages(n: int) -> list[ControlMsg]:
    cycle: list[ControlMsg] = [
        SetGlobalStep(7),
        StartEpoch(EpochPlan(0, 0, 640)),
        ExtendPartition(640, 64),
        EvalBroadcast(0, 0.5),
    ]
    return [cycle[k % len(cycle)] for k in range(n)]


def _median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1000.0


def _time_calls(fn: Callable[[ControlMsg], object], msgs: Sequence[ControlMsg]) -> list[int]:
    out = []
    clock = time.perf_counter_ns
    for msg in msgs:
        t0 = clock()
        fn(msg)
        out.append(clock() - t0)
    return out


def bench_rank(n: int, run_dir: Path) -> tuple[float, float, float, float]:
    """(plain dispatch, recorded dispatch, plain step, recorded step) medians in us."""
    msgs = _messages(n)
    stream = "flodl:{bench}:ctl:0"
    inbox = Inbox()
    plain = WorkerControl(
        rank=0, params=_Params(), batch_size=32, pick_space=4096, clock=time.perf_counter
    )
    recording = RankRecording(run_dir, 0)
    recording.header(run="bench", world_size=1, batch_size=32, pick_space=4096, splits=1)
    recorded = WorkerControl(
        rank=0,
        params=recording.params(_Params()),
        batch_size=32,
        pick_space=4096,
        clock=recording.clock(time.perf_counter),
    )
    observer = recording.observer(recorded, inbox)
    # The recorded side reads its messages through an inbox with origins, as in a run.
    entries = [(stream, f"1-{k}", m) for k, m in enumerate(msgs)]
    recording.recorder.read(now=0.0, entries=entries)
    inbox.put_many(list(msgs), [(s, e) for s, e, _ in entries])

    def plain_call(msg: ControlMsg) -> object:
        out = plain.dispatch(msg)
        plain.take_pending_plan()
        return out

    plain_us = _time_calls(plain_call, msgs)
    rec_samples: list[int] = []
    clock = time.perf_counter_ns
    for _ in msgs:
        msg = inbox.poll()
        assert msg is not None
        t0 = clock()
        # What the loop does around a dispatch when it records (``worker.loop``).
        observer.before()
        out = recorded.dispatch(msg)
        observer.dispatched(msg, out, None)
        rec_samples.append(clock() - t0)
        plan = recorded.take_pending_plan()
        if plan is not None:
            observer.before()
            recorded.begin_plan(plan)
            observer.planned(plan)
    steps = n
    plain_steps = []
    rec_steps = []
    for _ in range(steps):
        t0 = clock()
        plain.step_done(0.5, 1.0, 0.1, 0.01)
        t1 = clock()
        observer.before()
        stepped = recorded.step_done(0.5, 1.0, 0.1, 0.01)
        observer.stepped((0.5, 1.0, 0.1, 0.01), stepped)
        t2 = clock()
        plain_steps.append(t1 - t0)
        rec_steps.append(t2 - t1)
    recording.event("end", exit_code=0)
    recording.close()
    return (
        _median_us(plain_us),
        _median_us(rec_samples),
        _median_us(plain_steps),
        _median_us(rec_steps),
    )


def bench_coordinator(n: int, run_dir: Path) -> tuple[float, float, float]:
    """(plain handle, recorded handle, handle + state summary) medians in us, on
    Batch/LrUpdate/Heartbeat."""
    ws = 4
    cfg = CoordinatorConfig(
        mode="cpu-cadence", world_size=ws, total_samples=1 << 20, batch_size=1, num_epochs=1
    )
    plain, recorded = Coordinator(cfg), Coordinator(cfg)
    rec = DispatchRecorder(run_dir, "coordinator")
    rec.header(run="bench", config=dataclasses.asdict(cfg))
    now = 1000.0
    plain.start(now)
    before = recorded.state_summary()
    out = recorded.start(now)
    last = recorded.state_summary()
    rec.core_call("start", now=now, before=before, after=last, out=out)
    step = [0] * ws
    plain_ns: list[int] = []
    rec_ns: list[int] = []
    summary_ns: list[int] = []  # handle + the core's state summary (the record's "after")
    clock = time.perf_counter_ns
    for k in range(n):
        r = k % ws
        step[r] += 1
        kind = (k // ws) % 3
        msg: object
        if kind == 0:
            msg = Batch(rank=r, batch_ms=1.0 + r, data_ms=0.1, step_count=step[r], batch_loss=0.5)
        elif kind == 1:
            msg = LrUpdate(rank=r, lr=0.01)
        else:
            msg = Heartbeat(rank=r, step_count=k)
        now += 0.0005
        t0 = clock()
        plain.handle(r, msg, now)
        t1 = clock()
        outs = recorded.handle(r, msg, now)
        after = recorded.state_summary()
        ts = clock()
        rec.dispatch(
            stream=f"flodl:{{bench}}:up:{r}",
            entry_id=f"{1 + k // ws}-{k % ws}",
            msg=msg,
            now=now,
            before=last,
            after=after,
            out=outs,
            sender=r,
        )
        last = after
        t2 = clock()
        plain_ns.append(t1 - t0)
        rec_ns.append(t2 - t1)
        summary_ns.append(ts - t1)
    rec.end(dispatches=n)
    rec.close()
    return _median_us(plain_ns), _median_us(rec_ns), _median_us(summary_ns)


def _summary_run(ranks: int, incremental: bool) -> tuple[list[int], list[int]]:
    """(ns of each message's state summary, ns of its delta) over a ``ranks``-rank
    nccl-cadence run driven as ``CoordinatorLoop`` drives it: every rank trains its plans
    batch by batch (a ``Batch`` and an ``LrUpdate`` each, a ``MetricsMsg`` at a plan's
    end), rounds acked by the next ``Batch``, one tick per pass over the ranks. With
    ``incremental`` False, each summary reads every list whole and the delta scans them
    (what both cost before the state was tracked): the reference."""
    cfg = CoordinatorConfig(
        mode="nccl-cadence", world_size=ranks, total_samples=ranks * 24, batch_size=1,
        num_epochs=2,
    )  # fmt: skip
    core = Coordinator(cfg)
    now = 100.0
    state = core.state_summary()
    left = [0] * ranks
    step = [0] * ranks
    summary_ns: list[int] = []
    delta_ns: list[int] = []
    clock = time.perf_counter_ns

    def call(outs: list[Out], hint: int | None) -> None:
        nonlocal state
        t0 = clock()
        after = core.state_summary(state) if incremental else core.summarizer.rebuild(state)
        t1 = clock()
        if incremental:
            states.delta(state, after, hint, core.summary_changes(after, state))
        else:
            states.delta(state, after, hint)
        t2 = clock()
        if hint is not None:
            summary_ns.append(t1 - t0)
            delta_ns.append(t2 - t1)
        state = after
        for o in outs:
            if isinstance(o, Send) and isinstance(o.msg, StartEpoch):
                left[o.rank] = o.msg.plan.partition_size

    call(core.start(now), None)
    while not core.finished and len(summary_ns) < 200_000:
        for r in range(ranks):
            msgs: list[UpstreamMsg] = []
            if left[r]:
                left[r] -= 1
                step[r] += 1
                msgs = [Batch(r, 5.0 + r % 3, 0.1, step[r], 0.5), LrUpdate(r, 0.1)]
                if not left[r]:
                    epoch = core.dispatch.rank_epochs()[r]
                    msgs.append(MetricsMsg(r, epoch, 0.5, 1, 1.0, 1, 1.0, 1.0, 0.0))
            for msg in msgs:
                now += 0.0001
                call(core.handle(r, msg, now), r)
        now += 0.0001
        call(core.tick(now), None)
    return summary_ns, delta_ns


def bench_summary(ranks: int) -> list[tuple[float, float]]:
    """(mean, median) µs per message at ``ranks`` ranks of: the state summary, its delta,
    the summary read whole, the delta scanned (the mean counts a round's messages, the
    slow ones; the median is a typical ``Batch``)."""
    ours = _summary_run(ranks, incremental=True)
    ref = _summary_run(ranks, incremental=False)
    return [(statistics.fmean(ns) / 1000.0, _median_us(ns)) for ns in (*ours, *ref)]


def replay_rate(run_dir: Path, transport: str = "fakeredis") -> list[tuple[str, int, float]]:
    out = []
    for key, rec in load_run(run_dir).items():
        t0 = time.perf_counter()
        result = replay(rec, keep_actual=False, transport=transport)
        dt = time.perf_counter() - t0
        if not result.identical:
            raise SystemExit(f"bench record: {key} did not replay identically: {result.summary()}")
        out.append((key, result.replayed, result.replayed / dt))
    return out


def record_size(run_dir: Path) -> tuple[int, int]:
    """(bytes on disk of the run's process records, core calls recorded in them)."""
    size = events = 0
    for rec in load_run(run_dir).values():
        assert rec.path is not None
        size += chain.size_on_disk(rec.path)
        events += len(rec.core_events())
    return size, events


def digits_run(tmp: Path, workers: int, epochs: int) -> Path | None:
    """A real digits run (``flodl-bus up``: Redis, a coordinator, ``workers`` ranks)."""
    run_dir = tmp / "digits"
    cmd = [
        sys.executable, "-m", "flodl_bus.cli", "up", "--workers", str(workers),
        "--epochs", str(epochs), "--run", "bench-record", "--run-dir", str(run_dir),
        "--no-progress", "--no-plot", "--log-level", "warning",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        print(f"  (digits run failed, exit {done.returncode}: {done.stdout[-400:]})")
        return None
    return run_dir


def replay_peak_rss(run_dir: Path, *args: str) -> tuple[int, float, str]:
    """(exit status, peak resident MB, stderr) of ``flodl-bus replay run_dir ARGS`` in its
    own process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "flodl_bus.cli", "replay", str(run_dir), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    errors = proc.stderr.read()
    proc.stderr.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 1024.0, errors.decode(errors="replace")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flodl-bus bench record", description=__doc__)
    p.add_argument("--dispatches", type=int, default=4000, help="per run (default 4000)")
    p.add_argument("--repeats", type=int, default=5, help="runs; medians of medians (default 5)")
    p.add_argument("--run-dir", help="also measure replay speed on this recorded run")
    p.add_argument(
        "--digits-epochs",
        type=int,
        default=2,
        help="epochs of the real digits run whose record is measured (0: skip it)",
    )
    p.add_argument(
        "--memory",
        type=int,
        default=5000,
        help="peak memory of replays of N and 4N recorded dispatches (0: skip)",
    )
    p.add_argument(
        "--summary-ranks",
        default="64,1024",
        help="world sizes of the per-message state summary and delta figures ('': skip)",
    )
    args = p.parse_args(argv)

    from flodl_bus.record.log import configure_console

    configure_console("warning")
    rank_rows: list[tuple[float, float, float, float]] = []
    coord_rows: list[tuple[float, float, float]] = []
    rates: list[list[tuple[str, int, float]]] = []
    direct: list[list[tuple[str, int, float]]] = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            rank_rows.append(bench_rank(args.dispatches, Path(tmp)))
            coord_rows.append(bench_coordinator(args.dispatches, Path(tmp)))
            rates.append(replay_rate(Path(tmp)))
            direct.append(replay_rate(Path(tmp), "direct"))

    def med(rows: Sequence[Sequence[float]], k: int) -> float:
        return statistics.median(r[k] for r in rows)

    pd, rd, ps, rs = (med(rank_rows, k) for k in range(4))
    ph, rh, sh = med(coord_rows, 0), med(coord_rows, 1), med(coord_rows, 2)
    print(f"recording cost on the dispatching thread (median of {args.repeats} runs)")
    print(f"  rank dispatch:        {rd - pd:6.2f} us   (core dispatch itself {pd:5.2f} us)")
    print(f"  rank training step:   {rs - ps:6.2f} us   (core step_done itself {ps:5.2f} us)")
    print(f"  coordinator dispatch: {rh - ph:6.2f} us   (core handle itself {ph:5.2f} us)")
    print(
        f"    of which the core's state summary {sh - ph:5.2f} us, "
        f"the record line {rh - sh:5.2f} us"
    )
    print(f"  target: <= {TARGET_RECORD_US:.0f} us per dispatch")
    summary_ranks = [int(n) for n in args.summary_ranks.split(",") if n.strip()]
    if summary_ranks:
        print(
            f"coordinator state summary + its delta per message, nccl-cadence, mean / median "
            f"(median of {args.repeats} runs), beside the same read whole (every list "
            "rebuilt and compared, as before tracking) and the budget of a whole message "
            "at 50 ms steps (step / 2N)"
        )
    for n in summary_ranks:
        rows = [bench_summary(n) for _ in range(args.repeats)]
        (sm, s50), (dm, d50), (wsm, ws50), (wdm, wd50) = (
            (statistics.median(r[k][0] for r in rows), statistics.median(r[k][1] for r in rows))
            for k in range(4)
        )
        print(
            f"  {n:5d} ranks: {sm:6.2f} + {dm:5.2f} = {sm + dm:6.2f} us / "
            f"{s50:6.2f} + {d50:5.2f} us   (read whole {wsm:6.2f} + {wdm:5.2f} = "
            f"{wsm + wdm:6.2f} us / {ws50:6.2f} + {wd50:5.2f} us; budget {50_000 / (2 * n):.1f} us)"
        )
    print("replay speed, one core (fresh core, verify + compare), by transport")
    for k, (key, n, _rate) in enumerate(rates[0]):
        rate = statistics.median(r[k][2] for r in rates)
        fast = statistics.median(r[k][2] for r in direct)
        print(
            f"  {key:<12} fakeredis {rate:8.0f} dispatches/s, direct {fast:8.0f} dispatches/s"
            f"   ({n} per replay)"
        )
    print(f"  target: >= {TARGET_REPLAY_RATE:,} dispatches/s")
    if args.digits_epochs > 0:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = digits_run(Path(tmp), workers=2, epochs=args.digits_epochs)
            if run_dir is not None:
                size, events = record_size(run_dir)
                print(
                    f"record size over a digits run (2 ranks, {args.digits_epochs} epochs, "
                    f"zstd): {size / max(events, 1):6.1f} bytes/dispatch on disk "
                    f"({size} bytes, {events} recorded core calls)"
                )
                print(f"  target: <= {TARGET_BYTES:.0f} bytes/dispatch")
                for key, n, rate in replay_rate(run_dir):
                    print(f"  replay {key:<12} {rate:10.0f} dispatches/s   ({n} dispatches)")
                rc, peak, errors = replay_peak_rss(run_dir)
                lines = len(errors.splitlines())
                print(
                    f"  flodl-bus replay: exit {rc}, peak {peak:.0f} MB resident, "
                    f"{lines} line(s) on stderr (healthy: 0)"
                )
    if args.memory > 0:
        print("replay memory (flodl-bus replay in its own process; bounded: flat in N)")
        for n in (args.memory, 4 * args.memory):
            with tempfile.TemporaryDirectory() as tmp:
                bench_coordinator(n, Path(tmp))
                # the synthetic run is the coordinator's record alone
                rc, peak, errors = replay_peak_rss(Path(tmp), "--role", "coordinator")
                print(
                    f"  {n:8d} recorded dispatches: peak {peak:6.0f} MB resident (exit {rc}, "
                    f"{len(errors.splitlines())} line(s) on stderr)"
                )
        print(f"  target: <= {TARGET_PEAK_MB:.0f} MB whatever the length")
    if args.run_dir:
        for key, n, rate in replay_rate(Path(args.run_dir)):
            print(f"  {args.run_dir} {key}: {rate:10.0f} dispatches/s   ({n} dispatches)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
