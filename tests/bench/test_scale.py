"""``flodl-bus bench scale`` runs end to end at a small N and reports every figure.

The figures themselves are measurements (BENCHMARKS.md); this pins that the bench runs
the real coordinator and simulated ranks to the end and that nothing it reports is
missing or undefined.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_bus.bench import scale, scale_sizing, scale_watch
from flodl_bus.bench.scale import ScaleResult, main
from flodl_bus.bench.scale_stages import STAGE_LABELS
from flodl_bus.cli import BENCHES
from flodl_bus.coordinator.loop_profile import STAGES
from flodl_bus.record.log import read_records


def test_bench_scale_is_a_registered_bench() -> None:
    assert BENCHES["scale"][0] == "flodl_bus.bench.scale:main"


def test_bench_scale_with_eight_ranks_trains_every_step_and_reports_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLODL_SEND_THREAD", "1")  # its own line below (the default is off)
    out = tmp_path / "scale.json"
    argv = ["--ranks", "8", "--steps", "8", "--epochs", "2", "--step-ms", "20"]
    keep = tmp_path / "keep"
    argv += ["--keep", str(keep)]
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
                  "redis memory", "stream bytes", "record", "saturated",
                  "per simulated rank", "coordinator loop", "redis commands",
                  "budget at 8 ranks: step / 2N = 1250.0 µs", "largest: "):  # fmt: skip
        assert label in printed
    for label in STAGE_LABELS.values():
        assert label in printed
    # a sim rank holds at least its control reader's and its publisher's connections
    assert got["clients_per_rank"] >= 2 and got["threads_per_rank"] >= 3
    # Redis's own time a command over the epochs: the ranks' and the coordinator's reads
    # are among the busiest, and the shares are of one total
    names = [c[0] for c in got["redis_commands"]]
    assert any(n.startswith("xread") for n in names), names
    assert all(calls > 0 and us > 0 for _, calls, us, _ in got["redis_commands"])
    assert 0 < sum(c[3] for c in got["redis_commands"]) <= 1.0 + 1e-9
    assert main(["--ranks", "eight"]) == 2

    # The coordinator's own accounting of the same run adds up, and counts what it did.
    coord = json.loads((keep / "ranks8" / "coordinator.json").read_text())
    prof = coord["profile"]
    assert prof == got["loop"]
    assert all(prof[k] >= 0 for k in (*STAGES, "other", "wall_s", "cpu_s")), prof
    assert sum(prof[k] for k in STAGES) <= prof["wall_s"]
    assert prof["cpu_s"] <= prof["wall_s"] and prof["read_cpu"] <= prof["cpu_s"]
    # every upstream message the record holds as a dispatch, and nothing else
    records = read_records(keep / "ranks8" / "coordinator.jsonl")
    dispatched = [r for r in records if r.get("event") == "dispatch"]
    assert prof["messages"] == len(dispatched) == coord["dispatches"]
    # a Batch per step, a Metrics per rank and epoch, an Exiting per rank at least
    assert prof["messages"] >= 8 * 8 * 2 + 8 * 2 + 8
    # every control entry the bus wrote once the window opened (before it: only the
    # first-contact heartbeats, which the loop writes outside any core call)
    written = [s for s in coord["sent"] if s[3] >= prof["opened_at"]]
    assert all(s[2] == "CoordHeartbeat" for s in coord["sent"] if s[3] < prof["opened_at"])
    assert prof["sent"] + prof["broadcasts"] == len(written)
    # ... which are every Send and Broadcast the core returned, as the record has them
    effects = [o["kind"] for r in records for o in r.get("out") or ()]
    assert prof["sent"] == effects.count("Send")
    assert prof["broadcasts"] == effects.count("Broadcast")
    assert prof["broadcasts"] == sum(1 for s in written if s[0].endswith(":ctl:all"))
    assert 1 <= prof["send_calls"] <= len(written)
    # written by the sender thread, whose time is its own and said beside the loop's
    assert prof["sender_s"] > 0 and "sender thread: " in printed
    assert prof["ticks"] >= 1 and prof["reads"] >= prof["ticks"]
    assert prof["empty_reads"] <= prof["reads"]
    # the figures printed are this accounting per message, and they add up to the wall
    per = got["stage_us"]
    assert per["handle"] == pytest.approx(prof["handle"] * 1e6 / prof["messages"])
    total = sum(per.values()) * prof["messages"] / 1e6
    assert total == pytest.approx(prof["wall_s"])
    assert got["busiest_stage"] in (*STAGES, "other")
    assert got["busiest_stage"] not in ("idle", "read_wait")


def test_a_run_past_its_time_says_so_in_one_line_and_the_sweep_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run still going at ``--timeout`` (plus the start's grace) is stopped and named,
    with the fix, instead of a traceback about a killed process; while it runs, it says
    so every ``PROGRESS_EVERY_S``."""
    monkeypatch.setattr(scale, "START_GRACE_S", 0.0)
    monkeypatch.setattr(scale, "PROGRESS_EVERY_S", 0.5)
    out = tmp_path / "scale.json"
    argv = ["--ranks", "4,2", "--steps", "200", "--epochs", "2", "--step-ms", "50", "--procs", "1"]
    assert main([*argv, "--timeout", "3", "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert "bench scale: 4 ranks, " in err and "still running" in err
    # each says where the run has got to: the ranks' clients, rank 0's entries
    assert "clients at most so far, rank 0 has sent " in err and "its run has 400 steps" in err
    said = [x for x in err.splitlines() if "not done" in x]
    assert [x.split(":")[1] for x in said] == [" 4 ranks", " 2 ranks"]  # the next count ran
    assert all(x.endswith("no figures: raise --timeout") for x in said)
    assert json.loads(out.read_text()) == []


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


def _with_fd_limit(limit: int, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter whose file descriptors are capped (soft and hard)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=cap,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_sizing_of_4096_ranks_scales_maxclients_backlog_and_waits_with_n() -> None:
    # what 4,096 ranks need from redis-server: more clients than its 10,000 default
    assert scale_sizing.maxclients(8) == 10_000
    assert scale_sizing.maxclients(4096) >= scale_sizing.CLIENTS_PER_RANK * 4096 + 256
    assert scale_sizing.tcp_backlog(4096) >= 4096 and scale_sizing.tcp_backlog(8) == 511
    assert "--maxclients" in scale_sizing.redis_args(4096)
    # waits grow with the world, and stay where they were at the sizes measured before
    assert scale_sizing.default_heartbeat_timeout(1024) == 30.0
    assert scale_sizing.default_heartbeat_timeout(4096) == pytest.approx(60.0)
    assert scale_sizing.default_timeout(4096) > scale_sizing.default_timeout(64) >= 240.0


def test_a_host_with_too_few_file_descriptors_is_told_so_before_anything_starts() -> None:
    # 400 ranks hold some 1,200 connections: a hard limit of 1,024 cannot carry them
    got = _with_fd_limit(
        1024,
        "import sys; from flodl_bus.bench.scale import main; "
        "sys.exit(main(['--ranks', '8,400', '--procs', '2', '--steps', '1', '--epochs', "
        "'1', '--timeout', '1']))",
    )
    assert got.returncode == 2, got.stderr[-2000:]
    assert "this host cannot run 400 ranks" in got.stderr
    assert "file descriptors: the hard limit (ulimit -Hn) is 1024" in got.stderr
    assert "redis-server" in got.stderr and "ranks:" not in got.stdout
    # the same limit does for a few ranks, and the check says nothing
    ok = _with_fd_limit(
        1024,
        "from flodl_bus.bench.scale_sizing import problems; print(problems(8, 2))",
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "[]", ok.stderr[-2000:]


def test_more_ranks_than_the_cores_carry_are_refused_up_front(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cores = os.cpu_count() or 1
    too_many = scale_sizing.RANKS_PER_CORE * cores + 1
    assert any(p.startswith("CPU:") for p in scale_sizing.problems(too_many, 2))
    assert main(["--ranks", str(too_many), "--procs", "2", "--timeout", "1"]) == 2
    assert f"this host cannot run {too_many} ranks" in capsys.readouterr().err


def test_busiest_commands_are_the_counts_between_the_window_s_first_and_last_samples() -> None:
    samples = [
        (0.0, {"xadd": (10, 100)}),  # before the window: not counted
        (1.0, {"xadd": (20, 200), "evalsha": (5, 500)}),
        (2.0, {"xadd": (70, 300), "evalsha": (9, 2100), "ping": (1, 1)}),
        (3.0, {"xadd": (500, 9000), "evalsha": (500, 9000)}),  # after it
    ]
    got = scale_watch.busiest_commands(samples, 0.5, 2.5)
    # evalsha: 4 calls, 1,600 µs; xadd: 50 calls, 100 µs; ping: one call that came new
    assert [g[0] for g in got] == ["evalsha", "xadd", "ping"]
    assert got[0][1:] == (4, 400.0, pytest.approx(1600 / 1701))
    assert got[1][1:] == (50, 2.0, pytest.approx(100 / 1701))
    assert scale_watch.busiest_commands(samples, 0.5, 2.5, top=1) == got[:1]
    # a window between two samples takes the two around it
    assert scale_watch.busiest_commands(samples, 1.2, 1.8, top=1) == [
        ("evalsha", 4, 400.0, pytest.approx(1600 / 1701))
    ]
    assert scale_watch.busiest_commands(samples[:1], 0.0, 1.0) == []
    assert scale_watch.busiest_commands([], 0.0, 1.0) == []  # every sample missed
