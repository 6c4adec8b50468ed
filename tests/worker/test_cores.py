"""worker.cores: the kept core's plan, and its application to a process's real threads."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

import pytest

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


@linux_only
@pytest.mark.usefixtures("restored_affinity")
def test_the_training_thread_runs_alone_on_its_core_and_threads_it_starts_later_move_away() -> None:
    kept, *rest = sorted(os.sched_getaffinity(0))
    plan = CorePlan(kept, frozenset(rest))
    policy = KeptCore(plan)
    stop = threading.Event()
    seen: dict[str, int] = {}

    def other(name: str) -> None:
        seen[name] = threading.get_native_id()
        stop.wait(30)

    before = threading.Thread(target=other, args=("before",))
    before.start()
    found: dict[str, set[int]] = {}
    failed: list[BaseException] = []

    def training() -> None:
        try:
            policy.apply()
            me = threading.get_native_id()
            found["training"] = _cores_of(me)
            while "before" not in seen:
                stop.wait(0.001)
            found["before"] = _cores_of(seen["before"])
            later = threading.Thread(target=other, args=("later",))
            later.start()
            while "later" not in seen:
                stop.wait(0.001)
            found["later, inherited"] = _cores_of(seen["later"])
            assert policy.hold() >= 1
            found["later, held"] = _cores_of(seen["later"])
            found["training, held"] = _cores_of(me)
        except BaseException as exc:
            failed.append(exc)

    t = threading.Thread(target=training)
    t.start()
    t.join(30)
    stop.set()
    before.join(30)
    assert not failed
    assert found["training"] == {kept} and found["training, held"] == {kept}
    assert found["before"] == set(rest)
    assert found["later, inherited"] == {kept}  # why ``hold`` exists
    assert found["later, held"] == set(rest)
    # the runner's own thread was moved too
    assert _cores_of(threading.main_thread().native_id or 0) == set(rest)
