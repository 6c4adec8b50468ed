"""Whole runs of the core against simulated ranks, one per mode (reference §4.7)."""

from __future__ import annotations

from typing import Any

import pytest

from flodl_bus.coordinator.config import MODES, CoordinatorConfig
from flodl_bus.protocol import messages as m
from tests.coordinator.sim import Cluster


@pytest.mark.parametrize("mode", MODES)
def test_every_sample_of_each_epoch_trained_exactly_once(mode: str) -> None:
    cfg = CoordinatorConfig(
        mode=mode,
        world_size=3,
        total_samples=1797,  # the digits set: the sub-batch tail is never dispatched
        batch_size=16,
        num_epochs=4,
        epoch_splits=2,
        eval_every=2,
        final_eval=True,
    )
    cluster = Cluster(cfg, speeds=[1, 3, 7])
    cluster.run()

    trained = cluster.trained_by_epoch()
    for e in range(cfg.num_epochs):
        assert sorted(trained[e]) == cluster.expected_epoch(e), f"epoch {e}"
    core = cluster.core
    assert core.version > 0
    # every trained batch is counted once in the LR position, SyncAcks never
    assert core.global_step == sum(len(v) for v in trained.values()) // cfg.batch_size
    assert all(rk.global_step == core.global_step for rk in cluster.ranks)
    assert all(rk.dropped_plans == 0 for rk in cluster.ranks)  # one chunk in flight
    assert cluster.count_sent(m.Shutdown) == 1
    assert cluster.finished is not None and cluster.finished.reason is None
    assert all(rk.exited for rk in cluster.ranks)
    # aggregated metrics agree with what the ranks trained
    agg = cluster.ranks[0].aggregated
    assert [a.epoch for a in agg] == list(range(cfg.num_epochs))
    for a in agg:
        assert sum(a.per_rank_samples) == len(cluster.expected_epoch(a.epoch))
    assert cluster.ranks[0].evals[-1] == (cfg.num_epochs, 0.9)


@pytest.mark.parametrize("mode", ["cpu-cadence", "cpu-async"])
def test_cadence_gives_the_fast_rank_the_larger_share(mode: str) -> None:
    cfg = CoordinatorConfig(mode=mode, world_size=3, total_samples=2000, batch_size=8, num_epochs=3)
    cluster = Cluster(cfg, speeds=[1, 3, 7])
    cluster.run()
    share = [len(rk.trained) for rk in cluster.ranks]
    assert share[0] > share[1] > share[2]


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_dying_mid_run_leaves_every_sample_covered(mode: str) -> None:
    cfg = CoordinatorConfig(
        mode=mode,
        world_size=4,
        total_samples=1200,
        batch_size=8,
        num_epochs=2,
        heartbeat_timeout=0.05,
    )
    cluster = Cluster(cfg, speeds=[1, 2, 3, 2])
    cluster.heartbeat_every_ms = 10
    cluster.kill_at[2] = 40
    cluster.run()
    trained = cluster.trained_by_epoch()
    for e in range(cfg.num_epochs):
        assert set(trained[e]) == set(cluster.expected_epoch(e)), f"epoch {e}"
    assert cluster.core.live.dead == [False, False, True, False]
    assert cluster.finished is not None and cluster.finished.reason is None
    if mode.startswith("nccl"):
        assert cluster.count_sent(m.DeclareDead) == 1
        assert sorted(cluster.ranks[0].sessions) == [(0, 3)]


def _solo_run(mode: str, **kw: object) -> Cluster:
    """A world of one trained out, every epoch's evals on; each sample trained once."""
    cfg = CoordinatorConfig(
        mode=mode, world_size=1, batch_size=8, eval_every=1, final_eval=True, **kw
    )  # type: ignore[arg-type]
    cluster = Cluster(cfg, speeds=[2])
    cluster.run()
    trained = cluster.trained_by_epoch()
    for e in range(cfg.num_epochs):
        assert sorted(trained[e]) == cluster.expected_epoch(e), f"epoch {e}"
    return cluster


@pytest.mark.parametrize("mode", MODES)
def test_a_world_of_one_trains_every_sample_without_a_single_round(mode: str) -> None:
    cluster = _solo_run(mode, total_samples=500, num_epochs=3)
    cfg, trained = cluster.cfg, cluster.trained_by_epoch()
    for kind in (m.SyncNow, m.RequestParams, m.Throttle, m.SetGlobalStep, m.WireUpdate):
        assert cluster.count_sent(kind) == 0, kind.__name__
    (rank,) = cluster.ranks
    steps = sum(len(v) for v in trained.values()) // cfg.batch_size
    # Windows still closed in the coordinator (the last one too): its global step is
    # every batch, and the rank's LR position (never reset by a round) is the same.
    assert cluster.core.version > 0
    assert cluster.core.global_step == steps == rank.global_step + rank.steps_since_avg
    assert [e for e, _ in rank.evals] == [1, 2, cfg.num_epochs]
    assert cluster.finished is not None and cluster.finished.reason is None and rank.exited


