"""Dispatch strategies (``coordinator.dispatch``) through the core: first dispatch,
one chunk in flight, the epoch barrier, a dead rank's work, a failed send
(reference §4.10, §4.15.2)."""

from __future__ import annotations

from typing import Any

import pytest

from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.elche import WindowReport
from flodl_bus.protocol import messages as m
from tests.coordinator.drive import beat, feed, make, metrics, msgs, plans, started, types


def test_first_dispatch_sends_the_role_before_any_start_epoch() -> None:
    _, out = started("nccl-sync", ws=3, total=100)
    assert types(out)[0] == "SetEpochCallbackRole"
    sizes = [p.partition_size for p in plans(out).values()]
    assert sizes == [34, 33, 33]


def test_one_chunk_in_flight_holds_a_barrier_paced_rank() -> None:
    core, out = started("nccl-cadence", total=1000)
    assert set(plans(out)) == {0, 1}
    feed(core, 0, 3)
    again = core.handle(0, metrics(0, 0, 0), 0.0)  # a zero-sample report retires nothing
    assert not plans(again)


def test_epoch_barrier_holds_a_fast_rank_until_the_epoch_aggregates() -> None:
    core, out = started("nccl-cadence", total=40, num_epochs=2)
    first = plans(out)
    feed(core, 0, first[0].partition_size)
    out0 = core.handle(0, metrics(0, 0, first[0].partition_size), 0.0)
    # Rank 0 may steal within epoch 0 but never start epoch 1 while rank 1 is busy.
    assert all(p.epoch == 0 for p in plans(out0).values())


def _cadence_run(overlap: bool, total: int = 50, epochs: int = 3) -> tuple[Coordinator, int, int]:
    """Two equal cpu-cadence ranks train ``epochs`` out, round by round: (core, plans
    handed out ahead of the epoch being aggregated, rounds)."""
    core, out = started(
        "cpu-cadence", total=total, num_epochs=epochs, anchor=16, epoch_overlap=overlap
    )
    # each rank's plans in the order it trains them (it may hold one ahead)
    holding: dict[int, list[m.EpochPlan]] = {r: [p] for r, p in plans(out).items()}
    now, early, rounds = 0.0, 0, 0
    for _ in range(1000):
        if not any(holding.values()):
            break
        now += 0.01
        outs: list[Any] = []
        for r in sorted(holding):
            if not holding[r]:
                continue
            plan = holding[r].pop(0)
            outs += feed(core, r, plan.partition_size, now=now)
            outs += core.handle(r, metrics(r, plan.epoch, plan.partition_size), now)
        outs += (tick := core.tick(now))
        if msgs(tick, m.RequestParams):
            rounds += 1
            for r in (0, 1):
                core.handle(r, m.SyncAck(r, 0), now)
            outs += core.tick(now)
        got = plans(outs) | {
            u.rank: u.msg.next_plan for u in msgs(outs, m.WireUpdate) if u.msg.next_plan
        }
        early += sum(p.epoch > core.last_aggregated + 1 for p in got.values())
        for r, p in got.items():
            holding.setdefault(r, []).append(p)
    return core, early, rounds


def test_a_cpu_rank_whose_epoch_has_nothing_left_starts_the_next_while_its_peer_finishes() -> None:
    # issue 27: no collective on the CPU plane can mix two epochs, so a rank with steps
    # left in its window and none left in its epoch goes on into the next one instead of
    # idling to the epoch's end; flodl's barrier stays where one can (nccl, above)
    core, early, rounds = _cadence_run(overlap=True)
    old, early_old, rounds_old = _cadence_run(overlap=False)  # records made before it
    for c in (core, old):
        assert c.last_aggregated == 2  # every epoch trained out and aggregated
        assert c.dispatch.coverage() == (3, [])  # no sample left untrained
    assert early > 0 and early_old == 0
    assert rounds < rounds_old  # the epoch's end no longer forces a round of its own
    assert started("cpu-async", total=40)[0].dispatch.overlaps  # type: ignore[attr-defined]
    assert not started("nccl-cadence", total=40)[0].dispatch.overlaps  # type: ignore[attr-defined]


