"""``flodl-bus bench kill``: kill one rank mid-epoch and time the survivors' recovery.

Starts Redis (embedded unless ``--redis-url``), a coordinator and ``--workers`` ranks as
separate processes (one GPU each when CUDA is there, gloo on the CPU otherwise), lets
``--after`` epochs finish, then ``SIGKILL``s ``--victim`` in the middle of the next one.
The figures are read from the run's own streams: a stream entry's id is its writer's wall
clock in milliseconds, and every process runs on this host, so the ids and the kill
instant are on one clock. It prints, each beside the heartbeat timeout (the detection
floor: a silent rank is only declared dead after it):

- kill -> the coordinator's ``DeclareDead``;
- kill -> the survivors' new group announced (``NewNcclSession``);
- kill -> the first ``SyncAck`` of a survivor after it: the first collective completed
  on the new group (the recovery's end);

then the exit codes, and what the run left, read off its files:

- whether every sample of every epoch was trained exactly once (``replay.coverage``:
  ``metrics.csv`` and the coordinator's record; in an epoch a rank died in, by what the
  coordinator heard it train);
- each rank's share of every epoch's samples, before and after the death (with
  ``--slow-rank R --slow-factor F`` one rank is made F times slower, as in ``bench
  train``: the shares ElChe gave it before, and the survivors' after);
- the final eval, beside an undisturbed run of the same world first (``--reference``);
- whether the records replay identically (``flodl-bus replay --allow-incomplete``: the
  killed rank's record has no end line; on the CPU, over fakeredis, whatever the run's
  device was);
- every TCP socket the coordinator and the ranks held just before the kill
  (``bench.sockets``): a world on one host stays on loopback.

It exits 0 when the run ended as specified, every survivor exited 0, and each check it
made held. With two ranks the single survivor cannot form an NCCL group: the
coordinator stops the run with a save (flodl's ``SingleSurvivor``), and the figure is
kill -> the survivor's orderly exit (no coverage or eval: the run stopped).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import redis

from flodl_bus.bench import sockets
from flodl_bus.bus.entries import F_TYPE
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer
from flodl_bus.params.hosts import pin_one_host
from flodl_bus.replay import coverage

_FIELD = re.compile(r"(\w+)=(\S+)")


class Entry(NamedTuple):
    """One stream entry as this bench needs it: when Redis took it, where, and its type."""

    at: float  # wall-clock seconds: the writer's clock, in the entry id's milliseconds
    stream: str
    type: str


class _Watch(threading.Thread):
    """Copies every entry of the run's control and upstream streams as it lands.

    The coordinator trims each stream to what its readers consumed (a few seconds of
    entries), so the entries must be read while the run goes, not after it."""

    def __init__(self, url: str, keys: RunKeys, workers: int) -> None:
        super().__init__(name="bench-kill-watch", daemon=True)
        self._client: Any = redis.Redis.from_url(url)
        names = [keys.ctl_all] + [keys.ctl(r) for r in range(workers)]
        names += [keys.up(r) for r in range(workers)]
        self._last = dict.fromkeys(names, b"-")
        self._keys = keys
        self._done = threading.Event()
        self.seen: list[Entry] = []

    def run(self) -> None:
        while not self._done.wait(0.02):
            self.poll()

    def poll(self) -> None:
        for name, last in self._last.items():
            start = last if last == b"-" else b"(" + last
            for eid, fields in self._client.xrange(name, min=start):
                ms = int(eid.split(b"-")[0])
                self.seen.append(Entry(ms / 1000, self._keys.short(name), fields[F_TYPE].decode()))
                self._last[name] = eid

    def stop(self) -> list[Entry]:
        """Stop, take what is left, and return every entry seen, oldest first."""
        self._done.set()
        self.join()
        self.poll()
        self._client.close()
        return sorted(self.seen)


def _first(
    entries: Sequence[Entry], type_: str, after: float, streams: Sequence[str]
) -> float | None:
    """When the first entry of ``type_`` on one of ``streams`` came at or after ``after``."""
    return next(
        (e.at for e in entries if e.type == type_ and e.stream in streams and e.at >= after), None
    )


def _events(log: Path, event: str) -> list[dict[str, str]]:
    """The key=value fields of every console log line of ``event``."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if f" {event} " in f"{line} ":
            out.append(dict(_FIELD.findall(line)))
    return out


