"""``flodl-bus bench scale --ranks-per-host K`` runs the simulated ranks through real
host agents end to end, and the coordinator's record of such a run replays identically
(folded items are recorded as entries of each rank's own ``up:<r>``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_bus.bench.scale import main


@pytest.mark.parametrize("ingest_procs", [0, 1])
def test_bench_scale_through_host_agents_trains_every_step_and_its_record_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ingest_procs: int
) -> None:
    # With a reader process the folds are unpacked and checked there (``bus.ingest``).
    out = tmp_path / "scale.json"
    keep = tmp_path / "keep"
    argv = ["--ranks", "4", "--ranks-per-host", "2", "--steps", "3", "--epochs", "1"]
    argv += ["--step-ms", "10", "--procs", "1", "--timeout", "60"]
    argv += ["--ingest-procs", str(ingest_procs)]
    assert main([*argv, "--json", str(out), "--keep", str(keep)]) == 0
    (got,) = json.loads(out.read_text())
    assert got["ranks_per_host"] == 2 and got["ingest_procs"] == ingest_procs
    assert got["ranks_clean"] == 4 and got["declared_dead"] == 0
    assert got["steps_done"] == 4 * 3
    # Measured, though a 3-step run can take less than the clock's 10 ms tick in each
    # agent (a loaded CI host read 0.0); the folds below show the agents carried traffic.
    assert got["agents_cpu"] >= 0
    assert got["items_per_fold"] >= 1.0
    assert "host agents CPU" in capsys.readouterr().out
    cmd = [sys.executable, "-m", "flodl_bus.cli", "replay", str(keep / "ranks4")]
    replay = subprocess.run(
        [*cmd, "--role", "coordinator", "--allow-incomplete"],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=120,
    )
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "identical" in replay.stdout
    assert main(["--ranks", "4", "--ranks-per-host", "0"]) == 2


def test_bench_agent_prints_the_folded_cost_beside_the_direct_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from flodl_bus.bench.agent import main as agent_main
    from flodl_bus.cli import BENCHES

    assert BENCHES["agent"][0] == "flodl_bus.bench.agent:main"
    argv = ["--ranks", "16", "--ranks-per-host", "4", "--steps", "2", "--repeats", "1"]
    assert agent_main([*argv, "--ingest-procs", "0,1"]) == 0
    out = capsys.readouterr().out
    assert "ingest per message   direct" in out and "folded" in out
    assert "(on the coordinator's thread)" in out and "(1 reader processes)" in out
    assert "empty read" in out and "4 fold streams" in out
    assert agent_main(["--ranks-per-host", "1"]) == 2
    assert agent_main([*argv, "--ingest-procs", "-1"]) == 2