def test_a_world_of_one_gets_the_next_epoch_and_its_eval_with_the_last_report() -> None:
    # records made before the plan ahead
    core, out = started(
        "cpu-cadence", ws=1, total=40, num_epochs=2, eval_every=1, solo_plans_ahead=False
    )
    plan = plans(out)[0]
    feed(core, 0, plan.partition_size)
    out = core.handle(0, metrics(0, 0, plan.partition_size), 0.0)
    # one transaction: the eval of epoch 0's model, queued before epoch 1's plan
    assert types(out) == ["ExecuteEvalCallback", "StartEpoch"]
    assert plans(out)[0].epoch == 1
    assert msgs(core.tick(0.0), m.EpochAggregated)


def test_a_world_of_one_holds_the_next_epochs_plan_with_its_eval_armed() -> None:
    # issue 27: the next epoch's plan reaches the rank while it trains this one, so no
    # epoch ends in a trip through Redis; the eval that epoch's start owes is armed
    core, out = started("cpu-cadence", ws=1, total=40, num_epochs=4, eval_every=1)
    assert [p.epoch for p in plans(out).values()] == [0]  # the mailbox holds one plan
    out = feed(core, 0, 1)  # its first Batch: plan 0 has left the mailbox
    assert types(out) == ["ArmEpochEval", "StartEpoch"]
    assert msgs(out, m.ArmEpochEval)[0].msg == m.ArmEpochEval(1, 1, 0)
    assert plans(out)[0] == m.EpochPlan(1, 0, 40)
    assert not feed(core, 0, 39)
    assert core.dispatch.rank_epochs() == [0]  # what it trains (status, saves), not holds
    # the report of epoch 0: plan 1 already held, nothing to send until 0 aggregates
    assert not plans(core.handle(0, metrics(0, 0, 40), 0.0))
    assert core.dispatch.rank_epochs() == [1]
    out = core.tick(0.0)
    assert types(out) == ["EpochAggregated", "ArmEpochEval", "StartEpoch"]
    assert plans(out)[0].epoch == 2
    assert not msgs(out, m.ExecuteEvalCallback)
    sent = []
    for epoch in (1, 2, 3):
        feed(core, 0, 40)
        sent += plans(core.handle(0, metrics(0, epoch, 40), 0.0) + core.tick(0.0)).values()
    assert [p.epoch for p in sent] == [3]  # epoch 3's plan went out as epoch 1 ended
    assert core.last_aggregated == 3
    assert core.dispatch.coverage() == (4, [])


def test_a_world_of_one_whose_plan_ahead_was_lost_is_sent_it_again_before_it_needs_it() -> None:
    core, _ = started("cpu-cadence", ws=1, total=40, num_epochs=3, eval_every=1)
    (ahead,) = msgs(feed(core, 0, 1), m.StartEpoch)
    core.send_failed(0, ahead.msg, 0.0)  # the plan never reached the rank
    # sent again while the rank still trains epoch 0 (its mailbox is empty), whole
    again = plans(feed(core, 0, 39) + core.tick(0.0))
    assert again == {0: m.EpochPlan(1, 0, 40)}
    assert not plans(core.handle(0, metrics(0, 0, 40), 0.0))
    for epoch in (1, 2):
        feed(core, 0, 40)
        core.handle(0, metrics(0, epoch, 40), 0.0)
        core.tick(0.0)
    assert core.last_aggregated == 2 and core.dispatch.coverage() == (3, [])


def test_a_world_of_one_plans_an_epoch_that_starts_with_a_checkpoint_when_it_starts() -> None:
    # a checkpoint is of the model at its epoch's start, taken on receipt: not armable
    core, out = started(
        "cpu-cadence", ws=1, total=40, num_epochs=3, eval_every=1, checkpoint_every=1
    )
    assert not plans(feed(core, 0, 40))
    out = core.handle(0, metrics(0, 0, 40), 0.0)
    assert types(out) == ["Checkpoint", "ExecuteEvalCallback", "StartEpoch"]


# ------------------------------------------- several ranks: the next epoch's plan ahead
def _left_out_start(**kw: Any) -> tuple[Coordinator, dict[int, m.EpochPlan]]:
    """Two cpu-cadence ranks of 16-step windows over 40-sample epochs: rank 0's first
    chunk (16) leaves 12, pinned as epoch 0's last window, all rank 0's; rank 1's first
    chunk (12) is its whole share of the epoch, and fills 12 of its 16 steps."""
    # chunks of one window each (``chunks_cross_windows`` has its own tests)
    kw.setdefault("chunks_cross_windows", False)
    core, out = started("cpu-cadence", total=40, num_epochs=3, anchor=16, **kw)
    first = plans(out)
    assert first == {0: m.EpochPlan(0, 0, 16), 1: m.EpochPlan(0, 20, 12)}
    assert core.elche.counts == [16, 16]
    return core, first


