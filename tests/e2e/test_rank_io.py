"""Ranks whose Redis work runs in a process of their own (``--rank-io process``, here
from ``FLODL_RANK_IO`` as ``up`` passes its environment on): every sample of every
epoch trained once, every rank's last report out, the records replay identically, and
no bus process outlives its rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from flodl_bus.replay import replay_run
from tests.e2e.harness import assert_each_sample_once, new_run_id, received, records
from tests.launch.test_up import MARK, marked_pids

pytestmark = [pytest.mark.slow, pytest.mark.redis]

EPOCHS = 3
RANKS = 2


def test_ranks_with_their_bus_in_a_process_of_its_own_train_each_sample_once_and_replay(
    tmp_path: Path, redis_url: str
) -> None:
    run = new_run_id("rank-io")
    run_dir = tmp_path / "runs" / run
    mark = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLODL_RANK_IO": "process", MARK: mark}
    env.pop("FLODL_RUN_SECRET", None)
    up = subprocess.run(
        [sys.executable, "-m", "flodl_bus.cli", "up", "--no-progress", "--no-plot",
         "--redis-url", redis_url, "--run", run, "--workers", str(RANKS),
         "--mode", "cpu-cadence", "--epochs", str(EPOCHS)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    logs = up.stdout + up.stderr + "".join(p.read_text() for p in run_dir.glob("*.log"))
    assert up.returncode == 0, logs
    said = re.findall(r"rank (\d): its Redis work in process \d+ \(--rank-io process\)", logs)
    assert sorted(said) == [str(r) for r in range(RANKS)], logs

    assert_each_sample_once(run_dir, RANKS, EPOCHS, logs)
    recs = records(run_dir)
    assert sorted(m["rank"] for m in received(recs, "Exiting")) == list(range(RANKS))
    replays = replay_run(run_dir)
    assert {k: r.summary() for k, r in replays.items() if not r.identical} == {}
    assert marked_pids(mark) == [], "a process of the run outlived it"
