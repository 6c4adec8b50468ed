"""worker.cores: the kept core's plan, and its application to a process's real threads."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from flodl_bus.worker import cores
from flodl_bus.worker.cores import CorePlan, KeptCore

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="thread affinity is Linux's, and needs two cores",
)


def test_each_local_rank_keeps_its_own_core_from_the_top_and_the_rest_run_below() -> None:
    usable = range(16)
    plans = [cores.plan(usable, r, 2) for r in range(2)]
    assert [p.kept for p in plans if p is not None] == [15, 14]
    assert all(p is not None and p.away == frozenset(range(14)) for p in plans)


def test_a_host_without_cores_to_spare_keeps_none() -> None:
    assert cores.plan(range(3), 0, 2) is None  # 2 kept, 1 left: below MIN_SPARE
    assert cores.plan(range(4), 0, 2) is not None
    assert cores.plan(range(16), 2, 2) is None  # no such local rank


def test_the_setting_is_read_as_on_off_or_refused_with_its_fix() -> None:
    assert (
        cores.wanted({cores.ENV: "1"})
        and not cores.wanted({})
        and not cores.wanted({cores.ENV: "0"})
    )
    with pytest.raises(ValueError, match="use 1"):
        cores.wanted({cores.ENV: "yes"})


@pytest.fixture
def restored_affinity() -> Iterator[None]:
    """Every thread of this process back on its cores afterwards (``apply`` moves all of
    them, the test runner's own included)."""
    before = os.sched_getaffinity(0)
    yield
    for t in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(t), before)


def _cores_of(tid: int) -> set[int]:
    return set(os.sched_getaffinity(tid))


def _on_a_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` on a thread of its own, the rank's training thread (pinning the test
    runner's would hold it there), and raise what it raised."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            failed.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive() and not failed, failed


def _started(stop: threading.Event) -> int:
    """The id of a new thread, started by the caller, that waits for ``stop``."""
    ids: list[int] = []

    def wait() -> None:
        ids.append(threading.get_native_id())
        stop.wait(60)

    threading.Thread(target=wait, daemon=True).start()
    while not ids:
        stop.wait(0.001)
    return ids[0]


@linux_only
@pytest.mark.usefixtures("restored_affinity")
def test_the_training_thread_runs_alone_on_its_core_and_threads_it_starts_later_move_away() -> None:
    kept, *rest = sorted(os.sched_getaffinity(0))
    policy = KeptCore(CorePlan(kept, frozenset(rest)))
    stop = threading.Event()
    before = _started(stop)
    found: dict[str, set[int]] = {}

    def training() -> None:
        policy.apply()
        me = threading.get_native_id()
        found["training"] = _cores_of(me)
        found["before"] = _cores_of(before)
        later = _started(stop)
        found["later, inherited"] = _cores_of(later)
        assert policy.hold() >= 1
        found["later, held"] = _cores_of(later)
        found["training, held"] = _cores_of(me)

    try:
        _on_a_thread(training)
    finally:
        stop.set()
    assert found["training"] == {kept} and found["training, held"] == {kept}
    assert found["before"] == set(rest)
    assert found["later, inherited"] == {kept}  # why ``hold`` exists
    assert found["later, held"] == set(rest)
    # the runner's own thread was moved too
    assert _cores_of(threading.main_thread().native_id or 0) == set(rest)


@linux_only
@pytest.mark.usefixtures("restored_affinity")
def test_a_loop_at_one_thread_keeps_its_core_and_moves_threads_started_since_at_its_next_plan() -> (
    None
):
    # the wiring (worker.loop): taken as the loop is built at one intra-op thread, held
    # at each plan's start
    from flodl_bus.protocol.messages import EpochPlan
    from tests.worker.test_loop import BS, make_rig

    kept, *rest = sorted(os.sched_getaffinity(0))
    threads_before = torch.get_num_threads()
    stop = threading.Event()
    found: dict[str, set[int]] = {}

    def training() -> None:
        torch.set_num_threads(1)
        rig = make_rig(kept_core=KeptCore(CorePlan(kept, frozenset(rest))))
        found["built"] = _cores_of(threading.get_native_id())
        later = _started(stop)
        found["started"] = _cores_of(later)
        assert rig.loop.run_epoch_plan(EpochPlan(0, 0, 2 * BS)) is False
        found["after a plan"] = _cores_of(later)
        found["training"] = _cores_of(threading.get_native_id())

    try:
        _on_a_thread(training)
    finally:
        stop.set()
        torch.set_num_threads(threads_before)
    assert found["built"] == {kept} and found["training"] == {kept}
    assert found["started"] == {kept}
    assert found["after a plan"] == set(rest)