def _train_out(
    core: Coordinator,
    holding: dict[int, list[m.EpochPlan]],
    now: float,
    done: dict[int, int] | None = None,
) -> list[m.EpochPlan]:
    """The live ranks train what they hold, in order (a plan ahead after the current
    one, ``done`` batches of the current trained already), round by round, until every
    epoch is aggregated: the plans handed out meanwhile."""
    handed: list[m.EpochPlan] = []
    done = dict(done or {})
    for _ in range(1000):
        if core.last_aggregated == core.config.num_epochs - 1:
            break
        now += 0.01
        outs: list[Any] = []
        for r in sorted(holding):
            if holding[r] and core.alive(r):
                plan = holding[r].pop(0)
                outs += feed(core, r, plan.partition_size - done.pop(r, 0), now=now)
                outs += core.handle(r, metrics(r, plan.epoch, plan.partition_size), now)
        outs += core.tick(now)
        for nid in msgs(outs, m.RequestNewNcclId):
            outs += core.handle(nid.rank, m.NewNcclIdGenerated(nid.rank, bytes(128)), now)
        if msgs(outs, m.RequestParams):
            for r in sorted(holding):
                if core.alive(r):
                    core.handle(r, m.SyncAck(r, 0), now)
            outs += core.tick(now)
        got = [(o.rank, o.msg.plan) for o in msgs(outs, m.StartEpoch)]
        got += [(u.rank, u.msg.next_plan) for u in msgs(outs, m.WireUpdate) if u.msg.next_plan]
        for r, p in got:
            assert not holding[r]  # never two plans in the rank's one-plan mailbox
            holding[r].append(p)
            handed.append(p)
    return handed


def _tiles(plans_: list[m.EpochPlan], epochs: int, size: int) -> bool:
    """Each epoch's plans cover it exactly once: no sample twice, none left out."""
    for epoch in range(epochs):
        spans = sorted((p.partition_offset, p.partition_size) for p in plans_ if p.epoch == epoch)
        ends = [0] + [off + n for off, n in spans]
        if [off for off, _ in spans] != ends[:-1] or ends[-1] != size:
            return False
    return True


def test_a_cpu_cadence_rank_gets_its_next_epochs_chunk_once_it_began_its_last_share() -> None:
    # issue 27: a rank whose chunk ends its share of the epoch (here: epoch 0's last
    # window has no slot for it) is sent its first chunk of the next while it trains
    # that one, once it has begun it, so it never waits a trip through Redis for it
    core, _ = _left_out_start()
    assert not plans(core.tick(0.0))  # not begun: its mailbox still holds its plan
    assert not feed(core, 0, 1)  # epoch 0 still holds rank 0's last window
    ahead = plans(feed(core, 1, 1, now=0.5))  # rank 1 took its plan: the mailbox is free
    # sized by what its window has left once this chunk is trained: 16 - 12 steps
    assert ahead == {1: m.EpochPlan(1, 20, 4)}
    assert not plans(feed(core, 1, 11, now=0.5) + core.tick(0.5))  # never a second
    assert core.dispatch.rank_epochs() == [0, 0]  # what it trains, not what it holds
    # its report: nothing to send, it goes on into the plan it holds
    assert not plans(core.handle(1, metrics(1, 0, 12), 1.0) + core.tick(1.0))
    assert core.dispatch.rank_epochs() == [0, 1]
    # epoch 1's time counts from its start (rank 1's report), not from its plan's send
    assert core.dispatch.pools[1].created_at == 1.0  # type: ignore[attr-defined]
    assert not plans(feed(core, 1, 1))  # epoch 1 has work left for it: nothing ahead
    holding = {0: [m.EpochPlan(0, 0, 16)], 1: [ahead[1]]}
    handed = _train_out(core, holding, 1.0, done={0: 1, 1: 1})
    assert _tiles([m.EpochPlan(0, 0, 16), m.EpochPlan(0, 20, 12), ahead[1], *handed], 3, 40)
    assert core.last_aggregated == 2 and core.dispatch.coverage() == (3, [])


