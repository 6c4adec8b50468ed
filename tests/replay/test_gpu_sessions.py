"""Runs recorded on a real H200 machine (CUDA ranks, NCCL collectives through the Redis
store) replay identically here on the CPU: the record, not the GPU, is the input.

They were recorded before records carried a digest chain, so nothing proves they are what
their processes wrote: they replay through the same engine (``verify=False``), and the
CLI refuses to call them identical. Recording them again on a GPU machine
(``scripts/gpu/suite.sh train1 train2``) gives them a chain."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_bus.replay import Recording
from flodl_bus.replay.cli import DAMAGED, main
from flodl_bus.replay.testing import assert_identical, recorded_sessions

GPU_SESSIONS = recorded_sessions(Path(__file__).resolve().parents[1] / "sessions_gpu")


def test_the_gpu_sessions_are_here() -> None:
    assert {p.name for p in GPU_SESSIONS} == {
        "h200-1rank-nccl-cadence",
        "h200-2rank-nccl-cadence",
    }


@pytest.mark.parametrize(
    "recorded_run", GPU_SESSIONS, indirect=True, ids=[p.name for p in GPU_SESSIONS]
)
def test_a_gpu_run_replays_identically_on_the_cpu_but_is_not_verified(
    recorded_run: dict[str, Recording], capsys: pytest.CaptureFixture[str]
) -> None:
    path = next(iter(recorded_run.values())).path
    assert path is not None
    assert main([str(path.parent)]) == DAMAGED
    assert "no digest chain" in capsys.readouterr().err
    results = assert_identical(recorded_run, verify=False)
    assert "coordinator" in results and "rank:0" in results
    assert all(r.replayed > 100 for r in results.values())
