"""``flodl-bus up`` refuses bad configuration at once, before starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_bus.launch.jobref import check_job_ref
from flodl_bus.launch.outcome import run_batches
from flodl_bus.launch.up import main


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--job", "no_such_module_xyz:job"], "no module no_such_module_xyz"),
        (["--job", "flodl_bus.examples"], "expected MODULE:NAME"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--run", "bad{run}"], "invalid run id"),
    ],
)
def test_bad_configuration_exits_2_naming_the_fix_and_starts_nothing(
    argv: list[str], says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("FLODL_NUM_THREADS", "many", "FLODL_NUM_THREADS='many': use a thread count"),
        ("FLODL_TUNE_THREADS", "yes", "FLODL_TUNE_THREADS='yes': use 1"),
        ("FLODL_KEEP_CORE", "on", "FLODL_KEEP_CORE='on': use 1"),
    ],
)
def test_a_thread_setting_every_rank_would_refuse_exits_2_in_one_line_and_starts_nothing(
    var: str, value: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(var, value)
    assert main([]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_a_job_reference_is_checked_without_importing_it() -> None:
    assert check_job_ref("flodl_bus.examples.charrnn:job") is None
    assert check_job_ref("flodl_bus.nothing_here:job") is not None


def test_the_run_bars_total_is_every_ranks_batches_of_every_epoch() -> None:
    header = {"config": {"total_samples": 1000, "batch_size": 32, "num_epochs": 3,
                         "world_size": 2}}  # fmt: skip
    assert run_batches(header) == 96  # ceil(1000/32)=32 per epoch, 3 epochs
    assert run_batches({"config": {}}) is None
    assert run_batches({}) is None


def test_the_runs_epochs_reach_coordinator_and_every_rank_so_the_lr_schedule_agrees() -> None:
    from flodl_bus.launch.up_args import _parser, coordinator_argv, worker_argv

    args = _parser().parse_args(["--epochs", "8", "--workers", "2"])
    coord = coordinator_argv(args, "r", Path("runs/r"))
    assert coord[coord.index("--epochs") + 1] == "8"
    for rank in (0, 1):
        argv = worker_argv(args, "r", rank, Path("runs/r"))
        assert argv[argv.index("--epochs") + 1] == "8"
    # Without --epochs nobody is told: the coordinator and the ranks use the job's.
    args = _parser().parse_args([])
    assert "--epochs" not in worker_argv(args, "r", 0, Path("runs/r"))


def test_a_run_that_cannot_reach_redis_exits_2_and_its_record_ends_in_a_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from flodl_bus.record.log import read_records

    monkeypatch.chdir(tmp_path)
    # Port 1 refuses at once: nothing listens there.
    assert main(["--run", "nored", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in err
    records = read_records(tmp_path / "runs" / "nored" / "up.jsonl")
    summary = records[-1]
    assert summary["event"] == "summary" and summary["started"] is False
    assert summary["exit_code"] == 2 and "cannot reach Redis" in summary["error"]
