"""The job's hooks in a real two-rank run: ``metrics_fn`` once per epoch on the role
rank, ``eval_result_fn`` with every broadcast eval, ``checkpoint_fn`` on the checkpoint
role, and ``request_checkpoint``/``request_eval`` called from the job's ``epoch_fn``
bring a checkpoint and an eval that no flag scheduled."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import Cluster, new_run_id, received, records
from tests.e2e.jobs import HOOKS_DIR_ENV

pytestmark = [pytest.mark.slow, pytest.mark.redis]

EPOCHS = 4
MODE = "nccl-cadence"
HOOKS = "tests.e2e.jobs:hooks_job"


def _lines(folder: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(folder.glob("rank*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _broadcasts(recs: list[dict[str, Any]], msg_type: str) -> list[dict[str, Any]]:
    found = []
    for rec in recs:
        if rec.get("event") in ("dispatch", "tick", "start"):
            for o in rec.get("out", ()):
                if o.get("kind") == "Broadcast" and o["msg"]["type"] == msg_type:
                    found.append(o["msg"])
    return found


def test_every_job_hook_is_called_with_what_the_coordinator_sent(
    cluster: Cluster, tmp_path: Path
) -> None:
    hooks_dir = tmp_path / "hooks"
    hooks_dir.mkdir()
    env = {HOOKS_DIR_ENV: str(hooks_dir)}
    run = new_run_id("hooks")
    coord = cluster.coordinator(
        run, "--mode", MODE, "--world-size", "2", "--epochs", str(EPOCHS), job=HOOKS
    )
    workers = [
        cluster.worker(run, f"rank{r}", "--rank", str(r), "--world-size", "2", env=env)
        for r in range(2)
    ]
    assert cluster.wait([coord, *workers], timeout=180) == [0, 0, 0], cluster.tails()
    seen = _lines(hooks_dir)
    recs = records(cluster.run_dir(run))

    # metrics_fn: each epoch's aggregate exactly once, on one rank, as broadcast.
    aggregated = {
        int(m["metrics"]["epoch"]): float(m["metrics"]["avg_loss"])
        for m in _broadcasts(recs, "EpochAggregated")
    }
    metrics = [s for s in seen if s["kind"] == "metrics"]
    assert sorted(s["epoch"] for s in metrics) == list(range(EPOCHS)), metrics
    for s in metrics:
        assert math.isclose(s["avg_loss"], aggregated[s["epoch"]], rel_tol=1e-12), s

    # Both requests were made, mid-run, and reached the coordinator in order.
    requested = [s["what"] for s in seen if s["kind"] == "requested"]
    assert sorted(requested) == ["checkpoint", "eval"]
    assert [m["kind"] for m in received(recs, "Intent")] == ["CheckpointNow", "EvalNow"]

    # checkpoint_fn: only the requested checkpoint (no --checkpoint-every), once, at an
    # epoch boundary, with a real model.
    checkpoints = [s for s in seen if s["kind"] == "checkpoint"]
    assert len(checkpoints) == 1, checkpoints
    # Asked for as epoch 1 started: run at the next boundary, into epoch 2.
    assert checkpoints[0]["version"] == 2
    assert math.isfinite(checkpoints[0]["param_sum"]) and checkpoints[0]["param_sum"] != 0

    # eval_result_fn: every broadcast eval (the requested one and the final one), once.
    broadcast = [(int(m["epoch"]), float(m["metric"])) for m in _broadcasts(recs, "EvalBroadcast")]
    evals = [(s["epoch"], s["metric"]) for s in seen if s["kind"] == "eval"]
    assert sorted(evals) == sorted(broadcast), (evals, broadcast)
    assert len(evals) == 2, evals
    # Asked for as epoch 2 started: scored at a round of epoch 2 or 3; then the final one.
    assert sorted(e for e, _ in evals)[0] in (2, 3) and max(e for e, _ in evals) == EPOCHS
    assert all(0.5 < m <= 1.0 for _, m in evals), evals
