"""Child process groups and the staged stop, with real processes."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from flodl_bus.launch.procs import (
    Child,
    StopPlan,
    spawn,
    stop_all,
    thread_env,
    threads_per_worker,
)

FAST = StopPlan(coordinator_s=1.0, interrupt_s=1.0, terminate_s=1.0)
#: For children expected to stop at a stage: a stage ends as soon as they are gone, so a
#: long window costs nothing, and a loaded machine does not push them into the next one.
PATIENT = StopPlan(coordinator_s=1.0, interrupt_s=15.0, terminate_s=1.0)

# Each script writes "ready" once its signal handlers are in place. Each sets them
# explicitly, as every flodl-bus process does: a child inherits an ignored SIGINT when
# the suite itself runs in the background of a script (`trap "" INT`).
EXITS_ON_SIGINT = (
    "import signal, time\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "print('ready', flush=True)\n"
    "try:\n"
    "    time.sleep(60)\n"
    "except KeyboardInterrupt:\n"
    "    print('clean', flush=True)\n"
)
STUBBORN = (
    "import signal, time\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
WITH_GRANDCHILD = (
    "import subprocess, sys, time\n"
    "p = subprocess.Popen(['sleep', '60'])\n"
    "print('ready', p.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def _start(tmp_path: Path, name: str, script: str) -> Child:
    child = spawn(name, [sys.executable, "-c", script], os.environ, tmp_path / f"{name}.log")
    deadline = time.monotonic() + 10
    while "ready" not in child.log_path.read_text():
        assert time.monotonic() < deadline, f"{name} never became ready"
        assert child.returncode is None, child.log_path.read_text()
        time.sleep(0.02)
    return child


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_child_that_handles_sigint_stops_at_the_first_stage(tmp_path: Path) -> None:
    child = _start(tmp_path, "polite", EXITS_ON_SIGINT)
    stages = stop_all([child], plan=PATIENT)
    assert stages == ["sigint"]
    assert "clean" in child.log_path.read_text()
    assert not child.group_alive()


@pytest.mark.slow
def test_a_child_ignoring_sigint_and_sigterm_is_killed(tmp_path: Path) -> None:
    child = _start(tmp_path, "stubborn", STUBBORN)
    t0 = time.monotonic()
    stages = stop_all([child], plan=FAST)
    assert stages == ["sigint", "sigterm", "sigkill"]
    assert child.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 5


@pytest.mark.slow
def test_processes_a_child_started_go_with_its_group(tmp_path: Path) -> None:
    child = _start(tmp_path, "parent", WITH_GRANDCHILD)
    grandchild = int(child.log_path.read_text().split()[1])
    assert _alive(grandchild)
    stop_all([child], plan=FAST)
    deadline = time.monotonic() + 3
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)
    assert not child.group_alive()


@pytest.mark.slow
def test_the_coordinator_is_interrupted_before_the_workers(tmp_path: Path) -> None:
    coordinator = _start(tmp_path, "coordinator", EXITS_ON_SIGINT)
    worker = _start(tmp_path, "worker", EXITS_ON_SIGINT)
    stages = stop_all([coordinator, worker], coordinator, plan=PATIENT)
    # The worker outlived the coordinator's stage (nobody told it to stop), then was
    # interrupted in the next one.
    assert stages == ["coordinator-sigint", "sigint"]
    assert "clean" in coordinator.log_path.read_text()
    assert "clean" in worker.log_path.read_text()


def test_a_new_session_keeps_a_terminal_ctrl_c_away_from_children(tmp_path: Path) -> None:
    child = spawn("s", ["sleep", "30"], os.environ, tmp_path / "s.log")
    try:
        assert os.getpgid(child.proc.pid) == child.proc.pid != os.getpgid(0)
        assert os.getsid(child.proc.pid) == child.proc.pid
    finally:
        stop_all([child], plan=FAST)


def test_cores_are_split_among_workers_with_at_least_one_thread_each() -> None:
    assert threads_per_worker(2, cores=2) == 1
    assert threads_per_worker(1, cores=2) == 2
    assert threads_per_worker(3, cores=8) == 2
    assert threads_per_worker(5, cores=2) == 1
    # the rule a rank follows: a large host keeps a core for the control plane
    assert threads_per_worker(1, cores=16) == 15
    assert threads_per_worker(2, cores=16) == 7
    # an explicit count wins, as in a rank; a launcher's OMP_NUM_THREADS is kept
    assert threads_per_worker(2, cores=16, env={"FLODL_NUM_THREADS": "1"}) == 1
    assert threads_per_worker(2, cores=16, env={"OMP_NUM_THREADS": "4"}) == 4
    env = thread_env({"PATH": "/bin"}, 3)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert env["PATH"] == "/bin"