@pytest.mark.parametrize("mode", ["cpu-cadence", "cpu-async", "nccl-cadence"])
@pytest.mark.parametrize("ahead", [True, False])
def test_a_world_of_one_starts_each_epoch_as_the_last_ends_but_a_checkpoints(
    mode: str, ahead: bool
) -> None:
    # issue 27: the next epoch's plan is in the rank's mailbox before its epoch ends,
    # with the eval of that start armed; an epoch that starts with a checkpoint (taken
    # on receipt) is planned as it starts. Off: records made before it.
    cluster = _solo_run(
        mode, total_samples=400, num_epochs=6, checkpoint_every=3, solo_plans_ahead=ahead
    )
    cfg = cluster.cfg
    (rank,) = cluster.ranks
    assert rank.dropped_plans == 0  # never two plans in the one-plan mailbox
    assert [e for _, e in rank.starts] == list(range(cfg.num_epochs))  # one plan an epoch
    idle = {e: start - end for (end, _), (start, e) in zip(rank.ends, rank.starts[1:])}
    # an epoch's time counts from the end of the one before, not from when its plan
    # went out ahead (100 ticks of 2 ms batches, at most a tick of turn-over)
    assert all(99.9 < a.epoch_ms < 102 for a in rank.aggregated)
    if ahead:
        assert idle == {1: 0, 2: 0, 3: 1, 4: 0, 5: 0}
        assert cluster.count_sent(m.ArmEpochEval) == 4
    else:
        assert all(v >= 1 for v in idle.values()) and not cluster.count_sent(m.ArmEpochEval)
    # every start's eval scored, each once (the armed ones before the first step)
    assert [e for e, _ in rank.evals] == [1, 2, 3, 4, 5, cfg.num_epochs]
    assert cluster.count_sent(m.Checkpoint) == 1
    assert cluster.finished is not None and cluster.finished.reason is None and rank.exited


def _digits_pair(mode: str, **kw: Any) -> CoordinatorConfig:
    """Two ranks over six digits epochs, an eval every second one and a final one."""
    return CoordinatorConfig(
        mode=mode,
        world_size=2,
        total_samples=1797,
        batch_size=16,
        num_epochs=6,
        eval_every=2,
        final_eval=True,
        **kw,
    )


@pytest.mark.parametrize("mode", ["cpu-cadence", "cpu-async"])
@pytest.mark.parametrize("ahead", [True, False])
def test_cpu_ranks_start_each_epoch_as_their_share_of_the_last_ends_but_a_checkpoints(
    mode: str, ahead: bool
) -> None:
    # issue 27: a rank's first chunk of the next epoch is in its mailbox before its
    # share of the current one ends; an epoch that starts with a checkpoint (taken on
    # receipt) is planned as it starts. Off: records made before it.
    cfg = _digits_pair(
        mode,
        checkpoint_every=4,
        plans_ahead=ahead,
        # one window a chunk: the turn-overs this test counts (crossing has its own)
        chunks_cross_windows=False,
    )
    cluster = Cluster(cfg, speeds=[2, 3])
    cluster.run()
    trained = cluster.trained_by_epoch()
    for e in range(cfg.num_epochs):
        assert sorted(trained[e]) == cluster.expected_epoch(e), f"epoch {e}"
    assert all(rk.dropped_plans == 0 for rk in cluster.ranks)  # one plan in the mailbox
    # per rank, the ticks between its last plan of an epoch and its first of the next
    turns = [
        {e: start - end for (end, prev), (start, e) in zip(rk.ends, rk.starts[1:]) if e != prev}
        for rk in cluster.ranks
    ]
    assert all(sorted(t) == [1, 2, 3, 4, 5] for t in turns)
    if ahead:
        assert all(t[e] == 0 for t in turns for e in (1, 2, 3, 5))
        assert any(t[4] > 0 for t in turns)  # the checkpoint's epoch opens on a report
    else:
        assert all(v > 0 for t in turns for v in t.values())
    assert not cluster.count_sent(m.ArmEpochEval)  # epoch evals score the consensus
    assert [e for e, _ in cluster.ranks[0].evals] == [2, 4, cfg.num_epochs]
    assert cluster.count_sent(m.Checkpoint) == 1
    assert cluster.finished is not None and cluster.finished.reason is None


def _slowed_mid_run(bridges: bool) -> Cluster:
    cfg = CoordinatorConfig(
        mode="nccl-cadence",
        world_size=2,
        total_samples=8000,
        batch_size=8,
        num_epochs=1,
        bridge_idle=bridges,
    )
    cluster = Cluster(cfg, speeds=[2, 4])
    # Rank 1 turns 2.5x slower mid-run: ElChe's counts lag its real speed for windows.
    cluster.ranks[1].slows_at = (400, 10)
    cluster.run()
    return cluster


