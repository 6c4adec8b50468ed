"""Real processes for the end-to-end tests: a coordinator and workers over redis-server.

Everything a test asserts comes from what the processes left behind: exit codes,
``metrics.csv`` (written from the ranks' own MetricsMsg), and the coordinator's record
(every plan it sent, every message it received).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flodl_bus.replay import coverage
from flodl_bus.replay.coverage import coordinator_records, emitted, metrics_rows

# What the e2e tests read off a run, where they import it from (``replay.coverage``).
Range = coverage.Range
epoch_samples = coverage.epoch_samples
sent_plans = coverage.sent_plans
tiles = coverage.tiles

REPO = Path(__file__).resolve().parents[2]
DIGITS = "flodl_bus.examples.digits:job"
SLOW = "tests.e2e.jobs:slow_job"


def new_run_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env.pop("FLODL_RUN_SECRET", None)  # the coordinator makes one per run
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, n: int = 2500) -> str:
        return f"--- {self.name} ---\n{self.output()[-n:]}"


@dataclass
class Cluster:
    """The processes of one test; every one of them is killed at teardown."""

    redis_url: str
    workdir: Path
    procs: list[Proc] = field(default_factory=list)

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        log = self.workdir / f"{name}.log"
        popen = subprocess.Popen(
            [sys.executable, "-m", "flodl_bus.cli", *args],
            cwd=REPO,
            env={**_env(), **(env or {})},
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def coordinator(
        self, run: str, *args: str, job: str = DIGITS, env: dict[str, str] | None = None
    ) -> Proc:
        return self.spawn(
            f"coordinator-{run}",
            "coordinator",
            "--run",
            run,
            "--redis-url",
            self.redis_url,
            "--job",
            job,
            "--run-dir",
            str(self.run_dir(run)),
            "--exit-grace",
            "20",
            *args,
            env=env,
        )

    def worker(self, run: str, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        return self.spawn(
            f"{name}-{run}",
            "worker",
            "--run",
            run,
            "--redis-url",
            self.redis_url,
            "--run-dir",
            str(self.run_dir(run)),
            "--log-level",
            "warning",
            *args,
            env=env,
        )

    def ranked_workers(self, run: str, n: int, *args: str) -> list[Proc]:
        return [
            self.worker(run, f"rank{r}", "--rank", str(r), "--world-size", str(n), *args)
            for r in range(n)
        ]

    def run_dir(self, run: str) -> Path:
        return self.workdir / "runs" / run

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    def wait(self, procs: Sequence[Proc], timeout: float) -> list[int]:
        """Exit codes of ``procs``; a process still running at the deadline fails the
        test (with every process's output)."""
        deadline = time.monotonic() + timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.popen.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    if q.popen.poll() is None:
                        q.popen.send_signal(signal.SIGABRT)  # faulthandler: dump stacks
                time.sleep(1.0)
                raise AssertionError(
                    f"{p.name} still running after {timeout:.0f}s\n{self.tails()}"
                ) from None
        return codes

    def kill_all(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=10)


def cluster_fixture(redis_url: str, tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(redis_url, tmp_path)
    try:
        yield cluster
    finally:
        cluster.kill_all()


def wait_for(predicate: Any, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{cluster.tails()}")
        time.sleep(0.05)


# ------------------------------------------------------------------- what a run left


def final_metric(run_dir: Path) -> float:
    rows = [r for r in metrics_rows(run_dir) if r["eval_metric"]]
    assert rows, f"no eval metric in {run_dir / 'metrics.csv'}"
    return float(rows[-1]["eval_metric"])


def records(run_dir: Path) -> list[dict[str, Any]]:
    return coordinator_records(run_dir)


def received(recs: Sequence[dict[str, Any]], msg_type: str) -> list[dict[str, Any]]:
    return [r["msg"] for r in recs if r.get("event") == "dispatch" and r["msg"]["type"] == msg_type]


def alerts(recs: Sequence[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [o for o in emitted(recs) if o.get("kind") == "Alert" and o.get("event") == event]


def assert_each_sample_once(run_dir: Path, ranks: int, epochs: int, why: str = "") -> None:
    """Every sample of each batch-aligned epoch trained exactly once: the ranks' own
    counts add up to the epoch, and what each rank was sent tiles the epoch, each rank
    having trained exactly what it was sent (``replay.coverage``)."""
    found = coverage.problems(run_dir, ranks, epochs)
    assert not found, (why, found)


def header(recs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    assert recs and recs[0]["event"] == "run", "the record does not start with its header"
    return recs[0]
