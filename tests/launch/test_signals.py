"""Signals to the processes of a ``flodl-bus up`` run, each with a real embedded Redis,
coordinator and workers: every process stops in order, closes its record with an end
line and exits with the code of the README's table; a rank that leaves mid-run is
re-formed around at once (not after the 30 s heartbeat timeout).

Every wait is on an event (a file the run writes, a log line, a process exit), never on
a sleep; the clock readings compared are CLOCK_MONOTONIC on both sides (the tests and the
processes share the host)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from flodl_bus.record.chain import record_bytes
from flodl_bus.record.log import read_records
from tests.launch.test_up import MARK, _records_closed, _summary, marked_pids

pytestmark = [pytest.mark.slow, pytest.mark.redis]

REPO = Path(__file__).resolve().parents[2]
#: every training step sleeps (tests/e2e/jobs.py): the run lasts long enough to act
#: mid-run whatever the machine's load
SLOW = "tests.e2e.jobs:slow_job"


@pytest.fixture
def mark() -> Iterator[str]:
    token = uuid.uuid4().hex
    yield token
    for pid in marked_pids(token):  # whatever the outcome, leave nothing running
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _up(
    tmp_path: Path, mark: str, *args: str, sigint_ignored: bool = False
) -> subprocess.Popen[str]:
    env = {**os.environ, MARK: mark, "PYTHONPATH": str(REPO)}
    env.pop("FLODL_RUN_SECRET", None)

    def ignore_sigint() -> None:
        # What `flodl-bus up &` in a script gets: SIGINT ignored, inherited by exec.
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(
        [sys.executable, "-m", "flodl_bus.cli", "up", "--no-progress", "--no-plot", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=ignore_sigint if sigint_ignored else None,
    )


def _wait(proc: subprocess.Popen[str], what: str, ready: Callable[[], bool], limit: float) -> None:
    deadline = time.monotonic() + limit
    while not ready():
        assert proc.poll() is None, f"up ended before {what}:\n{proc.communicate()[0]}"
        assert time.monotonic() < deadline, f"no {what} within {limit:.0f}s"
        time.sleep(0.05)


def _epochs(run_dir: Path) -> int:
    try:
        return max(0, len((run_dir / "metrics.csv").read_text().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def _pid_of(mark: str, *words: str) -> int:
    for pid in marked_pids(mark):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        text = [a.decode() for a in argv]
        if all(w in text for w in words) and (
            "--rank" not in words or text[text.index("--rank") + 1] == words[-1]
        ):
            return pid
    raise AssertionError(f"no process with {words}")


def _log_event(log: Path, event: str, **fields: str) -> dict[str, str] | None:
    """The key=value fields of the first console line of ``event`` matching ``fields``."""
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return None
    for line in text.splitlines():
        if f" {event} " not in f"{line} ":
            continue
        got = dict(re.findall(r"(\w+)=('[^']*'|\S+)", line))
        if all(got.get(k) == v for k, v in fields.items()):
            return got
    return None


def _end(record: Path) -> dict[str, object]:
    last = orjson.loads(record_bytes(record).splitlines()[-1])
    assert last["event"] == "end", f"{record.name} has no end line: {last}"
    return last  # type: ignore[no-any-return]


def test_a_rank_stopped_by_sigterm_or_killed_mid_run_is_re_formed_around_at_once(
    tmp_path: Path, mark: str
) -> None:
    """SIGTERM: the rank says so upstream (Exiting with the reason) and exits 143 with
    its record closed. SIGKILL: it cannot say anything, so ``up`` tells the coordinator.
    Either way the coordinator declares it dead within a second or two, not after the
    30 s heartbeat timeout, and the survivors train to the end."""
    proc = _up(tmp_path, mark, "--run", "leave", "--workers", "3", "--epochs", "8", "--job", SLOW)
    run_dir = tmp_path / "runs" / "leave"
    coord_log = run_dir / "coordinator.log"
    _wait(proc, "a first epoch", lambda: _epochs(run_dir) >= 1, 120)

    os.kill(_pid_of(mark, "worker", "--rank", "2"), signal.SIGTERM)
    termed = time.monotonic()
    _wait(
        proc,
        "rank 2's DeclareDead",
        lambda: _log_event(coord_log, "rank_declared_dead", rank="2") is not None,
        30,
    )
    dead2 = float(_log_event(coord_log, "rank_declared_dead", rank="2")["mono"])  # type: ignore[index]
    # A re-formed group of the two survivors trains at least one more epoch...
    at = _epochs(run_dir)
    _wait(proc, "an epoch after the re-form", lambda: _epochs(run_dir) > at, 60)

    os.kill(_pid_of(mark, "worker", "--rank", "1"), signal.SIGKILL)
    killed = time.monotonic()
    _wait(
        proc,
        "rank 1's DeclareDead",
        lambda: _log_event(coord_log, "rank_declared_dead", rank="1") is not None,
        30,
    )
    dead1 = float(_log_event(coord_log, "rank_declared_dead", rank="1")["mono"])  # type: ignore[index]

    out, _ = proc.communicate(timeout=120)
    print(f"\nSIGTERM -> DeclareDead {dead2 - termed:.3f}s")
    print(f"SIGKILL -> DeclareDead {dead1 - killed:.3f}s")
    assert dead2 - termed < 5.0, out
    assert dead1 - killed < 5.0, out
    # ...and the lone survivor (a cpu mode goes on with one) finishes every epoch.
    assert _epochs(run_dir) == 8
    summary = _summary(run_dir)
    assert summary["coordinator_rc"] == 0 and summary["worker_rcs"] == [0, -9, 143], out
    # The run finished, not every process did: 1, never a raw 247.
    assert proc.returncode == 1 == summary["exit_code"], out
    assert "rank2 stopped by SIGTERM (exit 143)" in out and "rank1 killed by SIGKILL" in out

    recs = read_records(run_dir / "coordinator.jsonl")
    leaving = [r for r in recs if r.get("event") == "dispatch" and r["msg"]["type"] == "Exiting"
               and r["msg"].get("reason")]  # fmt: skip
    assert [(r["sender"], r["msg"]["reason"]) for r in leaving] == [(2, "SIGTERM")]
    told = [r for r in recs if r.get("event") == "declare_dead"]
    assert [r["rank"] for r in told] == [1], (
        "up's notice of the killed rank is a recorded core call"
    )
    sessions = sorted(
        (o["rank"], o["msg"]["new_world_size"])
        for r in recs for o in r.get("out", ()) if o.get("msg", {}).get("type") == "NewNcclSession"
    )  # fmt: skip
    # Two ranks re-formed after the SIGTERM, then rank 0 alone after the SIGKILL.
    assert sessions == [(0, 1), (0, 2), (1, 2)], sessions
    assert _end(run_dir / "rank2.jsonl")["exit_code"] == 143
    assert _end(run_dir / "rank0.jsonl")["exit_code"] == 0
    _records_closed_but(run_dir, killed={"rank1.jsonl"})
    assert marked_pids(mark) == []


def _records_closed_but(run_dir: Path, killed: set[str]) -> None:
    for path in sorted(run_dir.glob("*.jsonl*")):
        data = record_bytes(path)  # records are zstd-compressed
        if path.name.removesuffix(".zst") in killed:
            continue  # a SIGKILL leaves whatever its buffer held
        assert data.endswith(b"\n"), f"{path.name} ends mid-line"
        for line in data.splitlines():
            orjson.loads(line)


@pytest.mark.parametrize(
    ("target", "sig", "sigint_ignored", "code"),
    [
        ("up", signal.SIGINT, True, 130),
        ("up", signal.SIGTERM, False, 143),
        ("up", signal.SIGHUP, False, 129),
        ("coordinator", signal.SIGTERM, False, 143),
    ],
    ids=["up-sigint-inherited-ignored", "up-sigterm", "up-sighup", "coordinator-sigterm"],
)
def test_a_stop_signal_stops_the_run_in_order_with_the_documented_code(
    tmp_path: Path, mark: str, target: str, sig: signal.Signals, sigint_ignored: bool, code: int
) -> None:
    proc = _up(tmp_path, mark, "--run", "stop", "--epochs", "400", sigint_ignored=sigint_ignored)
    run_dir = tmp_path / "runs" / "stop"
    _wait(proc, "a first epoch", lambda: _epochs(run_dir) >= 1, 120)
    pid = proc.pid if target == "up" else _pid_of(mark, "coordinator")
    sent = time.monotonic()
    os.kill(pid, sig)
    out, _ = proc.communicate(timeout=60)
    stopped_after = time.monotonic() - sent
    print(f"\n{target} {sig.name}: every process stopped after {stopped_after:.2f}s")
    assert proc.returncode == code, out
    assert stopped_after < 20, out
    assert marked_pids(mark) == []
    _records_closed(run_dir)
    summary = _summary(run_dir)
    assert summary["exit_code"] == code
    # Every record ends with its closing line; the ranks were stopped by the protocol
    # (the coordinator's Shutdown), so they finished in order.
    coordinator_end = _end(run_dir / "coordinator.jsonl")
    assert coordinator_end["reason"] is None
    for r in (0, 1):
        assert _end(run_dir / f"rank{r}.jsonl")["exit_code"] == 0
    if target == "coordinator":
        assert summary["coordinator_rc"] == code
    else:
        assert summary["interrupted"] is True
