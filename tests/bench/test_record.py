from __future__ import annotations

import pytest

from flodl_bus.bench.record import main


def test_bench_record_prints_costs_beside_the_core_and_replay_rates(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--dispatches", "200", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank dispatch:" in out and "(core dispatch itself" in out
    assert "coordinator dispatch:" in out and "(core handle itself" in out
    assert "dispatches/s" in out
