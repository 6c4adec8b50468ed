"""``flodl-bus bench scale`` runs end to end at a small N and reports every figure.

The figures themselves are measurements (BENCHMARKS.md); this pins that the bench runs
the real coordinator and simulated ranks to the end and that nothing it reports is
missing or undefined.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flodl_bus.bench.scale import ScaleResult, main
from flodl_bus.cli import BENCHES


def test_bench_scale_is_a_registered_bench() -> None:
    assert BENCHES["scale"][0] == "flodl_bus.bench.scale:main"


def test_bench_scale_with_eight_ranks_trains_every_step_and_reports_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "scale.json"
    argv = ["--ranks", "8", "--steps", "8", "--epochs", "2", "--step-ms", "20"]
    assert main([*argv, "--procs", "2", "--timeout", "120", "--json", str(out)]) == 0
    (got,) = json.loads(out.read_text())
    assert set(got) == set(ScaleResult.__dataclass_fields__)
    for name, value in got.items():
        if isinstance(value, float):
            assert math.isfinite(value), (name, value)
    assert got["ranks_clean"] == 8 and got["declared_dead"] == 0
    assert got["steps_done"] == 8 * 8 * 2
    assert got["dispatches_timed"] >= 8 * 2  # a StartEpoch or chunk per rank and epoch
    # a sleep per step: an epoch cannot take much less than the ideal (how much more is
    # the measurement)
    assert got["epoch_s"] > 0.9 * got["ideal_s"]
    assert got["stream_bytes_per_rank"] > 0 and got["record_bytes_per_step"] > 0
    printed = capsys.readouterr().out
    for label in ("epoch time", "dispatch p50", "coordinator CPU", "redis-server CPU",
                  "redis memory", "stream bytes", "record", "saturated"):  # fmt: skip
        assert label in printed
    assert main(["--ranks", "eight"]) == 2


@pytest.mark.slow
def test_bench_scale_with_cluster_runs_the_same_ranks_on_three_masters_beside_one_redis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "scale.json"
    argv = ["--ranks", "6", "--steps", "6", "--epochs", "2", "--step-ms", "20", "--cluster"]
    assert main([*argv, "--procs", "2", "--timeout", "120", "--json", str(out)]) == 0
    one, on = json.loads(out.read_text())
    assert (one["redis_masters"], on["redis_masters"]) == (1, 3)
    for got in (one, on):
        assert got["ranks_clean"] == 6 and got["declared_dead"] == 0
        assert got["steps_done"] == 6 * 6 * 2
        assert got["dispatches_timed"] >= 6 * 2
        assert math.isfinite(got["redis_cpu_busiest"])
    assert "cluster vs one Redis at 6 ranks" in capsys.readouterr().out
