"""Record a real run: a redis-server, ``flodl-bus coordinator`` and N ``flodl-bus worker``
processes, each recording itself under one run directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from flodl_bus.protocol.signing import new_secret


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flodl_bus.cli", *args]


def record_run(
    redis_url: str,
    run_dir: Path,
    *,
    mode: str = "cpu-cadence",
    world_size: int = 3,
    epochs: int = 1,
    heartbeat_timeout: float = 30.0,
    timeout: float = 120.0,
    extra: tuple[str, ...] = (),
    run: str | None = None,
    reset_run: bool = False,
    during: Callable[[Path, subprocess.Popen[bytes]], None] | None = None,
    codes: tuple[int, ...] | None = None,
) -> tuple[str, Path]:
    """Train the digits job for ``epochs`` and return (run id, run directory asked for).

    ``reset_run``: the coordinator deletes the run's keys first (``--reset-run``, as
    compose starts it) and the workers start once it said so. ``during(coordinator log,
    coordinator)`` runs once every process started; ``codes``: the exit codes expected
    (coordinator first, then each worker), instead of all 0."""
    run = run or f"rec-{mode}-{uuid.uuid4().hex[:6]}"
    env = dict(
        os.environ,
        FLODL_RUN_SECRET=new_secret().hex(),
        OMP_NUM_THREADS="1",
        PYTHONHASHSEED="0",
    )
    common = ("--run", run, "--redis-url", redis_url, "--log-level", "warning")
    coord_log = run_dir.parent / f"{run_dir.name}-coordinator.log"
    coord_log.parent.mkdir(parents=True, exist_ok=True)
    coord_out = open(coord_log, "wb")  # noqa: SIM115
    reset = ("--reset-run", "--log-level", "info") if reset_run else ()
    coord = subprocess.Popen(
        _cli(
            "coordinator",
            *common,
            "--job",
            "flodl_bus.examples.digits:job",
            "--mode",
            mode,
            "--world-size",
            str(world_size),
            "--epochs",
            str(epochs),
            "--run-dir",
            str(run_dir),
            "--heartbeat-timeout",
            str(heartbeat_timeout),
            "--exit-grace",
            "10",
            "--no-final-eval",
            *reset,
            *extra,
        ),
        env=env,
        stdout=coord_out,
        stderr=subprocess.STDOUT,
    )
    if reset_run:
        _wait_for_line(coord_log, b"run_reset", coord, timeout)
    workers = [
        subprocess.Popen(
            _cli(
                "worker",
                *common,
                "--rank",
                str(r),
                "--world-size",
                str(world_size),
                "--job",
                "flodl_bus.examples.digits:job",
                "--mode",
                mode,
                "--heartbeat-interval",
                "0.5",
                "--run-dir",
                str(run_dir),
            ),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world_size)
    ]
    outputs = []
    try:
        if during is not None:
            during(coord_log, coord)
        coord.wait(timeout=timeout)
        outputs.append((coord.returncode, coord_log.read_bytes().decode(errors="replace")))
        for p in workers:
            out, _ = p.communicate(timeout=timeout)
            outputs.append((p.returncode, out.decode(errors="replace")))
    finally:
        coord_out.close()
        for p in [coord, *workers]:
            if p.poll() is None:
                p.kill()
                p.wait()
    want = codes or (0,) * len(outputs)
    bad = [(rc, out[-3000:]) for (rc, out), ok in zip(outputs, want, strict=True) if rc != ok]
    if bad:
        raise AssertionError(f"run {run} failed: {bad}")
    return run, run_dir


def _wait_for_line(path: Path, text: bytes, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until ``text`` is in the log ``path`` (the process's own announcement)."""
    deadline = time.monotonic() + timeout
    while text not in path.read_bytes():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {path.read_bytes()[-2000:]!r}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} in {path} after {timeout}s")
        time.sleep(0.05)
