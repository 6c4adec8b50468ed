"""The rank's local control queue."""

from __future__ import annotations

import threading
import time

from flodl_bus.protocol.messages import SetGlobalStep, Shutdown, SyncNow
from flodl_bus.worker.inbox import Closed, Inbox


def test_poll_never_blocks_and_keeps_fifo_order() -> None:
    inbox = Inbox()
    assert inbox.poll() is None
    inbox.put(SyncNow())
    inbox.put_many([SetGlobalStep(1), Shutdown()])
    assert [inbox.poll(), inbox.poll(), inbox.poll(), inbox.poll()] == [
        SyncNow(),
        SetGlobalStep(1),
        Shutdown(),
        None,
    ]


def test_get_times_out_with_none_and_wakes_on_put() -> None:
    inbox = Inbox()
    assert inbox.get(timeout=0.02) is None
    threading.Timer(0.05, lambda: inbox.put(SyncNow())).start()
    assert inbox.get(timeout=5) == SyncNow()


def test_close_delivers_what_is_queued_then_closed_and_wakes_a_waiter() -> None:
    inbox = Inbox()
    inbox.put(SetGlobalStep(2))
    inbox.close()
    inbox.put(SyncNow())  # after close: dropped
    assert inbox.get() == SetGlobalStep(2)
    assert isinstance(inbox.get(), Closed)

    waiting = Inbox()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(waiting.get()))
    t.start()
    time.sleep(0.02)
    waiting.close()
    t.join(timeout=5)
    assert len(got) == 1 and isinstance(got[0], Closed)


def test_before_wait_runs_only_when_get_is_about_to_block_and_before_it_does() -> None:
    # A world of one's publisher holds its epoch's end back; the rank hurries it before
    # it waits on its control, whose next message may be the answer to it.
    inbox = Inbox()
    calls: list[int] = []

    def hurry() -> None:
        calls.append(len(inbox))
        inbox.put(SetGlobalStep(global_step=7))  # the answer comes once it is hurried

    inbox.before_wait = hurry
    inbox.put(Shutdown())
    assert isinstance(inbox.get(timeout=5.0), Shutdown)
    assert calls == []  # queued: no wait, no hurry
    got = inbox.get(timeout=5.0)
    assert isinstance(got, SetGlobalStep) and got.global_step == 7
    assert calls == [0]
    inbox.before_wait = None
    assert inbox.get(timeout=0.01) is None and calls == [0]
