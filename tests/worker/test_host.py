"""A rank's environment (torchrun's four variables) and its share of the host's cores."""

from __future__ import annotations

import pytest

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
