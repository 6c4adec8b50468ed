"""The run's knobs: flags beat ``--config run.toml`` beat the defaults; bad values and
unknown keys are one line naming the fix; the ranks' share round-trips through meta."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from flodl_bus import settings
from flodl_bus.coordinator.cli import config_knobs
from flodl_bus.coordinator.config import CoordinatorConfig, MaxFailure
from flodl_bus.launch.up_args import _parser as up_parser
from flodl_bus.launch.up_args import coordinator_argv, worker_argv


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    return p.parse_args(list(argv))


def test_defaults_are_flodls() -> None:
    v = settings.resolve(parse())
    assert v["lr_scale_ratio"] == 1.0 and v["meta_controller"] is True
    assert v["guard"] == "trend" and v["outer"] == "none" and v["seed"] == 42
    assert v["overhead_target"] == 0.05 and v["epoch_splits"] == 1


def test_a_jobs_own_ask_beats_the_default_but_not_the_file_nor_a_flag(tmp_path: Path) -> None:
    asks = {"lr_scale_ratio": 0.0}
    assert settings.resolve(parse(), asks)["lr_scale_ratio"] == 0.0
    assert settings.resolve(parse(), {})["lr_scale_ratio"] == 1.0
    toml = tmp_path / "run.toml"
    toml.write_text("lr_scale_ratio = 0.5\n")
    assert settings.resolve(parse("--config", str(toml)), asks)["lr_scale_ratio"] == 0.5
    flagged = parse("--config", str(toml), "--lr-scale-ratio", "1.0")
    assert settings.resolve(flagged, asks)["lr_scale_ratio"] == 1.0


def test_a_flag_beats_the_file_and_the_file_beats_the_default(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(
        'seed = 7\nanchor = 20\nouter = "nesterov"\nouter_lr = 0.7\n'
        'meta_controller = false\nmax-failure = "25%"\n'
    )
    v = settings.resolve(parse("--config", str(toml), "--anchor", "5"))
    assert v["seed"] == 7 and v["anchor"] == 5 and v["outer"] == "nesterov"
    assert v["outer_lr"] == 0.7 and v["meta_controller"] is False
    assert v["max_failure"] == "25%" and v["max_overshoot"] is None


@pytest.mark.parametrize(
    ("toml", "fix"),
    [
        ("sead = 1\n", "unknown key 'sead'; known keys: seed"),
        ('outer = "adam"\n', "outer: 'adam' is not one of none, nesterov, slow-momentum"),
        ("overhead_target = 0.9\n", "overhead_target: must be >= 0.01 and <= 0.5"),
        ("epoch_splits = 0\n", "epoch_splits: must be >= 1"),
        ("seed = [1\n", "--config"),
        # out of range: refused in one line before anything starts (issue 28)
        ("anchor = 1e20\n", "anchor: expected an integer"),
        ("anchor = 100000000000000000000\n", "anchor: must be >= 1 and <= 1000000000"),
        (f"seed = {2**64}\n", f"seed: must be >= 0 and <= {2**63 - 1}"),
    ],
)
def test_a_bad_config_file_names_the_key_and_the_fix(tmp_path: Path, toml: str, fix: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(settings.SettingsError, match="--config") as exc:
        settings.resolve(parse("--config", str(path)))
    assert fix in str(exc.value)


def test_a_missing_config_file_and_a_bad_flag_are_named() -> None:
    with pytest.raises(settings.SettingsError, match="no file at"):
        settings.resolve(parse("--config", "/nonexistent/run.toml"))
    with pytest.raises(settings.SettingsError, match=r"--easgd-alpha: must be > 0\.0"):
        settings.resolve(parse("--easgd-alpha", "0"))
    with pytest.raises(settings.SettingsError, match=r"--max-failure: must be > 0\.0"):
        settings.resolve(parse("--max-failure", "0%"))


def test_the_ranks_share_round_trips_through_meta_and_an_old_meta_scales_nothing() -> None:
    v = settings.resolve(
        parse("--seed", "9", "--easgd-alpha", "0.3", "--outer", "slow-momentum", "--anchor", "3")
    )
    meta = settings.to_meta(v)
    assert "anchor" not in meta  # the coordinator's alone
    back = settings.from_meta(meta)
    assert back["seed"] == 9 and back["easgd_alpha"] == 0.3 and back["outer"] == "slow-momentum"
    assert back["outer_lr"] is None and back["lr_scale_ratio"] == 1.0
    assert settings.from_meta({})["lr_scale_ratio"] == 0.0


def test_the_coordinator_builds_its_config_from_the_knobs() -> None:
    v = settings.resolve(
        parse(
            "--max-failure", "25%", "--callback-rank", "1", "--max-batch-diff", "2",
            "--max-overshoot", "6", "--guard", "msf", "--epoch-splits", "2", "--seed", "3",
        )
    )  # fmt: skip
    cfg = CoordinatorConfig(
        mode="cpu-async", world_size=2, total_samples=100, batch_size=1, num_epochs=1,
        **config_knobs(v),
    )  # fmt: skip
    assert cfg.max_failure == MaxFailure(percent=0.25) and cfg.epoch_callback_rank == 1
    assert cfg.max_batch_diff == 2 and cfg.max_overshoot == 6 and cfg.guard == "msf"
    assert cfg.epoch_splits == 2 and cfg.seed == 3
    assert config_knobs(settings.resolve(parse("--max-failure", "2")))["max_failure"] == (
        MaxFailure(absolute=2)
    )


def test_up_hands_the_settings_to_the_coordinator_alone(tmp_path: Path) -> None:
    args = up_parser().parse_args(
        ["--workers", "2", "--config", "run.toml", "--outer", "nesterov", "--anchor", "4"]
    )
    coord = coordinator_argv(args, "r", tmp_path)
    i = coord.index("--config")
    assert coord[i : i + 6] == ["--config", "run.toml", "--anchor", "4", "--outer", "nesterov"]
    worker = worker_argv(args, "r", 0, tmp_path)
    assert "--outer" not in worker and "--config" not in worker


def test_slack_hints_and_advisories_are_reachable_by_flag_and_file(tmp_path: Path) -> None:
    assert settings.resolve(parse())["callback_slack"] is True  # flodl's default
    assert settings.resolve(parse())["stage_advisories"] is False  # see BENCHMARKS
    toml = tmp_path / "run.toml"
    toml.write_text("speed_hints = [1.0, 2.5]\nstage_advisories = true\n")
    v = settings.resolve(parse("--config", str(toml), "--callback-slack", "false"))
    assert v["speed_hints"] == (1.0, 2.5)
    cfg = CoordinatorConfig(
        mode="cpu-cadence", world_size=2, total_samples=100, batch_size=1, num_epochs=1,
        **config_knobs(v),
    )  # fmt: skip
    assert cfg.speed_hints == (1.0, 2.5) and cfg.stage_advisories is True
    assert cfg.callback_slack is False
    assert settings.resolve(parse("--speed-hints", "1,3,2"))["speed_hints"] == (1.0, 3.0, 2.0)


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        (["--speed-hints", "1,0"], "--speed-hints: must be > 0.0"),
        (["--speed-hints", ","], "--speed-hints: expected one speed per rank"),
        (["--callback-slack", "maybe"], "--callback-slack: expected true or false"),
    ],
)
def test_a_bad_hint_or_switch_is_named_with_its_fix(argv: list[str], fix: str) -> None:
    with pytest.raises(settings.SettingsError) as exc:
        settings.resolve(parse(*argv))
    assert fix in str(exc.value)


def test_a_callback_rank_or_hints_outside_the_world_are_refused_in_one_line() -> None:
    v = settings.resolve(parse("--callback-rank", "99"))
    assert settings.world_mismatch(v, 3) == (
        "--callback-rank 99 is not a rank of 3 worker(s): use 0..2, or leave it unset"
    )
    assert settings.world_mismatch(settings.resolve(parse("--callback-rank", "2")), 3) is None
    hints = settings.resolve(parse("--speed-hints", "1,2"))
    assert "2 speed(s) for 3 worker(s)" in (settings.world_mismatch(hints, 3) or "")
    with pytest.raises(ValueError, match="callback_rank 99 is not a rank of this world of 3"):
        CoordinatorConfig(
            mode="cpu-cadence", world_size=3, total_samples=100, batch_size=1, num_epochs=1,
            **config_knobs(v),
        )  # fmt: skip


def test_speed_hints_for_another_world_size_are_refused() -> None:
    v = settings.resolve(parse("--speed-hints", "1,2,3"))
    with pytest.raises(ValueError, match="one positive entry per rank"):
        CoordinatorConfig(
            mode="cpu-cadence", world_size=2, total_samples=100, batch_size=1, num_epochs=1,
            **config_knobs(v),
        )  # fmt: skip


def test_relax_up_is_off_by_default_and_reachable_by_flag_file_and_up(tmp_path: Path) -> None:
    assert settings.resolve(parse())["relax_up"] is False  # flodl's default
    toml = tmp_path / "run.toml"
    toml.write_text("relax_up = true\n")
    v = settings.resolve(parse("--config", str(toml)))
    cfg = CoordinatorConfig(
        mode="cpu-async", world_size=2, total_samples=100, batch_size=1, num_epochs=1,
        **config_knobs(v),
    )  # fmt: skip
    assert cfg.relax_up is True
    flag = settings.resolve(parse("--config", str(toml), "--relax-up", "false"))
    assert flag["relax_up"] is False
    args = up_parser().parse_args(["--workers", "2", "--relax-up", "true"])
    coord = coordinator_argv(args, "r", tmp_path)
    assert coord[coord.index("--relax-up") + 1] == "true"
    assert "--relax-up" not in worker_argv(args, "r", 0, tmp_path)


def test_the_anchors_floor_and_ceiling_are_reachable_by_flag_and_file(tmp_path: Path) -> None:
    v = settings.resolve(parse())
    assert v["max_anchor"] == 1000 and v["min_anchor"] is None  # flodl's defaults
    toml = tmp_path / "run.toml"
    toml.write_text("min_anchor = 20\n")
    v = settings.resolve(parse("--config", str(toml), "--max-anchor", "200"))
    cfg = CoordinatorConfig(
        mode="cpu-cadence", world_size=2, total_samples=100, batch_size=1, num_epochs=1,
        **config_knobs(v),
    )  # fmt: skip
    assert cfg.min_anchor == 20 and cfg.max_anchor == 200


def test_a_run_file_holds_the_launch_keys_too_and_the_knobs_skip_them(tmp_path: Path) -> None:
    """Issue 30: `--config` refused mode, workers, epochs and job, so a run could not
    live in one file."""
    path = tmp_path / "run.toml"
    path.write_text(
        'job = "flodl_bus.examples.charrnn:job"\nmode = "cpu-sync"\nworkers = 3\n'
        "epochs = 4\neval-every = 2\nseed = 9\n"
    )
    assert settings.read_launch(path) == {
        "job": "flodl_bus.examples.charrnn:job",
        "mode": "cpu-sync",
        "workers": 3,
        "epochs": 4,
        "eval_every": 2,
    }
    assert settings.resolve(parse("--config", str(path)))["seed"] == 9  # knobs unaffected
    path.write_text("workers = 0\n")
    with pytest.raises(settings.SettingsError, match="workers: use a whole number of 1 or more"):
        settings.read_launch(path)


def test_up_takes_the_launch_keys_of_its_run_file_and_a_flag_beats_them(tmp_path: Path) -> None:
    from flodl_bus.launch.up_args import _launch_keys_from_file, _parser

    path = tmp_path / "run.toml"
    path.write_text('mode = "cpu-sync"\nworkers = 3\nepochs = 4\n')
    given = ["--config", str(path), "--workers", "1"]
    args = _parser().parse_args(given)
    _launch_keys_from_file(args, given)
    assert (args.mode, args.workers, args.epochs) == ("cpu-sync", 1, 4)
    path.write_text('mode = "gpu-magic"\n')
    with pytest.raises(ValueError, match="mode 'gpu-magic'; use one of nccl-sync"):
        _launch_keys_from_file(_parser().parse_args(["--config", str(path)]), [])


def test_checkpoint_at_epoch_is_reachable_by_flag_file_and_up_and_off_by_default(
    tmp_path: Path,
) -> None:
    assert settings.resolve(parse())["checkpoint_at_epoch"] is None  # flodl's: none
    toml = tmp_path / "run.toml"
    toml.write_text("checkpoint_at_epoch = [5, 2]\n")
    v = settings.resolve(parse("--config", str(toml)))
    assert v["checkpoint_at_epoch"] == (2, 5)
    cfg = CoordinatorConfig(
        mode="cpu-cadence", world_size=2, total_samples=100, batch_size=1, num_epochs=6,
        **config_knobs(v),
    )  # fmt: skip
    assert cfg.checkpoint_at_epoch == (2, 5)
    assert settings.resolve(parse("--checkpoint-at-epoch", "3"))["checkpoint_at_epoch"] == (3,)
    with pytest.raises(settings.SettingsError, match="must be >= 1"):
        settings.resolve(parse("--checkpoint-at-epoch", "0,2"))
    args = up_parser().parse_args(["--workers", "2", "--checkpoint-at-epoch", "1,3"])
    coord = coordinator_argv(args, "r", tmp_path)
    assert coord[coord.index("--checkpoint-at-epoch") + 1] == "1,3"
    assert "--checkpoint-at-epoch" not in worker_argv(args, "r", 0, tmp_path)


def test_bf16_wire_is_off_by_default_and_reaches_the_ranks_through_meta(tmp_path: Path) -> None:
    assert settings.resolve(parse())["bf16_wire"] is False  # flodl's default
    v = settings.resolve(parse("--bf16-wire", "true"))
    meta = settings.to_meta(v)
    assert meta["bf16_wire"] == "True"
    assert settings.from_meta(meta)["bf16_wire"] is True
    assert settings.from_meta({})["bf16_wire"] is False  # a run published before it
    args = up_parser().parse_args(["--workers", "2", "--bf16-wire", "true"])
    coord = coordinator_argv(args, "r", tmp_path)
    assert coord[coord.index("--bf16-wire") + 1] == "true"


def test_a_run_file_may_name_a_script_beside_it_with_its_arguments_instead_of_a_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flodl_bus.launch.up_args import _parser, check_args

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "train.py").write_text("")
    path = conf / "run.toml"
    path.write_text('script = "train.py"\nscript_args = ["--epochs", "2"]\nworkers = 2\n')
    monkeypatch.chdir(tmp_path)  # not the file's folder: the script is found beside it

    def up(*given: str) -> Any:
        args = _parser().parse_args(["--config", str(path), *given])
        args.script_args = []
        return args, check_args(args, ["--config", str(path), *given])

    args, wrong = up()
    assert wrong is None, wrong
    assert (args.script, args.script_args, args.job) == (
        str(conf / "train.py"),
        ["--epochs", "2"],
        None,
    )
    # a flag beats the file: --job trains the job and drops the file's script and its args
    args, wrong = up("--job", "flodl_bus.examples.digits:job")
    assert wrong is None and args.script is None and args.script_args == []
    path.write_text('job = "flodl_bus.examples.digits:job"\nscript = "train.py"\n')
    assert up()[1] == f"--config {path}: job and script exclude each other: keep one"
    path.write_text('script_args = ["-v"]\n')
    assert up()[1] == f"--config {path}: script_args without a script"
    path.write_text('script = "train.py"\nscript_args = "--epochs 2"\n')
    assert "script_args: use a list of strings" in str(up()[1])
    path.write_text('script = "missing.py"\n')
    assert f"--script {str(conf / 'missing.py')!r}: no such file" == up()[1]
