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

then the exit codes and the final eval. With two ranks the single survivor cannot form an
NCCL group: the coordinator stops the run with a save (flodl's ``SingleSurvivor``), and
the figure is kill -> the survivor's orderly exit.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
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

from flodl_bus.bus.entries import F_TYPE
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer

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
    path = run_dir / "metrics.csv"
    if not path.exists():
        return 0
    with path.open() as f:
        return len(list(csv.DictReader(f)))


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with RedisServer() as server:
        yield server.url


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flodl-bus bench kill", description=__doc__)
    p.add_argument("--job", default="flodl_bus.examples.digits:job")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--mode", default="nccl-cadence")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--after", type=int, default=1, help="epochs finished before the kill")
    p.add_argument("--victim", type=int, help="rank to kill (default: the last)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--redis-url")
    p.add_argument("--run-dir", help="keep the run's records and logs here")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    args = p.parse_args(argv)
    if args.workers < 2:
        raise SystemExit("--workers must be at least 2: one dies, at least one survives")
    victim = args.workers - 1 if args.victim is None else args.victim
    if not 0 <= victim < args.workers:
        raise SystemExit(f"--victim {victim} is outside 0..{args.workers - 1}")

    import torch

    gpus = torch.cuda.device_count()
    if gpus and gpus < args.workers:
        raise SystemExit(f"{args.workers} workers need {args.workers} GPUs; this host has {gpus}")
    run = f"kill-{uuid.uuid4().hex[:8]}"
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="flodl-bench-kill-")) / run
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("FLODL_RUN_SECRET", None)
    if not gpus:
        env.setdefault("OMP_NUM_THREADS", "1")
    where = f"{gpus} GPU(s)" if gpus else "CPU (gloo)"
    print(
        f"flodl-bus bench kill: {args.job}, {args.workers} ranks, {args.mode}, on {where}; "
        f"kill rank {victim} during epoch {args.after}"
    )

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

    with _redis(args.redis_url) as url:
        common = (
            "--run", run, "--redis-url", url, "--job", args.job, "--run-dir", str(run_dir),
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
        deadline = time.monotonic() + args.timeout
        watch = _Watch(url, RunKeys(run), args.workers)
        watch.start()
        try:
            while _epochs_done(run_dir) < args.after:
                if time.monotonic() > deadline or any(q.poll() is not None for q in procs.values()):
                    raise RuntimeError(f"the run ended or stalled before epoch {args.after}")
                time.sleep(0.05)
            time.sleep(0.2)  # into the next epoch, not at its boundary
            procs[f"rank{victim}"].send_signal(signal.SIGKILL)
            killed_at = time.time()
            codes = {}
            for name, q in procs.items():
                codes[name] = q.wait(timeout=max(1.0, deadline - time.monotonic()))
            ended_at = time.time()
            entries = watch.stop()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            for q in procs.values():
                if q.poll() is None:
                    q.kill()
            watch.stop()
            print(f"bench kill failed: {exc}; logs in {run_dir}", file=sys.stderr)
            return 1

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
    finished = _events(logs["coordinator"], "run_finished")
    reason = finished[-1].get("reason", "?") if finished else "?"
    print("exit codes: " + ", ".join(f"{k} {v}" for k, v in codes.items()))
    print(
        f"run ended: {reason}; epochs in metrics.csv: {_epochs_done(run_dir)} of {args.epochs}; "
        f"logs in {run_dir}"
    )
    # A lone NCCL survivor stopping with a save is the specified outcome (coordinator
    # exit 1, status saved), not a failure of the bench.
    expected = reason == "single_survivor" or codes["coordinator"] == 0
    survivors_ok = all(codes[f"rank{r}"] == 0 for r in range(args.workers) if r != victim)
    return 0 if expected and survivors_ok else 1
