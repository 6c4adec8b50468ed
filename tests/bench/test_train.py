"""``flodl-bus bench train``: the contenders really train, time to target is read off the
eval cadence, and a slowed rank is slowed on that rank only, by the factor asked."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from flodl_bus.bench import slow
from flodl_bus.bench.baselines import ddp_loop, plain_loop
from flodl_bus.bench.breakdown import BLOCKS, PROFILE
from flodl_bus.bench.train import _parser, _to_target, _up_command, main
from flodl_bus.job import load_job


def test_time_to_target_is_the_end_of_the_first_epoch_whose_eval_reached_it() -> None:
    evals = [(0, 1.0, 0.5), (1, 2.0, 0.91), (2, 3.0, 0.89), (3, 4.0, 0.95)]
    assert _to_target(evals, 0.9) == (2.0, 1)
    assert _to_target(evals, 0.99) is None
    assert _to_target(evals, None) is None


def test_up_args_reach_every_bus_run_after_the_benchs_own_flags() -> None:
    args = _parser().parse_args(["--up-args", "--bridges false --eval-every 2"])
    cmd = _up_command(args, "j:job", "cpu-cadence", Path("runs/x"))
    assert cmd[cmd.index("up") :][-4:] == ["--bridges", "false", "--eval-every", "2"]
    assert "--bridges" not in _up_command(
        _parser().parse_args([]), "j:job", "cpu-cadence", Path("x")
    )


def test_the_plain_loop_evaluates_on_the_cadence_and_reports_the_last_eval() -> None:
    job = load_job("flodl_bus.examples.digits:job")
    r = plain_loop(job, "cpu", 3, eval_every=2)
    # epochs 1 (the cadence) and 2 (the last); times grow, evals are real accuracies
    assert [e[0] for e in r.evals] == [1, 2]
    assert 0 < r.evals[0][1] < r.evals[1][1] <= r.wall_s
    assert r.metric == r.evals[-1][2] and 0.5 < r.metric <= 1.0
    assert r.steps == 3 * (len(job.train_data()) // job.batch_size)


def test_the_plain_loop_sizes_its_threads_as_a_rank_at_its_default_share_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same care as our ranks: held at its share, the plain loop lost to a sized rank
    # on small models for the thread count alone.
    job = load_job("flodl_bus.examples.digits:job")
    for var in ("FLODL_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        # two epochs: the sweep and a run-off take up to some 70 steps at a share of 2
        sized = plain_loop(job, "cpu", 2)
        assert sized.threads in (1, 2)
        assert torch.get_num_threads() == sized.threads  # it trained on at the count kept
        torch.set_num_threads(2)
        monkeypatch.setenv("FLODL_NUM_THREADS", "2")  # a count asked for is kept
        assert plain_loop(job, "cpu", 1).threads is None
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_each_ddp_process_sizes_its_threads_as_a_rank_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ("FLODL_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    r = ddp_loop("flodl_bus.examples.digits:job", 1, False, 2)  # a sweep and a run-off
    assert r.threads in (1, 2)  # its share of this host's cores, then sized
    monkeypatch.setenv("FLODL_NUM_THREADS", "2")
    assert ddp_loop("flodl_bus.examples.digits:job", 1, False, 1).threads is None


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(2, 1)


def _loss(step_s: float) -> slow.LossFn:
    def loss(model: nn.Module, batch: object) -> torch.Tensor:
        time.sleep(step_s)  # the rank's own step
        return torch.zeros(())

    return loss


def test_a_rank_that_is_not_the_slow_one_runs_the_plain_loss(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RANK", "0")
    report = tmp_path / "slow.json"
    fn = slow.Slowed(_loss(0.0), rank=1, factor=3.0, report=str(report))
    for _ in range(slow.CALIBRATE + slow.WARMUP + 2 * slow.REPORT_EVERY):
        fn(_Tiny(), None)
    assert not report.exists()
    assert fn._extra_s == 0.0


def test_the_slow_rank_adds_factor_minus_one_of_its_own_step_from_its_first_steps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RANK", "1")
    report = tmp_path / "slow.json"
    fn = slow.Slowed(_loss(0.002), rank=1, factor=2.5, report=str(report))
    model = _Tiny()
    for _ in range(slow.WARMUP + 2):
        fn(model, None)
    # slowed after the warm-up, not after a calibration run at full speed
    assert fn._extra_s > 0 and not fn._fixed
    for _ in range(slow.CALIBRATE):
        fn(model, None)
    assert fn._fixed
    # the own step is measured while slowed: the interval less the busy time it held
    own = statistics.median(fn._own)
    assert 0.0019 < own < 0.05
    assert fn._extra_s == pytest.approx(1.5 * own)
    for _ in range(slow.REPORT_EVERY):
        fn(model, None)
    got = json.loads(report.read_text())
    assert got["rank"] == 1 and got["factor_asked"] == 2.5
    # each later step holds the extra busy time on top of the rank's own
    assert got["step_s_after"] >= got["step_s_before"] + fn._extra_s * 0.9
    assert got["slowdown"] >= 2.5 * 0.9


def test_the_slow_job_is_the_named_job_unless_a_slowdown_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLODL_BENCH_JOB", "flodl_bus.examples.digits:job")
    plain = load_job("flodl_bus.examples.digits:job")
    assert slow.job().loss_fn is plain.loss_fn
    monkeypatch.setenv("FLODL_SLOW_RANK", "1")
    monkeypatch.setenv("FLODL_SLOW_FACTOR", "2")
    wrapped = slow.job()
    assert isinstance(wrapped.loss_fn, slow.Slowed) and wrapped.name == plain.name


@pytest.mark.slow
@pytest.mark.redis
def test_bench_train_runs_plain_bus_and_ddp_and_prints_medians(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    argv = ["--job", "flodl_bus.examples.digits:job", "--workers", "2", "--epochs", "2"]
    argv += ["--repeats", "1", "--ddp", "--run-dir", str(tmp_path), "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    for row in ("plain x1", "bus nccl-cadence x2", "ddp x2"):
        assert any(line.startswith(row) for line in text.splitlines()), text
    got = json.loads(out.read_text())
    assert set(got["medians"]) == {"plain", "bus nccl-cadence", "ddp"}
    for name, m in got["medians"].items():
        assert m["wall"] > 0 and 0.5 < m["metric"] <= 1.0, name
    # DDP all-reduces once per step; the bus averages far less often
    assert got["medians"]["ddp"]["rounds"] > got["medians"]["bus nccl-cadence"]["rounds"] > 0
    # the bus's rounds, from its coordinator's record: NCCL's have no snapshot phase
    phases = got["runs"]["bus nccl-cadence"][0]["round_phases"]
    assert phases["rounds"] >= 1 and phases["snapshots_s"] is None
    assert 0 < phases["reduce_s"] == phases["round_s"] and phases["close_s"] is None
    assert any(line.startswith("bus nccl-cadence x2") and "rounds of" in line
               for line in text.splitlines()), text  # fmt: skip
    # every contender says where its time went, and the parts add up to the whole
    assert "where a rank's time goes" in text
    for name, runs in got["runs"].items():
        parts = runs[0]["parts"]
        assert parts["compute"] > 0, name
        assert sum(
            v for k, v in parts.items() if k not in ("total", BLOCKS, *PROFILE)
        ) == pytest.approx(parts["total"], rel=0.02, abs=0.01), name
        # and the steps' profile beside them: a median step, and a tail within compute
        assert parts["step_ms"] > 0 and 0 <= parts["tail"] <= parts["compute"], name
        # and how often the training thread blocked, counted alike for every contender
        assert parts[BLOCKS] >= 0, name
    assert "training thread blocked" in text


def test_work_shares_are_the_batches_each_rank_trained_beside_elches_counts(
    tmp_path: Path,
) -> None:
    from flodl_bus.bench.train import _shares

    # the fast rank trained beyond its planned count (a pool hands it more chunks)
    (tmp_path / "metrics.csv").write_text(
        "epoch,samples_r0,batch_share_r0,samples_r1,batch_share_r1\n"
        "0,600,0.5,400,0.5\n"
        "1,1400,0.6,600,0.4\n"
        "2,1000,0.6,0,0.4\n"
    )
    got = _shares(tmp_path, 2)
    assert got["shares"] == pytest.approx([3000 / 4000, 1000 / 4000])
    assert got["planned_shares"] == pytest.approx([0.6, 0.4])
    assert _shares(tmp_path / "none", 2) == {"shares": None, "planned_shares": None}


@pytest.mark.slow
@pytest.mark.redis
def test_a_second_bench_in_the_same_run_dir_reports_its_own_runs_not_the_earlier_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = []
    for epochs in ("1", "2"):
        out = tmp_path / f"out-{epochs}.json"
        argv = ["--job", "flodl_bus.examples.digits:job", "--workers", "1", "--no-plain"]
        argv += ["--epochs", epochs, "--modes", "cpu-cadence", "--device", "cpu"]
        argv += ["--repeats", "1", "--run-dir", str(tmp_path / "runs"), "--json", str(out)]
        assert main(argv) == 0
        steps.append(json.loads(out.read_text())["runs"]["bus cpu-cadence"][0]["steps"])
    capsys.readouterr()
    assert steps[1] == 2 * steps[0] > 0


def test_the_thread_count_each_rank_kept_is_read_from_what_it_said(tmp_path: Path) -> None:
    from flodl_bus.bench.train import _threads_kept
    from flodl_bus.worker.rank import _threads_said
    from flodl_bus.worker.threads import ThreadTuner

    tuner = ThreadTuner(2, warm_steps=0, settle_steps=0, timed_steps=1)
    tuner.observe(2.0)
    tuner.observe(1.0)
    said: list[str] = []
    _threads_said(1, said.append)(tuner)
    (tmp_path / "rank1.log").write_text(f"flodl-bus worker: {said[0]}\n")
    (tmp_path / "rank0.log").write_text("flodl-bus worker: rank 0: lr 0.001\n")
    assert _threads_kept(tmp_path, 2) == [None, 1]
    (tmp_path / "rank1.log").unlink()
    assert _threads_kept(tmp_path, 2) is None


def test_the_header_says_the_bus_ranks_lr_scale_beside_the_baselines_lr() -> None:
    import dataclasses

    from flodl_bus.bench.train import lr_line
    from flodl_bus.examples import digits

    assert "x2 (flodl's ratio 1" in lr_line(digits.job, None, 2)
    unscaled = dataclasses.replace(digits.job, lr_scale_ratio=0.0)
    assert lr_line(unscaled, None, 2) == "LR: every contender at the job's"
    assert "x1.5 (--lr-scale-ratio 0.5" in lr_line(unscaled, 0.5, 2)
    assert lr_line(digits.job, None, 1) == "LR: every contender at the job's"
