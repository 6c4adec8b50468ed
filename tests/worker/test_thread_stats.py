"""``worker.thread_stats``: how often a thread stopped, from the kernel's counters."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from flodl_bus.worker import thread_stats

pytestmark = pytest.mark.skipif(thread_stats.sample() is None, reason="needs /proc/thread-self")


def _in_thread(work: object) -> dict[str, float] | None:
    got: list[dict[str, float] | None] = []

    def run() -> None:
        start = thread_stats.sample()
        work()  # type: ignore[operator]
        got.append(thread_stats.since(start, thread_stats.sample()))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return got[0]


def test_a_thread_that_waits_on_a_lock_counts_each_wait_as_a_block() -> None:
    lock, waits = threading.Lock(), 40

    def hand_over() -> None:
        # Another thread releases the lock this one waits on, once per wait: each
        # acquire sleeps until then, as a training thread sleeps until the GIL is back.
        for _ in range(waits):
            lock.acquire()
            threading.Timer(0.001, lock.release).start()
            with lock:
                pass

    got = _in_thread(hand_over)
    assert got is not None
    assert got["blocks_s"] * got["wall_s"] >= waits
    assert 0 < got["on_core"] <= 1 and got["runnable"] >= 0


def test_a_thread_that_never_waits_counts_no_blocks() -> None:
    def spin() -> None:
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass

    # No forced GIL hand-over to another thread of the suite within the spin: waiting to
    # take the GIL back would be a block, and this thread's are what is counted.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        got = _in_thread(spin)
    finally:
        sys.setswitchinterval(interval)
    assert got is not None
    # a preemption by a busy machine is involuntary, not a block; the samples' own file
    # reads may each give the GIL up once
    assert got["blocks_s"] * got["wall_s"] <= 4


def test_samples_of_two_threads_or_a_missing_one_say_nothing() -> None:
    here = thread_stats.sample()
    there: list[thread_stats.ThreadSample | None] = []
    t = threading.Thread(target=lambda: there.append(thread_stats.sample()))
    t.start()
    t.join()
    assert thread_stats.since(here, there[0]) is None
    assert thread_stats.since(None, here) is None and thread_stats.since(here, None) is None


def test_another_threads_counters_are_read_from_its_task_directory() -> None:
    release, started = threading.Event(), threading.Event()
    tid: list[int] = []

    def waiter() -> None:
        tid.append(threading.get_native_id())
        started.set()
        for _ in range(20):  # each wait a block, counted from outside the thread
            release.wait(0.001)

    t = threading.Thread(target=waiter)
    t.start()
    started.wait(10.0)
    task = f"/proc/self/task/{tid[0]}"
    before = thread_stats.sample(task)
    t.join()
    assert before is not None and before.tid == tid[0]
    assert thread_stats.sample(task) is None  # gone: nothing, not a stale figure
    here = thread_stats.sample()
    assert here is not None and thread_stats.since(before, here) is None