def test_a_cpu_cadence_rank_that_takes_its_epochs_last_chunk_holds_the_next_epochs() -> None:
    # the pool runs dry with the chunk the rank is given: at its first Batch of it the
    # rank is sent its next epoch's first chunk; a rank that holds one already gets none
    core, _ = _left_out_start()
    feed(core, 0, 1)
    feed(core, 1, 12)
    core.handle(1, metrics(1, 0, 12), 0.0)  # rank 1 goes on into (1, 20, 4), held ahead
    feed(core, 0, 15)
    bridge = plans(core.handle(0, metrics(0, 0, 16), 0.0))[0]  # at its count: a bridge
    assert bridge == m.EpochPlan(0, 16, 4)
    feed(core, 0, 1)
    out = feed(core, 1, 4) + core.tick(0.01)  # rank 1 trained (1, 20, 4): the round
    assert msgs(out, m.RequestParams) and not plans(out)
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 0.01)
    core.tick(0.01)
    feed(core, 0, 3)
    assert plans(core.handle(0, metrics(0, 0, 4), 0.02)) == {0: m.EpochPlan(0, 36, 4)}
    # rank 0, left out of what epoch 0 keeps for rank 1, holds its next chunk too
    assert plans(feed(core, 0, 1)) == {0: m.EpochPlan(1, 0, 9)}
    # rank 1 takes epoch 0's last chunk: rank 0 holds a plan ahead, it gets no other
    last = plans(core.handle(1, metrics(1, 1, 4), 0.02))
    assert last == {1: m.EpochPlan(0, 32, 4)} and core.dispatch.remaining()[0] == 0
    # rank 1's first Batch of it: its next epoch's chunk (epoch 1's last window slot)
    assert plans(feed(core, 1, 1)) == {1: m.EpochPlan(1, 24, 13)}
    held = [[(0, 36, 4), (1, 0, 9)], [(0, 32, 4), (1, 24, 13)]]
    holding = {r: [m.EpochPlan(*p) for p in held[r]] for r in (0, 1)}
    handed = _train_out(core, holding, 0.02, done={0: 1, 1: 1})
    before = [(0, 0, 16), (0, 20, 12), (1, 20, 4), (0, 16, 4), *held[0], *held[1]]
    assert _tiles([m.EpochPlan(*p) for p in before] + handed, 3, 40)
    assert core.last_aggregated == 2 and core.dispatch.coverage() == (3, [])


def test_a_cpu_rank_whose_plan_ahead_was_lost_is_sent_it_again_while_it_trains() -> None:
    core, _ = _left_out_start()
    (ahead,) = msgs(feed(core, 1, 1), m.StartEpoch)
    core.send_failed(1, ahead.msg, 0.0)  # the plan never reached the rank
    assert not core.dispatch.pools[1].has_in_flight(1)  # type: ignore[attr-defined]
    # offered again on the next tick, while the rank still trains its last share
    assert plans(core.tick(0.01)) == {1: m.EpochPlan(1, 20, 4)}
    assert not plans(feed(core, 1, 11) + core.tick(0.02))
    assert not plans(core.handle(1, metrics(1, 0, 12), 0.03))


def test_no_chunk_ahead_for_a_rank_whose_chunk_fills_its_window() -> None:
    # each rank's chunk is its whole window (10 of 10 steps): the round that closes the
    # window hands out the next chunks, not a plan ahead
    core, out = started(
        "cpu-cadence", total=20, num_epochs=3, anchor=16, chunks_cross_windows=False
    )
    assert plans(out) == {0: m.EpochPlan(0, 0, 10), 1: m.EpochPlan(0, 10, 10)}
    assert not feed(core, 0, 10) + feed(core, 1, 10)
    assert not plans(core.handle(0, metrics(0, 0, 10), 0.0))
    assert not plans(core.handle(1, metrics(1, 0, 10), 0.0))
    out = core.tick(0.0)
    assert types(out) == ["EpochAggregated", "RequestParams", "StartEpoch", "StartEpoch"]


def test_an_epoch_that_starts_with_a_checkpoint_is_not_planned_ahead() -> None:
    # a checkpoint is of the model at its epoch's start, taken on receipt
    core, _ = _left_out_start(checkpoint_every=1)
    assert not feed(core, 1, 12)
    out = core.handle(1, metrics(1, 0, 12), 0.0)
    assert types(out) == ["Checkpoint", "StartEpoch"] and plans(out)[1].epoch == 1


