"""The window's ledger (``coordinator.ledger``): the short ranks it keeps for the gate."""

from __future__ import annotations

from itertools import compress, count, repeat
from operator import lt

import pytest

from flodl_bus.coordinator.config import CoordinatorConfig, Policy
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.ledger import Ledger
from tests.coordinator.sim import Cluster


def full_scan(core: Coordinator) -> int | None:
    """The first short, live, unspared rank by a walk over every rank (the gate's rule
    before the ledger kept its short ranks)."""
    sync = core.policy is Policy.SYNC
    steps, alive = core.ledger.steps, core.live.alive
    need = repeat(1) if sync else core.elche.counts
    for r in compress(count(), map(lt, steps, need)):
        if alive[r] and not core.dispatch.spares_gate(r):
            return r
    return None


class Checked(Coordinator):
    """A core that, at every call, checks the ledger's answer against the full scan."""

    checks = 0

    def _check(self) -> None:
        if self.reduce.in_flight or self.reduce.any_blocks():
            return
        sync = self.policy is Policy.SYNC
        counts = None if sync else self.elche.counts
        alive, spares = self.live.alive, self.dispatch.spares_gate
        got = self.ledger.first_short(counts, lambda r: alive[r] and not spares(r))
        assert got == full_scan(self), (self.ledger.steps, counts)
        Checked.checks += 1

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
    cluster = Cluster(cfg, speeds=[1, 2, 3, 2, 5, 1, 4, 2, 3], core=Checked(cfg))
    cluster.heartbeat_every_ms = 10
    cluster.kill_at[4] = 60
    cluster.run()
    assert cluster.core.live.dead[4]
    assert Checked.checks > 500


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