def _epochs_done(run_dir: Path) -> int:
    return len(coverage.metrics_rows(run_dir))


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with RedisServer() as server:
        yield server.url


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flodl-bus bench kill", description=__doc__)
    p.add_argument("--job", default="flodl_bus.examples.digits:job")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--mode", default="nccl-cadence")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--after", type=int, default=1, help="epochs finished before the kill")
    p.add_argument("--victim", type=int, help="rank to kill (default: the last)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--slow-rank", type=int, help="make this rank slower (bench.slow)")
    p.add_argument("--slow-factor", type=float, default=2.0, help="how much slower")
    p.add_argument(
        "--reference",
        action="store_true",
        help="first train the same world undisturbed, for its final eval",
    )
    p.add_argument("--no-replay", action="store_true", help="skip replaying the records afterwards")
    p.add_argument("--redis-url")
    p.add_argument("--run-dir", help="keep the run's records and logs here")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for each run")
    return p


class _Run(NamedTuple):
    """A run's processes, where it writes, and the wall clock's deadline."""

    run_dir: Path
    procs: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]
    deadline: float


def _launch(
    args: argparse.Namespace, url: str, root: Path, prefix: str, env: dict[str, str], gpus: int
) -> _Run:
    """A coordinator and ``args.workers`` ranks of a fresh run under ``root``."""
    run = f"{prefix}-{uuid.uuid4().hex[:8]}"
    run_dir = root / run
    run_dir.mkdir(parents=True, exist_ok=True)
    job = "flodl_bus.bench.slow:job" if args.slow_rank is not None else args.job
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}

    def spawn(name: str, *cli: str) -> None:
        logs[name] = run_dir / f"{name}.log"
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "flodl_bus.cli", *cli],
            env=env,
            stdout=logs[name].open("wb"),
            stderr=subprocess.STDOUT,
        )

    common = (
        "--run", run, "--redis-url", url, "--job", job, "--run-dir", str(run_dir),
        "--save-path", str(run_dir / "ckpt"),
    )  # fmt: skip
    spawn(
        "coordinator", "coordinator", *common, "--mode", args.mode,
        "--world-size", str(args.workers), "--epochs", str(args.epochs),
        "--heartbeat-timeout", str(args.heartbeat_timeout),
    )  # fmt: skip
    for r in range(args.workers):
        device = ["--device", f"cuda:{r}"] if gpus else ["--device", "cpu"]
        spawn(
            f"rank{r}", "worker", *common, "--rank", str(r),
            "--world-size", str(args.workers), "--epochs", str(args.epochs), *device,
        )  # fmt: skip
    return _Run(run_dir, procs, logs, time.monotonic() + args.timeout)


def _wait_all(run: _Run) -> dict[str, int]:
    return {
        name: q.wait(timeout=max(1.0, run.deadline - time.monotonic()))
        for name, q in run.procs.items()
    }


def _kill_all(run: _Run) -> None:
    for q in run.procs.values():
        if q.poll() is None:
            q.kill()


def _final_metric(run_dir: Path) -> float | None:
    rows = [r for r in coverage.metrics_rows(run_dir) if r.get("eval_metric")]
    return float(rows[-1]["eval_metric"]) if rows else None


def _sockets(run: _Run) -> tuple[int, list[str]] | None:
    """(TCP endpoints the run's processes hold, those off loopback), or None where
    ``/proc`` cannot say."""
    held: list[str] = []
    count = 0
    try:
        for name, q in run.procs.items():
            found = sockets.tcp_endpoints(q.pid)
            count += len(found)
            held += [f"{name}: {e}" for e in sockets.off_loopback(found)]
    except OSError:
        return None
    return count, held


