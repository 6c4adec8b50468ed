"""``flodl-bus bench kill`` on CPU ranks (gloo): a real kill, real recovery, real figures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flodl_bus.bench.kill import _events, main

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def test_console_log_fields_are_read_back_per_event(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text(
        "18:26:06 [warning  ] rank_declared_dead             mono=569.527 rank=1\n"
        "18:26:06 [info     ] rank_declared_dead_late        mono=1.0\n"
        "18:26:07 [warning  ] rank_declared_dead             mono=570.5 rank=2\n"
    )
    assert [e["mono"] for e in _events(log, "rank_declared_dead")] == ["569.527", "570.5"]


def test_three_cpu_ranks_one_killed_report_detection_reform_first_collective_and_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The slow job sleeps in every step: the epochs after the kill last at least a few
    # seconds of wall time however loaded the machine is, so the kill (issued once
    # metrics.csv shows the first epoch) always lands before the run's end. Rank 0 is
    # made slower on top (bench.slow), and an undisturbed run of the same world comes
    # first for the final eval.
    argv = ["--workers", "3", "--epochs", "5", "--job", "tests.e2e.jobs:slow_job"]
    argv += ["--slow-rank", "0", "--slow-factor", "2", "--reference"]
    assert main([*argv, "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    seconds = {what: float(s) for what, s in re.findall(r"kill -> (.+?)\s{2,}(\d+\.\d+) s", out)}
    assert set(seconds) == {
        "DeclareDead at the coordinator",
        "new group announced to the survivors",
        "first collective on the new group",
        "every process exited",
    }, out
    # Death is only declared once the rank was silent for the heartbeat timeout (3 s),
    # counted from its last message, at most one heartbeat interval (1 s) before the kill.
    assert seconds["DeclareDead at the coordinator"] >= 2.0
    assert (
        seconds["DeclareDead at the coordinator"]
        <= seconds["new group announced to the survivors"]
        <= seconds["first collective on the new group"]
        <= seconds["every process exited"]
    )
    assert "exit codes: coordinator 0, rank0 0, rank1 0, rank2 -9" in out
    assert "epochs in metrics.csv: 5 of 5" in out
    assert "rank 0 2x slower" in out
    assert re.search(r"sockets before the kill: \d+ TCP endpoints .*, all on loopback", out), out
    assert "every sample of every epoch trained exactly once" in out
    # Five epochs of shares; the last ones went to the two survivors alone.
    shares = re.findall(r"epoch +(\d+) +([\d.]+) / ([\d.]+) / ([\d.]+) +\((.+?)\)", out)
    assert [int(e) for e, *_ in shares] == list(range(5)), out
    assert shares[0][4] == "rank 2 sent work" and shares[-1][4] == "survivors only"
    assert float(shares[-1][3]) == 0.0
    assert all(abs(sum(float(x) for x in row[1:4]) - 1.0) < 0.002 for row in shares)
    assert re.search(r"final eval 0\.\d+; undisturbed run 0\.\d+ \([+-]\d+\.\d+ points\)", out)
    assert "replay of the records on the CPU (flodl-bus replay --allow-incomplete): exit 0" in out
    assert re.search(r"rank:2: identical \(\d+ dispatches\), up to line \d+", out), out
    assert "run ended: completed" in out


def test_a_killed_rank_of_a_sync_world_keeps_the_batches_it_trained_and_coverage_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without progressive dispatch the dead rank's processed batches stay its own (flodl's
    # rule) and only its remainder goes to the survivors: metrics.csv, which holds what
    # ranks reported, falls short by those batches, and the coverage check must take the
    # coordinator's count of them instead.
    argv = ["--workers", "3", "--epochs", "5", "--job", "tests.e2e.jobs:slow_job"]
    assert main([*argv, "--mode", "nccl-sync", "--no-replay", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "every sample of every epoch trained exactly once" in out, out
    assert "replay of the records" not in out
