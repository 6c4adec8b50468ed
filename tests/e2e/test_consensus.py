"""The model a run leaves is the consensus its final eval scored: in a real two-rank
``cpu-async`` run (whose ranks hold an EASGD blend, not the average) the model written to
the run directory, loaded by the README's one line, scores exactly the final eval."""

from __future__ import annotations

import json

import pytest
import torch

from flodl_bus.examples import digits
from tests.e2e.harness import Cluster, new_run_id, received, records
from tests.e2e.jobs import _neg_loss, neg_loss_job

pytestmark = [pytest.mark.slow, pytest.mark.redis]


@pytest.mark.parametrize("mode", ["cpu-async", "nccl-cadence"])
def test_the_model_left_in_the_run_directory_is_the_consensus_the_final_eval_scored(
    cluster: Cluster, mode: str
) -> None:
    run = new_run_id("consensus")
    coord = cluster.coordinator(
        run, "--mode", mode, "--world-size", "2", "--epochs", "2", job="tests.e2e.jobs:neg_loss_job"
    )
    workers = cluster.ranked_workers(run, 2, "--mode", mode)
    assert cluster.wait([coord, *workers], timeout=180) == [0, 0, 0], cluster.tails()
    run_dir = cluster.run_dir(run)
    final = [m for m in received(records(run_dir), "EvalResult") if int(m["epoch"]) == 2]
    assert len(final) == 1 and final[0]["error"] is None, final
    meta = json.loads((run_dir / "consensus.meta.json").read_text())
    assert meta["reason"] == "graceful_shutdown"

    torch.set_num_threads(1)  # as the ranks ran (OMP_NUM_THREADS=1)
    model = neg_loss_job.build_model()
    model.load_state_dict(torch.load(run_dir / "consensus.model.pt"))  # the README's line
    model.eval()
    assert _neg_loss(model, digits.eval_data()) == float(final[0]["metric"])