def test_nccl_cadence_the_fast_rank_waits_at_most_a_batch_per_averaging() -> None:
    bridged, held = _slowed_mid_run(True), _slowed_mid_run(False)
    for cluster in (bridged, held):
        assert sorted(cluster.trained_by_epoch()[0]) == cluster.expected_epoch(0)
        fast, slow = cluster.ranks
        assert fast.collectives == slow.collectives == cluster.count_sent(m.SyncNow)
        assert fast.dropped_plans == slow.dropped_plans == 0
        assert cluster.core.global_step == len(cluster.trained_by_epoch()[0]) // 8
    # Held at its window's end, the fast rank waits out the slow one's rest...
    # for several windows, until ElChe's trust ring has learnt the new speed
    assert sum(held.ranks[0].waits) > 150
    # ...bridged, it trains on and enters the collective after the batch it is on: its
    # wait is that batch (2 ticks) and the SyncNow's trip (a tick each way). The epoch's
    # last averaging, once the pool is empty, is the one it cannot bridge (§6 #17).
    fast, slow = bridged.ranks
    assert max(fast.waits[:-1]) <= 2 + 2, fast.waits
    assert max(slow.waits[:-1]) <= 2 + 2, slow.waits
    assert fast.collectives > 10
    assert sum(len(rk.trained) for rk in bridged.ranks) == 8000
    assert len(fast.trained) > len(held.ranks[0].trained)
    assert bridged.t < held.t


def _cpu_slowed_mid_run(bridges: bool) -> Cluster:
    cfg = CoordinatorConfig(
        mode="cpu-cadence",
        world_size=2,
        total_samples=4000,
        batch_size=8,
        num_epochs=3,
        cpu_bridges=bridges,
    )
    cluster = Cluster(cfg, speeds=[2, 4])
    # Rank 1 turns 2.5x slower mid-run: ElChe's counts lag its real speed for windows.
    cluster.ranks[1].slows_at = (400, 10)
    cluster.run()
    return cluster


def test_cpu_cadence_bridges_keep_the_fast_rank_training_and_every_batch_weighs_once() -> None:
    bridged, held = _cpu_slowed_mid_run(True), _cpu_slowed_mid_run(False)
    bs = bridged.cfg.batch_size
    for cluster in (bridged, held):
        trained = cluster.trained_by_epoch()
        for e in range(cluster.cfg.num_epochs):
            assert sorted(trained[e]) == cluster.expected_epoch(e), f"epoch {e}"
        batches = sum(len(v) for v in trained.values()) // bs
        assert cluster.core.global_step == batches
        for rk in cluster.ranks:
            assert rk.dropped_plans == 0
            # Each snapshot ships the steps since the last (subtract, never zero): over
            # the run every batch a rank trained weighs in exactly one round, a bridge's
            # before its snapshot in that round, after it in the next.
            assert sum(weighed for weighed, _ in rk.rounds_seen) == len(rk.trained) // bs
            assert rk.steps_since_avg == 0
    # Held at its window's count, the fast rank waits out the slow one's rest, window
    # after window until ElChe's trust ring has learnt the new speed; bridged, it trains
    # on. Its idle ticks, up to its last batch:
    idle = [c.ranks[0].last_batch_end - len(c.ranks[0].trained) // bs * 2 for c in (bridged, held)]
    assert idle[0] * 3 < idle[1], idle


def _turn_overs(cross: bool, speeds: list[int]) -> tuple[list[int], list[int], Cluster]:
    """Two cpu-cadence ranks over six digits epochs: each rank's plans, and the ticks it
    spent between the end of one and the start of the next."""
    cluster = Cluster(_digits_pair("cpu-cadence", chunks_cross_windows=cross), speeds=speeds)
    cluster.run()
    idle = [
        sum(max(0, start - end) for (end, _), (start, _) in zip(rk.ends, rk.starts[1:]))
        for rk in cluster.ranks
    ]
    return [len(rk.starts) for rk in cluster.ranks], idle, cluster


@pytest.mark.parametrize("speeds", [[1, 1], [2, 3], [1, 3]])
def test_cpu_cadence_chunks_across_windows_turn_over_fewer_plans_and_idle_less(
    speeds: list[int],
) -> None:
    # issue 27: a chunk that ended at its window's count waited for the round's next one
    across = _turn_overs(True, speeds)
    one_window = _turn_overs(False, speeds)
    for *_, cluster in (across, one_window):
        trained = cluster.trained_by_epoch()
        for e in range(cluster.core.config.num_epochs):
            assert sorted(trained[e]) == cluster.expected_epoch(e), f"epoch {e}"
        assert all(rk.dropped_plans == 0 for rk in cluster.ranks)
        assert cluster.finished is not None and cluster.finished.reason is None
    # about a third fewer plans each, and the idle ticks between them a third down or more
    assert all(a * 4 <= o * 3 for a, o in zip(across[0], one_window[0]))
    assert sum(across[1]) * 3 <= sum(one_window[1]) * 2