def _replay(run_dir: Path) -> tuple[int, list[str]]:
    """``flodl-bus replay``'s exit status and report (a line per process) on the run."""
    done = subprocess.run(
        [sys.executable, "-m", "flodl_bus.cli", "replay", str(run_dir), "--allow-incomplete"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = done.stdout.strip().splitlines() or done.stderr.strip().splitlines()[-1:]
    return done.returncode, report


def _print_shares(run_dir: Path, workers: int, victim: int) -> None:
    """Each epoch's shares, marked by whether the victim was sent part of it."""
    with_victim = {
        e for e, ranks in coverage.sent_plans(coverage.coordinator_records(run_dir)).items()
        if victim in ranks
    }  # fmt: skip
    print(
        f"batch shares per epoch (metrics.csv: samples each rank trained, ranks 0..{workers - 1}):"
    )
    for row in coverage.metrics_rows(run_dir):
        e = int(row["epoch"])
        what = f"rank {victim} sent work" if e in with_victim else "survivors only"
        shares = " / ".join(f"{s:.3f}" for s in coverage.shares(row, workers))
        print(f"  epoch {e:>3}  {shares}  ({what})")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.workers < 2:
        raise SystemExit("--workers must be at least 2: one dies, at least one survives")
    victim = args.workers - 1 if args.victim is None else args.victim
    if not 0 <= victim < args.workers:
        raise SystemExit(f"--victim {victim} is outside 0..{args.workers - 1}")
    if args.slow_rank is not None and not 0 <= args.slow_rank < args.workers:
        raise SystemExit(f"--slow-rank {args.slow_rank} is outside 0..{args.workers - 1}")

    import torch

    gpus = torch.cuda.device_count()
    if gpus and gpus < args.workers:
        raise SystemExit(f"{args.workers} workers need {args.workers} GPUs; this host has {gpus}")
    root = Path(args.run_dir or tempfile.mkdtemp(prefix="flodl-bench-kill-"))
    env = dict(os.environ)
    env.pop("FLODL_RUN_SECRET", None)
    pin_one_host(env)  # every process is on this host: its groups stay on loopback
    if not gpus:
        env.setdefault("OMP_NUM_THREADS", "1")
    if args.slow_rank is not None:
        env.update(
            FLODL_BENCH_JOB=args.job,
            FLODL_SLOW_RANK=str(args.slow_rank),
            FLODL_SLOW_FACTOR=repr(args.slow_factor),
        )
    where = f"{gpus} GPU(s)" if gpus else "CPU (gloo)"
    slowed = (
        "" if args.slow_rank is None else f", rank {args.slow_rank} {args.slow_factor:g}x slower"
    )
    print(
        f"flodl-bus bench kill: {args.job}, {args.workers} ranks, {args.mode}, on {where}"
        f"{slowed}; kill rank {victim} during epoch {args.after}",
        flush=True,
    )

    reference: float | None = None
    with _redis(args.redis_url) as url:
        if args.reference:
            ref = _launch(args, url, root, "undisturbed", env, gpus)
            try:
                ref_codes = _wait_all(ref)
            except subprocess.TimeoutExpired:
                _kill_all(ref)
                print(f"bench kill: the undisturbed run timed out; logs in {ref.run_dir}",
                      file=sys.stderr)  # fmt: skip
                return 1
            if any(ref_codes.values()):
                print(f"bench kill: the undisturbed run failed (exit codes {ref_codes}); "
                      f"logs in {ref.run_dir}", file=sys.stderr)  # fmt: skip
                return 1
            reference = _final_metric(ref.run_dir)
            print(f"undisturbed run: exit codes {list(ref_codes.values())}, final eval "
                  f"{reference}; logs in {ref.run_dir}", flush=True)  # fmt: skip
        run = _launch(args, url, root, "kill", env, gpus)
        watch = _Watch(url, RunKeys(run.run_dir.name), args.workers)
        watch.start()
        try:
            while _epochs_done(run.run_dir) < args.after:
                if time.monotonic() > run.deadline or any(
                    q.poll() is not None for q in run.procs.values()
                ):
                    raise RuntimeError(f"the run ended or stalled before epoch {args.after}")
                time.sleep(0.05)
            time.sleep(0.2)  # into the next epoch, not at its boundary
            held = _sockets(run)
            run.procs[f"rank{victim}"].send_signal(signal.SIGKILL)
            killed_at = time.time()
            codes = _wait_all(run)
            ended_at = time.time()
            entries = watch.stop()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            _kill_all(run)
            watch.stop()
            print(f"bench kill failed: {exc}; logs in {run.run_dir}", file=sys.stderr)
            return 1

    run_dir = run.run_dir
    survivors = [r for r in range(args.workers) if r != victim]
    dead = _first(entries, "DeclareDead", killed_at, ["ctl:all", *(f"ctl:{r}" for r in survivors)])
    formed = _first(entries, "NewNcclSession", killed_at, [f"ctl:{r}" for r in survivors])
    first = None
    if formed is not None:
        first = _first(entries, "SyncAck", formed, [f"up:{r}" for r in survivors])
    hb = args.heartbeat_timeout

    def line(what: str, at: float | None) -> None:
        if at is None:
            print(f"  {what:<44} -")
        else:
            s = at - killed_at
            print(f"  {what:<44} {s:7.2f} s  ({s / hb:4.2f}x heartbeat timeout {hb:g} s)")

    print(f"\nrecovery after SIGKILL of rank {victim} (stream entry ids, one host's clock)")
    line("kill -> DeclareDead at the coordinator", dead)
    line("kill -> new group announced to the survivors", formed)
    line("kill -> first collective on the new group", first)
    line("kill -> every process exited", ended_at)
    finished = _events(run.logs["coordinator"], "run_finished")
    reason = finished[-1].get("reason", "?") if finished else "?"
    if reason == "None":  # the coordinator's word for a run that trained every epoch
        reason = "completed"
    print("exit codes: " + ", ".join(f"{k} {v}" for k, v in codes.items()))
    print(
        f"run ended: {reason}; epochs in metrics.csv: {_epochs_done(run_dir)} of {args.epochs}; "
        f"logs in {run_dir}"
    )
    # A lone NCCL survivor stopping with a save is the specified outcome (coordinator
    # exit 1, status saved), not a failure of the bench.
    lone = reason == "single_survivor"
    ok = (lone or codes["coordinator"] == 0) and all(codes[f"rank{r}"] == 0 for r in survivors)

    if held is None:
        print("sockets before the kill: /proc cannot say on this host")
    else:
        count, off = held
        print(
            f"sockets before the kill: {count} TCP endpoints of the coordinator and ranks, "
            + ("all on loopback" if not off else f"{len(off)} off loopback: " + "; ".join(off))
        )
        ok = ok and not off
    if not lone:
        found = coverage.problems(run_dir, args.workers, args.epochs, dead=[victim])
        print(
            "every sample of every epoch trained exactly once (metrics.csv, the record)"
            if not found
            else "coverage broken: " + "; ".join(found)
        )
        ok = ok and not found
        _print_shares(run_dir, args.workers, victim)
        metric = _final_metric(run_dir)
        if reference is not None and metric is not None:
            print(f"final eval {metric:.4f}; undisturbed run {reference:.4f} "
                  f"({(metric - reference) * 100:+.2f} points)")  # fmt: skip
        else:
            print(f"final eval {metric}")
    if not args.no_replay:
        rc, report = _replay(run_dir)
        print(f"replay of the records on the CPU (flodl-bus replay --allow-incomplete): exit {rc}")
        for text in report:
            print(f"  {text}")
        ok = ok and rc == 0
    return 0 if ok else 1
