"""Without the credentials service (the image run by hand, FLODL_CREDENTIALS unset) the
coordinator's entrypoint picks a fresh run id unless FLODL_RUN is set and leaves it in
runs/.compose-run, where the workers' entrypoint and the health check find it. Under
compose the credentials service picks it and hands it over with each role's credentials
(tests/deploy/test_compose_ops.py). The entrypoints run as they are; ``flodl-bus`` on
their PATH is a script that prints the command line it was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.deploy.compose import ROOT, load, service_env

SERVICES = ROOT / "services"


def _argv_of(script: str, cwd: Path, env: dict[str, str]) -> list[str]:
    bindir = cwd / "bin"
    bindir.mkdir(exist_ok=True)
    echo = bindir / "flodl-bus"
    echo.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    echo.chmod(0o755)
    full = {"PATH": f"{bindir}:{os.environ['PATH']}", **env}
    done = subprocess.run(
        ["sh", str(SERVICES / script)], cwd=cwd, env=full, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _by_hand(service: str, host: dict[str, str]) -> dict[str, str]:
    """compose's environment of ``service``, without the credentials file."""
    env = service_env(load(host)["services"][service])
    del env["FLODL_CREDENTIALS"]
    return env


def _run_of(argv: list[str]) -> str:
    return argv[argv.index("--run") + 1]


def test_each_up_without_flodl_run_gets_a_fresh_run_id_the_workers_follow(
    tmp_path: Path,
) -> None:
    env = _by_hand("coordinator", {})
    assert env["FLODL_RUN"] == ""  # compose.yaml leaves it to the entrypoint
    first = _run_of(_argv_of("entrypoint-coordinator.sh", tmp_path, env))
    assert first.startswith("compose-")
    assert (tmp_path / "runs" / ".compose-run").read_text().strip() == first
    worker_env = _by_hand("worker", {})
    assert _run_of(_argv_of("entrypoint-worker.sh", tmp_path, worker_env)) == first
    second = _run_of(_argv_of("entrypoint-coordinator.sh", tmp_path, env))
    assert second != first
    assert _run_of(_argv_of("entrypoint-worker.sh", tmp_path, worker_env)) == second


def test_a_set_flodl_run_is_kept(tmp_path: Path) -> None:
    env = _by_hand("coordinator", {"FLODL_RUN": "run7"})
    assert _run_of(_argv_of("entrypoint-coordinator.sh", tmp_path, env)) == "run7"
    assert not (tmp_path / "runs" / ".compose-run").exists()


def test_the_health_check_reads_the_run_id_the_coordinator_picked(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / ".compose-run").write_text("compose-x\n")
    code = "import healthcheck, sys; sys.stdout.write(str(healthcheck.run_id()))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=30,
        env={**os.environ, "PYTHONPATH": f"{SERVICES}:{ROOT}", "FLODL_RUN": ""},
    )  # fmt: skip
    assert done.stdout == "compose-x", done.stderr
