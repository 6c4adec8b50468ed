"""A rank's environment (torchrun's four variables) and its share of the host's cores."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from flodl_bus.worker import host
from flodl_bus.worker.host import rank_env, set_rank_env, thread_share, torch_threads, tunes_threads


def test_a_rank_on_one_host_is_its_own_local_rank() -> None:
    assert rank_env(2, 4, {}) == {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
    }


def test_the_launchers_local_rank_and_size_are_kept() -> None:
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "RANK": "9", "WORLD_SIZE": "9"}
    assert rank_env(3, 4, env) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    # Half of the pair is no convention: the world is taken as one host.
    assert rank_env(3, 4, {"LOCAL_RANK": "1"})["LOCAL_WORLD_SIZE"] == "4"


def test_set_rank_env_writes_the_four_variables() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    set_rank_env(1, 3, env)
    assert env == {
        "PATH": "/bin",
        "RANK": "1",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "3",
    }


def test_each_rank_takes_its_share_of_the_cores() -> None:
    # a core of a large host is kept for the control plane
    assert thread_share({"LOCAL_WORLD_SIZE": "4"}, 16) == 3
    assert thread_share({"LOCAL_WORLD_SIZE": "3"}, 16) == 5
    assert thread_share({"LOCAL_WORLD_SIZE": "2"}, 16) == 7
    assert thread_share({}, 16) == 15
    # a small host gives its ranks every core
    assert thread_share({}, 2) == 2
    assert thread_share({"LOCAL_WORLD_SIZE": "8"}, 2) == 1  # never below one


def test_an_explicit_count_wins_and_a_launchers_omp_setting_is_left_alone() -> None:
    assert thread_share({"FLODL_NUM_THREADS": "3", "OMP_NUM_THREADS": "1"}, 16) == 3
    assert thread_share({"OMP_NUM_THREADS": "2", "LOCAL_WORLD_SIZE": "4"}, 16) is None


def test_a_rank_sets_torchs_threads_itself_even_where_the_launcher_split_the_cores() -> None:
    # The count goes to torch.set_num_threads in every case: left to OMP_NUM_THREADS
    # alone, torch sizes its pool from MKL's own count instead (capped at the cores).
    assert torch_threads({"OMP_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "4"}, 2) == 3
    assert torch_threads({"LOCAL_WORLD_SIZE": "2"}, 16) == 7
    assert torch_threads({"FLODL_NUM_THREADS": "5", "OMP_NUM_THREADS": "3"}, 16) == 5
    assert torch_threads({"OMP_NUM_THREADS": "junk"}, 6) == 6


def test_only_a_default_share_is_sized_to_the_work() -> None:
    assert tunes_threads({}) is True
    assert tunes_threads({"LOCAL_WORLD_SIZE": "2"}) is True
    # a count asked for is kept, whatever else says
    assert tunes_threads({"FLODL_NUM_THREADS": "4", "FLODL_TUNE_THREADS": "1"}) is False
    # a launcher's own split is kept, unless it says the split is its default (``up``)
    assert tunes_threads({"OMP_NUM_THREADS": "3"}) is False
    assert tunes_threads({"OMP_NUM_THREADS": "3", "FLODL_TUNE_THREADS": "1"}) is True
    assert tunes_threads({"FLODL_TUNE_THREADS": "0"}) is False


def test_a_bad_tuning_flag_is_refused_naming_it_and_its_values() -> None:
    with pytest.raises(ValueError, match=r"FLODL_TUNE_THREADS='yes': use 1 .* or 0"):
        tunes_threads({"FLODL_TUNE_THREADS": "yes"})


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"FLODL_NUM_THREADS": "0"}, "FLODL_NUM_THREADS"),
        ({"FLODL_NUM_THREADS": "many"}, "FLODL_NUM_THREADS"),
        ({"LOCAL_WORLD_SIZE": "zero"}, "LOCAL_WORLD_SIZE"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        thread_share(env, 16)


@pytest.mark.parametrize(("local_rank", "local_world"), [("2", "2"), ("x", "2"), ("0", "-1")])
def test_a_local_rank_outside_the_local_world_is_refused(local_rank: str, local_world: str) -> None:
    with pytest.raises(ValueError, match="0 <= LOCAL_RANK < LOCAL_WORLD_SIZE"):
        rank_env(0, 4, {"LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_world})


def test_the_layout_keeps_the_last_core_for_control_and_splits_the_rest_evenly() -> None:
    assert host.cpu_layout(range(16), 1) == ([15], [list(range(15))])
    control, ranks = host.cpu_layout([3, 1, 2, 0, 7, 6, 5, 4], 3) or ([], [])
    assert control == [7]
    assert ranks == [[0, 1], [2, 3], [4, 5]]
    # no rank's cores overlap another's or the control plane's
    assert not set(control) & {c for r in ranks for c in r}


def test_no_layout_where_the_host_cannot_spare_a_core() -> None:
    assert host.cpu_layout(range(2), 1) is None
    assert host.cpu_layout(range(4), 4) is None


def test_pinning_is_off_unless_asked_and_a_bad_flag_is_refused() -> None:
    assert not host.pins_cpus({})
    assert host.pins_cpus({host.ENV_PIN: "1"})
    with pytest.raises(ValueError, match="FLODL_PIN_CPUS"):
        host.pins_cpus({host.ENV_PIN: "yes"})
    with pytest.raises(ValueError, match="comma-separated"):
        host.parse_cpus("0-3")


def test_the_ranks_own_threads_move_to_the_control_cores_and_training_stays() -> None:
    mine = os.sched_getaffinity(0)
    target = {min(mine)}
    release = threading.Event()
    t = threading.Thread(target=release.wait, name="a-reader")
    t.start()
    try:
        assert t.native_id is not None
        moved = host.pin_control_threads({host.ENV_CONTROL_CPUS: host.format_cpus(sorted(target))})
        assert moved >= 1
        assert os.sched_getaffinity(t.native_id) == target
        assert os.sched_getaffinity(0) == mine  # the calling (training) thread is left
    finally:
        release.set()
        t.join()
    assert host.pin_control_threads({}) == 0


def test_a_rank_pinned_to_training_cores_runs_its_intra_op_team_there() -> None:
    mine = sorted(os.sched_getaffinity(0))
    code = (
        "import os, torch; from flodl_bus.worker import host;"
        "before = set(os.listdir('/proc/self/task'));"
        "assert host.pin_training_thread(os.environ);"
        "torch.set_num_threads(2); torch.ones(1 << 22).exp().sum();"
        # threads torch started at its import (idle helpers) are not the team's
        "tasks = set(os.listdir('/proc/self/task')) - before | {str(os.getpid())};"
        "print(len(tasks), sorted({c for t in tasks for c in os.sched_getaffinity(int(t))}))"
    )
    env = {**os.environ, host.ENV_COMPUTE_CPUS: str(mine[0])}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    tasks, cpus = out.stdout.split(" ", 1)
    assert int(tasks) >= 2  # the intra-op team exists, and it is on the training cores only
    assert cpus.strip() == f"[{mine[0]}]"
