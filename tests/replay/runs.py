"""Record a real run: a redis-server, ``flodl-bus coordinator`` and N ``flodl-bus worker``
processes, each recording itself under one run directory."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
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
) -> tuple[str, Path]:
    """Train the digits job for ``epochs`` and return (run id, run directory)."""
    run = f"rec-{mode}-{uuid.uuid4().hex[:6]}"
    env = dict(
        os.environ,
        FLODL_RUN_SECRET=new_secret().hex(),
        OMP_NUM_THREADS="1",
        PYTHONHASHSEED="0",
    )
    common = ("--run", run, "--redis-url", redis_url, "--log-level", "warning")
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
            *extra,
        ),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
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
                *(("--run-dir", str(run_dir)) if _worker_records() else ()),
            ),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world_size)
    ]
    outputs = []
    try:
        for p in [coord, *workers]:
            out, _ = p.communicate(timeout=timeout)
            outputs.append((p.returncode, out.decode(errors="replace")))
    finally:
        for p in [coord, *workers]:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(rc, out[-3000:]) for rc, out in outputs if rc != 0]
    if bad:
        raise AssertionError(f"run {run} failed: {bad}")
    return run, run_dir


def _worker_records() -> bool:
    from flodl_bus.worker.options import parser

    return "--run-dir" in parser().format_help()
