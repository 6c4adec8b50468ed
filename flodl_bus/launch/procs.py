"""The launcher's child processes: each in its own process group, stopped in stages.

Every child starts a new session, so a Ctrl-C typed at the terminal reaches only the
launcher, which then shuts the run down in order instead of every process dying at
once mid-write:

1. SIGINT to the coordinator, which tells the ranks to stop (and to save, when a save
   path is set) while they are all still alive to do it;
2. SIGINT to every group still running (Python's KeyboardInterrupt runs ``finally``
   blocks, so records are flushed and closed);
3. SIGTERM, then SIGKILL, to whatever is left.

Signals go to the whole process group, so anything a child started (a data-loader
worker, a helper) goes with it; no process outlives the launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flodl_bus.worker.host import launcher_threads, thread_share, usable_cores


@dataclass(frozen=True)
class StopPlan:
    """Seconds given to each stage before the next, harsher one."""

    coordinator_s: float = 3.0
    interrupt_s: float = 2.0
    terminate_s: float = 1.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pgid(self) -> int:
        # start_new_session makes the child the leader of a group numbered by its pid.
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def signal_group(self, sig: signal.Signals) -> bool:
        """Signal every process of the group; False when the group is gone."""
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            return False
        return True

    def group_alive(self) -> bool:
        if self.proc.poll() is None:
            return True
        # The leader is gone; members it started may still be in the group.
        try:
            os.killpg(self.pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return _has_live_member(self.pgid)


def _has_live_member(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is more than a zombie. An orphan's zombie
    stays in its group until PID 1 reaps it, and not every PID 1 does (a container's,
    a microVM's agent): a group of zombies is stopped, not something to SIGKILL."""
    proc = Path("/proc")
    if not proc.is_dir():
        return True  # no way to tell: assume the worst
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def spawn(
    name: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    cwd: str | Path | None = None,
    pass_fds: Sequence[int] = (),
) -> Child:
    """Start ``argv`` as the leader of a new session. It inherits the launcher's signal
    dispositions (an ignored SIGINT survives exec), so every child worth stopping in
    order installs its own handlers: ``flodl_bus.stop_signals``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
        )
    return Child(name, proc, log_path)


def thread_env(base: Mapping[str, str], threads: int) -> dict[str, str]:
    """``base`` with every math library limited to ``threads`` threads."""
    env = dict(base)
    n = str(max(1, threads))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = n
    return env


def threads_per_worker(
    workers: int, cores: int | None = None, env: Mapping[str, str] | None = None
) -> int:
    """Split the cores among the workers by the rule every rank follows
    (``worker.host.thread_share``: a large host keeps a core for the control plane;
    oversubscribing only adds contention). ``FLODL_NUM_THREADS`` or ``OMP_NUM_THREADS``
    in ``env`` wins, as it does in a rank."""
    cores = usable_cores() if cores is None else cores
    env = {} if env is None else env
    share = thread_share({**env, "LOCAL_WORLD_SIZE": str(max(1, workers))}, cores)
    if share is None:  # the caller's OMP_NUM_THREADS
        return launcher_threads(env) or 1
    return share


def _wait(children: Sequence[Child], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        if not any(c.group_alive() for c in children):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def stop_all(
    children: Sequence[Child],
    coordinator: Child | None = None,
    plan: StopPlan | None = None,
) -> list[str]:
    """Stop every child group; returns the stages that had to be used, for the record."""
    plan = plan or StopPlan()
    stages: list[str] = []
    if coordinator is not None and coordinator.group_alive():
        coordinator.signal_group(signal.SIGINT)
        stages.append("coordinator-sigint")
        if _wait(children, plan.coordinator_s):
            return stages
    for sig, wait_s, stage in (
        (signal.SIGINT, plan.interrupt_s, "sigint"),
        (signal.SIGTERM, plan.terminate_s, "sigterm"),
    ):
        alive = [c for c in children if c.group_alive()]
        if not alive:
            return stages
        for c in alive:
            c.signal_group(sig)
        stages.append(stage)
        if _wait(children, wait_s):
            return stages
    alive = [c for c in children if c.group_alive()]
    for c in alive:
        c.signal_group(signal.SIGKILL)
    if alive:
        stages.append("sigkill")
    for c in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=5)
    return stages
