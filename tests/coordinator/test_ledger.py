"""The window's ledger (``coordinator.ledger``): the short ranks it keeps for the gate."""

from __future__ import annotations

from typing import ClassVar

import pytest

from flodl_bus.coordinator.config import CoordinatorConfig, Policy
from flodl_bus.coordinator.core import SHUTDOWN, Coordinator
from flodl_bus.coordinator.ledger import Ledger
from tests.coordinator.sim import Cluster


def full_scan(core: Coordinator) -> tuple[bool, str]:
    """The gate by a walk over every rank (its rule before the ledger kept its short
    ranks and the backend found its first missing ack)."""
    if core.phase == SHUTDOWN:
        return False, "shutdown"
    if core.reduce.in_flight:
        return False, "cpu cycle in flight"
    if core.live.active_count == 0:
        return False, "no active rank"
    sync = core.policy is Policy.SYNC
    steps, alive, counts = core.ledger.steps, core.live.alive, core.elche.counts
    for r in range(core.ws):
        if not alive[r]:
            continue
        if core.reduce.blocks(r):
            return False, f"rank {r} has not acked the last SyncNow"
        need = 1 if sync else counts[r]
        if steps[r] < need and not core.dispatch.spares_gate(r):
            return False, f"rank {r} at {steps[r]}/{need} steps"
    if not any(s > 0 for s, a in zip(steps, alive, strict=True) if a):
        return False, "no rank moved"
    return True, "open"


class Checked(Coordinator):
    """A core that, at every call, checks its gate against the full scan."""

    checks = 0
    reasons: ClassVar[set[str]] = set()

    def _check(self) -> None:
        got = self.gate()
        assert got == full_scan(self), (self.ledger.steps, self.elche.counts)
        Checked.checks += 1
        Checked.reasons.add(got[1].split(" ")[-1])

    def handle(self, rank: int, msg: object, now: float):  # type: ignore[no-untyped-def,override]
        out = super().handle(rank, msg, now)  # type: ignore[arg-type]
        self._check()
        return out

    def tick(self, now: float, behind: bool = False):  # type: ignore[no-untyped-def,override]
        out = super().tick(now, behind=behind)
        self._check()
        return out


@pytest.mark.parametrize("mode", ["nccl-cadence", "nccl-sync", "cpu-cadence", "cpu-async"])
def test_the_first_short_rank_is_the_full_scans_at_every_call_of_a_run_with_a_death(
    mode: str,
) -> None:
    cfg = CoordinatorConfig(
        mode=mode,
        world_size=9,
        total_samples=2400,
        batch_size=8,
        num_epochs=3,
        heartbeat_timeout=0.05,
    )
    Checked.checks = 0
    Checked.reasons = set()
    cluster = Cluster(cfg, speeds=[1, 2, 3, 2, 5, 1, 4, 2, 3], core=Checked(cfg))
    cluster.heartbeat_every_ms = 10
    cluster.kill_at[4] = 60
    cluster.run()
    assert cluster.core.live.dead[4]
    assert Checked.checks > 500
    # the run went through the gate's answers: open, a short rank, and its backend's own
    said = {"open", "steps", "SyncNow" if mode.startswith("nccl") else "flight"}
    assert said <= Checked.reasons, Checked.reasons


def test_a_rank_at_its_count_is_dropped_and_new_counts_start_over() -> None:
    ledger = Ledger(4)
    counts = [2, 1, 3, 1]
    never = lambda r: False  # noqa: E731
    assert ledger.first_short(counts, never) is None
    assert ledger._short == [0, 1, 2, 3]
    ledger.record_batch(1, 1.0, 0.0, 0.5)  # rank 1 at its count
    ledger.record_batch(3, 1.0, 0.0, 0.5)  # rank 3 too
    assert ledger.first_short(counts, lambda r: r == 2) == 2
    assert ledger._short == [0, 2, 3]  # walked up to rank 2: 1 dropped, 3 not yet seen
    assert ledger.first_short(counts, never) is None
    assert ledger._short == [0, 2]
    # a new counts list: every rank short of it again is listed again
    assert ledger.first_short([2, 2, 3, 2], lambda r: True) == 0
    assert ledger._short == [0, 1, 2, 3]
    # of one step each (a sync window)
    assert ledger.first_short(None, lambda r: r != 0) == 2
    assert ledger._short == [0, 2]