def test_records_made_before_plans_ahead_send_the_next_epoch_with_the_report() -> None:
    core, _ = _left_out_start(plans_ahead=False)
    assert not feed(core, 1, 12) + core.tick(0.0)
    assert plans(core.handle(1, metrics(1, 0, 12), 0.0)) == {1: m.EpochPlan(1, 20, 4)}
    assert not core.dispatch._ahead_multi  # type: ignore[attr-defined]


def test_a_rank_that_dies_holding_a_plan_ahead_loses_no_sample() -> None:
    core, _ = _left_out_start()
    ahead = plans(feed(core, 1, 1))[1]
    assert ahead == m.EpochPlan(1, 20, 4)
    feed(core, 1, 5)
    core.declare_dead(1, 1.0)
    pools = core.dispatch.pools  # type: ignore[attr-defined]
    # both of its plans are back in their epochs, whole (its 6 batches were never
    # reported: they are trained again)
    assert [pools[e].in_flight(1) for e in (0, 1)] == [0, 0]
    assert core.dispatch.remaining() == {0: 24, 1: 40}
    handed = _train_out(core, {0: [m.EpochPlan(0, 0, 16)], 1: []}, 1.0)
    assert {p.epoch for p in handed} == {0, 1, 2}
    assert _tiles([m.EpochPlan(0, 0, 16), *handed], 3, 40)  # rank 0 trained it all
    assert core.last_aggregated == 2 and core.dispatch.coverage() == (3, [])


def test_dead_rank_remainder_redistributed_via_extend_partition() -> None:
    core, out = started("cpu-sync", ws=3, total=30)
    assert [p.partition_size for p in plans(out).values()] == [10, 10, 10]
    beat(core, [0, 1], 31.0)
    out = core.tick(31.0)
    ext = [(o.rank, o.msg) for o in msgs(out, m.ExtendPartition)]
    assert ext == [(0, m.ExtendPartition(20, 5)), (1, m.ExtendPartition(25, 5))]


def test_dead_rank_partial_progress_is_not_redistributed() -> None:
    core, _ = started("cpu-sync", ws=3, total=30)
    feed(core, 2, 4)
    beat(core, [0, 1], 31.0)
    ext = msgs(core.tick(31.0), m.ExtendPartition)
    assert sum(o.msg.partition_size for o in ext) == 6
    assert min(o.msg.partition_offset for o in ext) == 24


@pytest.mark.parametrize("with_request", [True, False])
def test_progressive_death_forfeits_chunks_to_survivors(with_request: bool) -> None:
    # Bridges off: ranks 0 and 1 at their counts would each hold a bridge while rank 2
    # is silent, and the reclaimed range would follow it instead of the round.
    core, out = started(
        "cpu-cadence", ws=3, total=300, plans_with_request=with_request, cpu_bridges=False
    )
    first = plans(out)
    for r in (0, 1):
        feed(core, r, first[r].partition_size)
        core.handle(r, metrics(r, 0, first[r].partition_size), 1.0)
    beat(core, [0, 1], 31.0)
    out = core.tick(31.0)
    assert core.live.dead == [False, False, True]
    assert not core.dispatch.pools[0].has_in_flight(2)
    assert msgs(out, m.RequestParams)  # the dead rank no longer holds the gate
    behind_request = plans(out)
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 31.1)
    updates = {o.rank: o.msg.next_plan for o in msgs(core.tick(31.2), m.WireUpdate)}
    # reclaimed ranges are served first: rank 0's next chunk is rank 2's lost one, behind
    # the round's RequestParams (issue 27) or, in records made before, on its Update
    nxt = behind_request if with_request else updates
    assert nxt[0] == first[2]
    assert 2 not in nxt
    if with_request:
        assert set(updates.values()) == {None}


def test_failed_start_epoch_is_rolled_back_and_reoffered_on_the_next_tick() -> None:
    core, out = started("nccl-cadence", total=1000)
    lost = msgs(out, m.StartEpoch)[0]
    core.send_failed(lost.rank, lost.msg, 0.0)
    assert not core.dispatch.pools[0].has_in_flight(lost.rank)
    again = plans(core.tick(0.01))
    assert again == {lost.rank: lost.msg.plan}  # the cursor was rewound: same chunk


