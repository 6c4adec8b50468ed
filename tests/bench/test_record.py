from __future__ import annotations

import pytest

from flodl_bus.bench.record import main


def test_bench_record_prints_costs_beside_the_core_and_replay_rates(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--dispatches", "200", "--repeats", "1", "--digits-epochs", "0", "--memory", "100",
            "--summary-ranks", "32"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "rank dispatch:" in out and "(core dispatch itself" in out
    assert "coordinator dispatch:" in out and "(core handle itself" in out
    assert "dispatches/s" in out
    assert "   32 ranks: " in out and "(read whole " in out and "budget 781.2 us)" in out
    assert "target: <= 15 us per dispatch" in out and "target: >= 20,000 dispatches/s" in out
    # the replay of a healthy record prints nothing on stderr, whatever its length
    assert out.count("line(s) on stderr") == 2 and "(exit 0, 0 line(s) on stderr)" in out
