"""``--checkpoint-at-epoch`` in a real two-rank run: the checkpoint role rank writes a
checkpoint as the run enters each named epoch, and at no other."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.harness import Cluster, new_run_id, records

pytestmark = [pytest.mark.slow, pytest.mark.redis]

EPOCHS = 5


def _asked(recs: list[dict[str, object]]) -> list[int]:
    """Versions of the ``Checkpoint`` messages the coordinator sent (the epoch entered)."""
    out = []
    for rec in recs:
        for o in rec.get("out", ()):  # type: ignore[attr-defined]
            if o.get("kind") == "Send" and o["msg"]["type"] == "Checkpoint":
                out.append(int(o["msg"]["version"]))
    return out


@pytest.mark.parametrize("mode", ["cpu-cadence", "nccl-cadence"])
def test_a_run_writes_checkpoints_exactly_at_the_epochs_named(
    cluster: Cluster, tmp_path: Path, mode: str
) -> None:
    stem = tmp_path / "ckpt" / "digits"
    run = new_run_id("ckpt-at")
    common = ("--mode", mode, "--world-size", "2")
    coord = cluster.coordinator(
        run, *common, "--epochs", str(EPOCHS), "--save-path", str(stem),
        "--checkpoint-at-epoch", "1,3",
    )  # fmt: skip
    workers = cluster.ranked_workers(run, 2, "--mode", mode)
    assert cluster.wait([coord, *workers], timeout=180) == [0, 0, 0], cluster.tails()

    written = sorted(p.name for p in stem.parent.glob(f"{stem.name}.v*.pt"))
    assert written == ["digits.v1.pt", "digits.v3.pt"], written
    assert _asked(records(cluster.run_dir(run))) == [1, 3]
    for name in written:  # a model's state dict, trained (not the initial weights only)
        state = torch.load(stem.parent / name, weights_only=True)
        assert state and all(torch.isfinite(t).all() for t in state.values())
