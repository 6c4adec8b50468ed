"""Runs recorded on a real H200 machine (CUDA ranks, NCCL collectives through the Redis
store, Python 3.12) replay identically here on the CPU, under this machine's Python: the
record, not the GPU, is the input.

``h200-1rank-nccl-cadence`` was recorded after records carried a digest chain and after
the core's float sums stopped depending on the Python version (``coordinator.numeric``),
so it replays verified. ``h200-2rank-nccl-cadence`` predates both: nothing proves it is
what its processes wrote, so it replays through the same engine with ``verify=False``
and the CLI refuses to call it identical. Recording it again needs two GPUs
(``scripts/gpu/suite.sh train2``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_bus.replay import Recording
from flodl_bus.replay.cli import DAMAGED, IDENTICAL, main
from flodl_bus.replay.testing import assert_identical, recorded_sessions

ROOT = Path(__file__).resolve().parents[1] / "sessions_gpu"
GPU_SESSIONS = recorded_sessions(ROOT)
CHAINED = ROOT / "h200-1rank-nccl-cadence"
UNCHAINED = ROOT / "h200-2rank-nccl-cadence"


def test_the_gpu_sessions_are_here() -> None:
    assert set(GPU_SESSIONS) == {CHAINED, UNCHAINED}


@pytest.mark.parametrize("recorded_run", [CHAINED], indirect=True, ids=[CHAINED.name])
def test_a_chained_gpu_run_recorded_under_another_python_replays_verified_and_identical(
    recorded_run: dict[str, Recording], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(CHAINED)]) == IDENTICAL, capsys.readouterr()
    results = assert_identical(recorded_run)
    assert set(results) == {"coordinator", "rank:0"}
    assert all(r.replayed > 300 for r in results.values())


@pytest.mark.parametrize("recorded_run", [UNCHAINED], indirect=True, ids=[UNCHAINED.name])
def test_an_unchained_gpu_run_replays_identically_on_the_cpu_but_is_not_verified(
    recorded_run: dict[str, Recording], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(UNCHAINED)]) == DAMAGED
    assert "no digest chain" in capsys.readouterr().err
    results = assert_identical(recorded_run, verify=False)
    assert "coordinator" in results and "rank:0" in results
    assert all(r.replayed > 100 for r in results.values())
