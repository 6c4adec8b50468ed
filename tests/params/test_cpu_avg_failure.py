"""A CPU averaging round that fails for good is not silent: the averager keeps the
failure as the rank's ``Exiting`` reason, injects ``Shutdown`` (the core would wait for
an ``Update`` forever) and sends no ``SyncAck``; the loop says the reason upstream."""

from __future__ import annotations

import threading
from typing import Any

import torch

from flodl_bus.params.cpu_avg import CpuAverager
from flodl_bus.protocol import leaving
from flodl_bus.protocol.messages import Shutdown, SnapshotReady, SyncAck


class BrokenSessions:
    """The session manager's verdict after its group broke and no new session came in
    time (what ``SessionManager.run`` raises then); the averager is what is tested."""

    def run(self, attempt: Any) -> bool:
        raise RuntimeError("collective group broken; no new session within 60.0s")


def test_a_round_that_fails_for_good_is_reported_not_silent() -> None:
    injected: list[Any] = []
    published: list[Any] = []
    done = threading.Event()

    def inject(msg: Any) -> None:
        injected.append(msg)
        done.set()

    avg = CpuAverager(
        [torch.ones(4)],
        [],
        BrokenSessions(),  # type: ignore[arg-type]
        rank=1,
        inject=inject,
        publish=published.append,
    )
    try:
        assert avg.failure is None
        avg.snapshot(3)
        assert done.wait(10)
        assert avg.wait_idle(10)
    finally:
        avg.close()
    assert injected == [Shutdown()]
    assert avg.failure is not None
    assert leaving.kind_of(avg.failure) == leaving.AVERAGING_FAILED
    assert "no new session within 60.0s" in avg.failure
    # No SyncAck: the coordinator must not count this round as done by this rank.
    assert [type(m) for m in published] == [SnapshotReady]
    assert not any(isinstance(m, SyncAck) for m in published)


class SplitSessions:
    """A first round realized, then the session manager's verdict on a retried round
    that had completed on a peer before the group broke (``RoundSplit``)."""

    def __init__(self) -> None:
        self.calls = 0

    def run(self, attempt: Any) -> bool:
        from flodl_bus.params.groups import RoundSplit

        self.calls += 1
        if self.calls == 1:
            return True  # its sums are not what is tested
        raise RoundSplit("the round completed on a peer only")


def test_a_round_that_completed_on_a_peer_only_is_kept_local_and_acked() -> None:
    """Not a failure: the rank keeps its own state for that round (an unrealized
    ``Update`` of its snapshot), acks it so the coordinator closes the cycle, and drops
    its bf16 base (its peers adopted a consensus it did not, so the next round must
    travel in f32)."""
    from flodl_bus.protocol.messages import Update

    injected: list[Any] = []
    published: list[Any] = []
    got = threading.Semaphore(0)

    def inject(msg: Any) -> None:
        injected.append(msg)
        got.release()

    avg = CpuAverager(
        [torch.full((4,), 5.0)],
        [],
        SplitSessions(),  # type: ignore[arg-type]
        rank=1,
        inject=inject,
        publish=published.append,
        bf16_wire=True,
    )
    try:
        avg.snapshot(3)
        assert got.acquire(timeout=10)
        assert avg.wait_idle(10)
        assert avg.base is not None  # the realized round's consensus
        avg.snapshot(2)
        assert got.acquire(timeout=10)
        assert avg.wait_idle(10)
    finally:
        avg.close()
    assert avg.failure is None
    assert [type(m) for m in injected] == [Update, Update]
    kept = injected[1].avg
    assert not kept.realized
    assert kept.params[0].tolist() == [5.0] * 4  # the rank's own snapshot
    assert avg.base is None
    assert [type(m) for m in published] == [SnapshotReady, SyncAck] * 2
