"""The pieces of a script's own loop that work without a run: how the coordinator reads
a script's job (``describe_script``), how ``up`` hands a script its rank, and the
refusals of a ``Rank`` used wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flodl_bus.examples import digits, digits_own_loop
from flodl_bus.job import JobError, describe_script
from flodl_bus.launch.up_args import (
    _parser,
    check_script,
    coordinator_argv,
    script_tail,
    split_script,
    worker_argv,
    worker_env,
)
from flodl_bus.worker.options import ENV_WORKER_ARGV, parser
from flodl_bus.worker.script import Rank


def test_the_coordinator_reads_the_examples_job_from_its_rank_without_training() -> None:
    job = describe_script(digits_own_loop.__file__, ["--epochs", "3", "--batch-size", "16"])
    assert (job.name, job.num_epochs, job.batch_size) == ("digits-own-loop", 3, 16)
    assert len(job.train_data()) == len(digits.train_data())
    assert job.eval_fn is not None and job.target_metric == 0.9


def test_a_script_that_never_makes_a_rank_or_raises_is_one_line(tmp_path: Path) -> None:
    none = tmp_path / "none.py"
    none.write_text("x = 1\n")
    with pytest.raises(SystemExit, match=r"ended without making a flodl_bus\.Rank"):
        describe_script(str(none), [])
    bad = tmp_path / "bad.py"
    bad.write_text("raise ValueError('no data here')\n")
    with pytest.raises(JobError, match="the script raised ValueError: no data here"):
        describe_script(str(bad), [])
    with pytest.raises(SystemExit, match="no such file"):
        describe_script(str(tmp_path / "missing.py"), [])


def test_a_script_run_outside_a_run_says_how_to_start_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_WORKER_ARGV, raising=False)
    rank = Rank(*_tiny(), batch_size=4, epochs=1)
    with pytest.raises(SystemExit, match="flodl-bus up --script"), rank:
        pass
    with pytest.raises(RuntimeError, match="without a batch"):
        rank.step(1.0)


def _tiny() -> tuple[object, ...]:
    model = digits.build_model()
    return model, digits.build_optimizer(model), digits.train_data()


def test_up_splits_the_scripts_arguments_off_and_hands_each_rank_its_worker_flags(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    given, tail = split_script(["--workers", "3", "--script", str(script), "--workers", "9"])
    assert tail == ["--workers", "9"]  # the script's own flag, not up's
    args = _parser().parse_args(given)
    args.script_args = tail
    assert check_script(args) is None and args.workers == 3
    run_dir = tmp_path / "runs" / "r"
    coord = [*coordinator_argv(args, "r", run_dir), *script_tail(args)]
    assert coord[coord.index("--script") + 1] == str(script)
    assert coord[-3:] == ["--", "--workers", "9"] and "--job" not in coord
    assert worker_argv(args, "r", 2, run_dir)[1:] == [str(script), "--workers", "9"]
    flags = json.loads(worker_env(args, "r", 2, run_dir)[ENV_WORKER_ARGV])
    worker = parser().parse_args(flags)  # what the script's Rank joins with
    assert (worker.run, worker.rank, worker.world_size, worker.job) == ("r", 2, 3, None)


def test_up_refuses_a_job_and_a_script_together_and_a_missing_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    args = _parser().parse_args(["--job", "m:job", "--script", str(script)])
    assert check_script(args) == "--job and --script exclude each other: train a Job or a script"
    args = _parser().parse_args(["--script", str(tmp_path / "missing.py")])
    assert "no such file" in str(check_script(args))
    args = _parser().parse_args([])
    assert check_script(args) is None and args.job == "flodl_bus.examples.digits:job"
    assert worker_env(args, "r", 0, tmp_path) == {}