def _calibrated(mode: str, **kw: Any) -> tuple[Coordinator, dict[int, m.EpochPlan]]:
    core = make(mode, total=1000, **kw)
    core.elche.report_window(WindowReport((10.0, 40.0)))  # rank 1 is 4x slower
    assert core.elche.counts == [40, 10]
    return core, plans(core.start(0.0))


def test_nccl_cadence_bridges_a_full_window_by_the_slow_ranks_owed_wall_time() -> None:
    core, first = _calibrated("nccl-cadence")
    assert (first[0].partition_size, first[1].partition_size) == (40, 10)
    feed(core, 1, 7, ms=40.0)
    feed(core, 0, 40)
    out = core.handle(0, metrics(0, 0, 40), 0.0)
    # rank 1 owes 3 batches of 40 ms: 120 ms of rank 0's 10 ms batches
    assert [p.partition_size for p in plans(out).values()] == [12]
    assert core.gate() == (False, "rank 1 at 7/10 steps")
    feed(core, 0, 5)  # bridging: its steps run past its count, the gate waits on rank 1
    feed(core, 1, 3, ms=40.0)
    assert not plans(core.handle(1, metrics(1, 0, 10), 0.1))  # the gate is open
    out = core.tick(0.1)
    assert msgs(out, m.SyncNow)
    # rank 0 still holds its bridge: the reduce's wake-up sends only rank 1 a window,
    # and the bridge's rest counts in the next window
    assert set(plans(out)) == {1}
    feed(core, 0, 2)
    assert core.ledger.steps == [2, 0]


def test_a_cpu_cadence_rank_at_its_count_bridges_through_the_round_and_covers_each_epoch_once() -> (
    None
):
    # issue 27: a cpu-cadence rank keeps the steps it takes after its snapshot on top of
    # the consensus (--overlap-rounds), so a full window no longer has to idle
    core, first = _calibrated("cpu-cadence", num_epochs=2, chunks_cross_windows=False)
    handed = [(p.epoch, p.partition_offset, p.partition_size) for p in first.values()]
    feed(core, 1, 7, ms=40.0)
    feed(core, 0, 40)
    out = core.handle(0, metrics(0, 0, 40), 0.0)
    # rank 1 owes 3 batches of 40 ms: 120 ms of rank 0's 10 ms batches, then its next
    # window (40) in the same plan
    bridge = plans(out)[0]
    assert bridge.partition_size == 12 + 40 and set(plans(out)) == {0}
    handed.append((bridge.epoch, bridge.partition_offset, bridge.partition_size))
    feed(core, 0, 5)  # bridging: past its count, the gate waits on rank 1 alone
    assert core.gate() == (False, "rank 1 at 7/10 steps")
    feed(core, 1, 3, ms=40.0)
    out = core.handle(1, metrics(1, 0, 10), 0.1) + core.tick(0.1)
    # the round goes out at rank 1's count, not at the bridge's end; behind it only rank
    # 1's next chunk: rank 0 is still on its bridge (one chunk in flight)
    assert types(out)[0] == "RequestParams" and set(plans(out)) == {1}
    assert core.ledger.steps == [0, 0]
    feed(core, 0, 47)  # the bridge's rest, after the trigger: the next window's
    assert core.ledger.steps == [47, 0]
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 0.1)
    assert msgs(core.tick(0.1), m.WireUpdate)
    # each rank's plans in the order it trains them (it may hold one ahead)
    holding = {0: [bridge], 1: [plans(out)[1]]}
    handed += [(p.epoch, p.partition_offset, p.partition_size) for p in plans(out).values()]
    done = {0: 47, 1: 0}
    now, bridges = 0.1, 0
    for _ in range(10_000):  # every rank trains what it holds out, round by round
        if not any(holding.values()):
            break
        now += 0.01
        outs: list[Any] = []
        for r in sorted(holding):
            if not holding[r]:
                continue
            plan = holding[r].pop(0)
            outs += feed(core, r, plan.partition_size - done.pop(r, 0), now=now, ms=10.0 + 30.0 * r)
            full = core.ledger.steps[r] >= core.elche.counts[r]
            reply = core.handle(r, metrics(r, plan.epoch, plan.partition_size), now)
            bridges += full and r in plans(reply)  # sent past its window's count
            outs += reply
        outs += core.tick(now)
        if msgs(outs, m.RequestParams):
            for r in (0, 1):
                core.handle(r, m.SyncAck(r, 0), now)
            outs += core.tick(now)
        got = plans(outs)
        handed += [(p.epoch, p.partition_offset, p.partition_size) for p in got.values()]
        for r, p in got.items():
            holding[r].append(p)
    assert core.last_aggregated == 1 and core.dispatch.coverage() == (2, [])
    assert bridges > 0
    for epoch in (0, 1):  # what was handed out tiles each epoch: no sample twice, none left
        spans = sorted((off, size) for e, off, size in handed if e == epoch)
        ends = [0] + [off + size for off, size in spans]
        assert [off for off, _ in spans] == ends[:-1] and ends[-1] == 1000


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence"])
def test_no_bridge_once_the_gate_is_open_nor_where_it_does_not_apply(mode: str) -> None:
    core, _ = _calibrated(mode)
    feed(core, 1, 10, ms=40.0)
    feed(core, 0, 40)
    # every window is full: the reduce fires on this tick, nothing to bridge
    assert not plans(core.handle(0, metrics(0, 0, 40), 0.0))
    assert core.should_average()
    for kw in ({"cpu_bridges": False}, {"mode": "cpu-async"}):
        core, _ = _calibrated(**({"mode": "cpu-cadence"} | kw))
        feed(core, 1, 7, ms=40.0)
        feed(core, 0, 40)
        # a cpu rank whose round steps are not kept (records made before cpu bridges,
        # --overlap-rounds false) would have its work after the snapshot overwritten;
        # cpu-async overshoots its window instead
        assert not plans(core.handle(0, metrics(0, 0, 40), 0.0))


