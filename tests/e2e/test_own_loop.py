"""A training script that keeps its own loop (``flodl-bus up --script``) and the same
training as a ``Job`` (``--job``) get the same guarantees: every sample of every epoch
trained exactly once, a clean Shutdown, and a record that replays identically."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_bus.examples import digits_own_loop
from flodl_bus.replay import replay_run
from tests.e2e.harness import (
    assert_each_sample_once,
    new_run_id,
    received,
    records,
)

pytestmark = [pytest.mark.slow, pytest.mark.redis]

EPOCHS = 3
RANKS = 2


def _flodl_bus(cwd: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flodl_bus.cli", *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _up(cwd: Path, redis_url: str, run: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``flodl-bus up`` of ``RANKS`` workers on the test's Redis."""
    return _flodl_bus(
        cwd, "up", "--no-progress", "--no-plot", "--redis-url", redis_url, "--run", run,
        "--workers", str(RANKS), *args, timeout=240,
    )  # fmt: skip


@pytest.mark.parametrize(
    "training",
    [
        # the example's own loop, with gradient accumulation over two batches
        # (after the script, --epochs is the script's own flag: its Rank's epochs)
        ("--script", digits_own_loop.__file__, "--accumulate", "2", "--epochs", str(EPOCHS)),
        ("--epochs", str(EPOCHS), "--job", "flodl_bus.examples.digits:job"),
    ],
    ids=["script", "job"],
)
def test_up_trains_each_sample_once_and_the_record_replays(
    tmp_path: Path, redis_url: str, training: tuple[str, ...]
) -> None:
    run = new_run_id("own-loop")
    run_dir = tmp_path / "runs" / run
    up = _up(tmp_path, redis_url, run, "--mode", "cpu-cadence", *training)
    logs = up.stdout + up.stderr + "".join(p.read_text() for p in run_dir.glob("*.log"))
    assert up.returncode == 0, logs

    assert_each_sample_once(run_dir, RANKS, EPOCHS, logs)
    recs = records(run_dir)
    assert sorted(m["rank"] for m in received(recs, "Exiting")) == list(range(RANKS))
    assert recs[-1]["event"] == "end" and recs[-1]["reason"] is None

    replays = replay_run(run_dir)
    assert sorted(replays) == ["coordinator", *(f"rank:{r}" for r in range(RANKS))]
    assert {k: r.summary() for k, r in replays.items() if not r.identical} == {}
    replayed = _flodl_bus(tmp_path, "replay", str(run_dir), timeout=120)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr


FAILING = """
from torch import nn

import flodl_bus
from flodl_bus.examples.digits import build_model, build_optimizer, train_data

model = build_model()
optimizer = build_optimizer(model)
with flodl_bus.Rank(model, optimizer, train_data(), batch_size=32, epochs=2) as rank:
    for i, (x, y) in enumerate(rank.batches()):
        if rank.rank == 1 and i == 3:
            raise ValueError("bad batch")
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        rank.step(loss)
"""


def test_a_script_raising_in_its_loop_stops_the_run_as_a_job_failure_and_replays(
    tmp_path: Path, redis_url: str
) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    run = new_run_id("own-loop-fails")
    run_dir = tmp_path / "runs" / run
    up = _up(tmp_path, redis_url, run, "--script", str(script))
    assert up.returncode != 0, up.stdout + up.stderr
    assert "rank 1: the script raised ValueError: bad batch" in up.stdout + up.stderr
    recs = records(run_dir)
    reasons = {m["rank"]: m.get("reason") for m in received(recs, "Exiting")}
    assert reasons[1] == "job_failed: the script raised ValueError: bad batch"
    # The other rank was stopped by the coordinator in order, and left cleanly.
    assert reasons.get(0) is None and 0 in reasons
    replayed = _flodl_bus(tmp_path, "replay", str(run_dir), timeout=120)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr


def test_a_run_file_naming_a_script_and_its_arguments_runs_it_from_another_directory(
    tmp_path: Path, redis_url: str
) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "train.py").write_text(Path(digits_own_loop.__file__).read_text())
    (conf / "run.toml").write_text(
        f'script = "train.py"\nscript_args = ["--epochs", "{EPOCHS}"]\n'
        f'workers = {RANKS}\nmode = "cpu-cadence"\n'
    )
    run = new_run_id("own-loop-file")
    run_dir = tmp_path / "runs" / run
    up = _flodl_bus(
        tmp_path, "up", "--no-progress", "--no-plot", "--redis-url", redis_url, "--run", run,
        "--config", "conf/run.toml", timeout=240,
    )  # fmt: skip
    logs = up.stdout + up.stderr + "".join(p.read_text() for p in run_dir.glob("*.log"))
    assert up.returncode == 0, logs
    assert f"script {conf / 'train.py'}" in up.stdout
    # the script's own --epochs reached it: every sample of each of its epochs, once
    assert_each_sample_once(run_dir, RANKS, EPOCHS, logs)
