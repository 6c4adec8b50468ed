"""``bench coordinator`` drives a real core through its reduces in every mode it offers.

The figures are measurements (BENCHMARKS.md); this pins that the synthetic ranks still
speak the protocol well enough for the core to reach its reduces (the bench had stopped
at its first turn without one once probe chunks and bridges came)."""

from __future__ import annotations

import pytest

from flodl_bus.bench.coordinator import main, run_once


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence", "cpu-sync"])
def test_every_mode_reaches_its_reduces_with_ranks_at_four_speeds(mode: str) -> None:
    sample = run_once(mode, 8, 4)
    assert sample.reduces >= 4
    assert sample.messages > 8 * 4
    assert sample.msg_us > 0 and sample.reduce_us > 0


def test_the_command_prints_each_point_beside_the_codec_reference(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(["--ranks", "4,8", "--modes", "cpu-cadence", "--reduces", "3", "--repeats", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert "reference: wire encode+decode of one Batch" in out
    assert "per-rank reduce cost at 8 vs 4 ranks" in out


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence"])
def test_the_survivors_of_a_mass_death_reach_their_reduces(mode: str) -> None:
    sample = run_once(mode, 8, 4, dead=0.5)
    assert sample.reduces >= 3  # counted from the deaths on
    assert sample.messages > 4 * 3


def test_a_dead_share_outside_zero_to_one_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--ranks", "4", "--dead", "1.0"])
    assert "--dead" in capsys.readouterr().err