def test_a_bridge_never_crosses_the_epoch_barrier() -> None:
    core, _ = _calibrated("nccl-cadence", num_epochs=2)
    pool = core.dispatch.pools[0]  # type: ignore[attr-defined]
    feed(core, 1, 5, ms=40.0)
    feed(core, 0, 40)
    out = core.handle(0, metrics(0, 0, 40), 0.0)
    # drain epoch 0 through rank 0's bridges: none ever comes from epoch 1
    while got := plans(out):
        assert got[0].epoch == 0
        feed(core, 0, got[0].partition_size)
        out = core.handle(0, metrics(0, 0, got[0].partition_size), 0.0)
    assert pool.remaining() == 0 and 1 not in core.dispatch.pools  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["cpu-cadence", "cpu-async", "nccl-cadence"])
def test_a_world_of_one_gets_each_epoch_in_one_plan_and_still_closes_its_windows(
    mode: str,
) -> None:
    core, out = started(mode, ws=1, total=200, num_epochs=2)
    assert [(p.epoch, p.partition_offset, p.partition_size) for p in plans(out).values()] == [
        (0, 0, 200)
    ]
    out = []
    for _ in range(200):  # the runtime ticks between reads
        out += feed(core, 0, 1)
        out += core.tick(0.01)
    # windows closed while the plan ran (no round: the version counts them)
    assert core.version >= 200 // max(core.elche.counts[0], 1) - 1 >= 4
    out += core.handle(0, metrics(0, 0, 200), 0.02)
    out += core.tick(0.03)
    assert [(p.epoch, p.partition_size) for p in plans(out).values()] == [(1, 200)]


@pytest.mark.parametrize(("mode", "cross", "sizes"), [
    ("cpu-cadence", True, [6, 6]),
    ("cpu-cadence", False, [3, 3]),  # records made before chunks crossed windows
    ("nccl-cadence", True, [3, 3]),  # a blocking collective takes no rank mid-chunk
])  # fmt: skip
def test_a_cpu_cadence_chunk_carries_the_next_window_and_the_round_comes_mid_chunk(
    mode: str, cross: bool, sizes: list[int]
) -> None:
    # issue 27: the rank no longer stops at its count until the round brings its next
    # chunk; it takes the round between two batches and trains on
    core, out = started(mode, anchor=3, chunks_cross_windows=cross)
    assert [p.partition_size for p in plans(out).values()] == sizes
    if mode != "cpu-cadence" or not cross:
        return
    feed(core, 0, 3)
    out = feed(core, 1, 3) + core.tick(0.0)
    # the round at the count, and no plan with it: each rank still holds 3 batches
    assert msgs(out, m.RequestParams) and not plans(out)
    assert core.ledger.steps == [0, 0]
    feed(core, 0, 3)  # the rest of the chunk, after the trigger: the next window's
    assert core.ledger.steps == [3, 0]
