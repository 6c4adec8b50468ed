"""The reduce cycle (``coordinator.reduce``) through the core: the gate, NCCL acks,
reduce cycles and the global step, throttle, the stall ceiling, async overshoot
(reference §4.4-§4.8, §4.10.6)."""

from __future__ import annotations

from typing import Any

import pytest

from flodl_bus.coordinator.config import MODES
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.elche import WindowReport
from flodl_bus.coordinator.ledger import Ledger
from flodl_bus.protocol import messages as m
from tests.coordinator.drive import beat, feed, make, metrics, msgs, plans, started, types


def test_sync_gate_needs_at_least_one_step_on_every_rank() -> None:
    core, _ = started("nccl-sync")
    feed(core, 0, 5)
    assert not core.should_average()
    feed(core, 1, 1)
    assert core.should_average()


def test_async_gate_needs_batch_counts_uncalibrated_ten_each() -> None:
    core, _ = started("cpu-async", total=1000)
    feed(core, 0, 10)
    feed(core, 1, 9)
    assert not core.should_average()
    assert "rank 1 at 9/10" in core.gate()[1]
    feed(core, 1, 1)
    assert core.should_average()


def test_cadence_gate_fires_on_batch_counts_even_with_pathological_slow_ms() -> None:
    core, _ = started("nccl-cadence")
    # A wildly wrong slow-rank estimate: the count gate must still be reachable.
    core.elche.report_window(WindowReport((10.0, 1e9)))
    counts = core.elche.counts
    assert counts == [640, 10]
    feed(core, 0, counts[0] - 1)
    feed(core, 1, counts[1])
    assert not core.should_average()
    feed(core, 0, 1)
    assert core.should_average()


def test_cpu_rearm_is_independent_of_nccl_ack() -> None:
    core, _ = started("cpu-sync")
    feed(core, 0, 1)
    feed(core, 1, 1)
    out = core.tick(0.01)
    assert types(out)[:2] == ["Throttle", "RequestParams"]
    # A bridge SyncAck carrying a sentinel step count must not poison later re-arms.
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 2**62, 0.01, 1.0, 1.0), 0.02)
    out = core.tick(0.03)
    assert [o.msg for o in msgs(out, m.WireUpdate)] == [m.WireUpdate(1), m.WireUpdate(1)]
    assert core.reduce.last_step_count == [1, 1]
    feed(core, 0, 1)
    feed(core, 1, 1)
    assert core.should_average()


def test_cpu_gate_blocks_while_a_cycle_is_in_flight() -> None:
    core, _ = started("cpu-sync")
    feed(core, 0, 1)
    feed(core, 1, 1)
    core.tick(0.01)
    feed(core, 0, 3)
    feed(core, 1, 3)
    assert core.gate() == (False, "cpu cycle in flight")
    core.handle(0, m.SyncAck(0, 0), 0.02)
    assert not msgs(core.tick(0.02), m.WireUpdate)  # rank 1's bridge has not acked
    core.handle(1, m.SyncAck(1, 0), 0.03)
    order = types(core.tick(0.04))
    # the round closes, and the steps taken during it open the next one at once
    assert order[:3] == ["WireUpdate", "WireUpdate", "SetGlobalStep"]
    assert order[3:5] == ["Throttle", "RequestParams"]


def test_quiesced_zero_step_tail_rank_does_not_block_reduce() -> None:
    # 10 batches, counts 4/4, spans 5/5: the tail split pins rank 1's last slot at 3.
    # the gate's rule alone: a bridge would feed rank 1
    core = make("nccl-cadence", total=10, anchor=4, bridge_idle=False)
    first = plans(core.start(0.0))
    assert first == {0: m.EpochPlan(0, 0, 4), 1: m.EpochPlan(0, 5, 3)}
    for r, plan in first.items():
        feed(core, r, plan.partition_size)
        core.handle(r, metrics(r, 0, plan.partition_size), 0.0)
    assert plans(core.tick(0.01)) == {0: m.EpochPlan(0, 4, 1)}
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 10), 0.02)
    feed(core, 0, 1)
    out = core.handle(0, metrics(0, 0, 1), 0.02)
    assert plans(out) == {0: m.EpochPlan(0, 8, 2)}  # the last 2 batches, stolen
    feed(core, 0, 1)
    assert core.gate() == (False, "rank 0 at 2/4 steps")  # rank 0 still owes its chunk
    feed(core, 0, 1)
    core.handle(0, metrics(0, 0, 2), 0.03)
    # rank 1 has zero steps, nothing in flight and nothing left: it cannot block
    assert core.ledger.steps == [3, 0]
    assert core.dispatch.pools[0].remaining() == 0
    assert core.should_average()


def _round(core: Coordinator, now: float) -> None:
    """One cpu round: the trigger, every rank's bridge ack, the Update."""
    assert types(core.tick(now))[-2:] == ["Throttle", "RequestParams"]
    for r in range(core.ws):
        core.handle(r, m.SyncAck(r, 0), now)
    assert msgs(core.tick(now), m.WireUpdate)


def test_fixed_partition_rank_done_with_its_share_holds_the_gate_for_the_tail() -> None:
    # flodl's non-progressive gate: the rank still working trains its tail without
    # rounds that would average its few steps with a model that took none.
    core, out = started("cpu-sync", total=20, num_epochs=2)
    assert plans(out) == {0: m.EpochPlan(0, 0, 10), 1: m.EpochPlan(0, 10, 10)}
    feed(core, 0, 10)
    core.handle(0, metrics(0, 0, 10), 0.0)
    feed(core, 1, 1)
    _round(core, 0.01)
    assert core.dispatch.quiesced(0)
    feed(core, 1, 3)
    assert core.gate() == (False, "rank 0 at 0/1 steps")
    assert not msgs(core.tick(0.02), m.RequestParams)
    feed(core, 1, 6)
    out = core.handle(1, metrics(1, 0, 10), 0.03)
    out += core.tick(0.03)
    assert not msgs(out, m.RequestParams)
    assert set(plans(out)) == {0, 1}  # the next epoch, the tail's 9 steps not averaged yet
    feed(core, 0, 1)
    assert core.ledger.steps == [1, 9]
    assert core.should_average()


def test_fixed_partition_spares_a_done_rank_when_a_throttled_rank_waits_for_a_round() -> None:
    core, _ = started("cpu-sync", total=20, max_batch_diff=0)
    feed(core, 0, 10)  # its share trained; its end-of-share report is still on the way
    feed(core, 1, 1)
    _round(core, 0.01)
    feed(core, 1, 2)
    held = core.tick(0.02)
    assert [o.rank for o in msgs(held, m.Throttle)] == [1]
    core.handle(0, metrics(0, 0, 10), 0.03)
    # rank 1 waits for the Update that releases it: rank 0's empty window cannot hold it
    assert core.should_average(), core.gate()


def test_slot_zero_final_window_rank_does_not_block_the_gate() -> None:
    # the gate's rule alone: a bridge would feed rank 2
    core = make("nccl-cadence", ws=3, total=18, anchor=1, bridge_idle=False)
    core.elche.report_window(WindowReport((10.0, 10.0, 60.0)))
    assert core.elche.counts == [6, 6, 1]
    out = core.start(0.0)
    # after rank 0's take 12 batches are left (< 13 + 3): the split [6, 6, 0] is pinned
    assert {r: p.partition_size for r, p in plans(out).items()} == {0: 6, 1: 6}
    assert core.dispatch.final_windows[0].slots == [6, 0, 0]
    for r in (0, 1):
        feed(core, r, 6)
        core.handle(r, metrics(r, 0, 6), 0.0)
    assert core.dispatch.pools[0].remaining() == 6  # rank 0's next slot, held by its budget
    # rank 2 holds a zero slot: with zero steps it must not hold the reduce
    assert core.ledger.steps == [6, 6, 0]
    assert core.should_average(), core.gate()


def test_no_reduce_without_a_mover() -> None:
    core, _ = started("nccl-cadence", total=8)
    assert core.gate() == (False, "no rank moved") or not core.should_average()


def test_sync_ack_above_snapshot_acks_and_reopens_the_gate() -> None:
    core, _ = started("nccl-sync")
    feed(core, 0, 2)
    feed(core, 1, 3)
    out = core.tick(0.01)
    assert msgs(out, m.SyncNow)
    feed(core, 0, 0)
    assert core.reduce.acked == [False, False]
    core.handle(0, m.SyncAck(0, 2, 0.1, 1.0, 1.0), 0.02)  # not above snapshot 2
    assert core.reduce.acked == [False, False]
    core.handle(0, m.SyncAck(0, 3, 0.1, 1.0, 1.0), 0.02)
    core.handle(1, m.SyncAck(1, 4, 0.1, 1.0, 1.0), 0.03)
    assert core.reduce.acked == [True, True]
    assert abs(core.reduce.last_sync_ms - 20.0) < 1e-9


def test_sync_ack_never_inflates_steps() -> None:
    core, _ = started("nccl-sync")
    feed(core, 0, 1)
    core.handle(0, m.SyncAck(0, 7), 0.0)
    assert core.ledger.steps == [1, 0]
    assert core.ledger.wall_ms == [10.0, 0.0]
    assert core.reduce.last_step_count[0] == 7


def test_second_sync_now_waits_for_every_ack() -> None:
    core, _ = started("nccl-sync")
    feed(core, 0, 1)
    feed(core, 1, 1)
    assert msgs(core.tick(0.01), m.SyncNow)
    core.handle(0, m.SyncAck(0, 2), 0.02)
    feed(core, 0, 1)
    assert not core.should_average()
    assert "has not acked" in core.gate()[1]


def test_set_global_step_after_reduce_is_the_sum_of_window_steps() -> None:
    core, _ = started("nccl-sync")
    feed(core, 0, 3)
    feed(core, 1, 2)
    out = core.tick(0.01)
    assert types(out)[:2] == ["SyncNow", "SetGlobalStep"]
    assert msgs(out, m.SetGlobalStep)[0].msg.global_step == 5
    assert core.version == 1 and core.ledger.steps == [0, 0]


def test_cpu_sync_wire_order_throttle_request_params_update_set_global_step() -> None:
    core, _ = started("cpu-sync")
    feed(core, 0, 2)
    feed(core, 1, 1)
    order = types(core.tick(0.01))
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 0.02)
    order += types(core.tick(0.02))
    # Throttle first: the in-process Update must never reach a rank before its Throttle.
    assert order == ["Throttle", "RequestParams", "WireUpdate", "WireUpdate", "SetGlobalStep"]
    assert core.global_step == 3


def test_cpu_subtracts_the_trigger_snapshot_so_overshoot_steps_survive() -> None:
    core, _ = started("cpu-async")
    feed(core, 0, 10)
    feed(core, 1, 10)
    core.tick(0.01)
    feed(core, 0, 2)  # trained during the round
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 0.02)
    core.tick(0.02)
    assert core.global_step == 20
    assert core.ledger.steps == [2, 0]


def _train(core: Coordinator, chunks: dict[int, m.EpochPlan], now: float) -> None:
    """Every rank trains its chunk, then every rank reports it: no rank is at its count
    while a peer still owes steps (it would get a bridge, ``test_bridge_cpu``)."""
    for r, plan in chunks.items():
        feed(core, r, plan.partition_size, now=now)
    for r, plan in chunks.items():
        core.handle(r, metrics(r, plan.epoch, plan.partition_size), now)


def test_cpu_cadence_update_carries_the_next_chunk_in_records_made_before_issue_27() -> None:
    core, out = started("cpu-cadence", total=1000, plans_with_request=False, cpu_bridges=False)
    for r, plan in plans(out).items():
        feed(core, r, plan.partition_size)
        core.handle(r, metrics(r, 0, plan.partition_size), 0.0)
    assert msgs(core.tick(0.01), m.RequestParams)
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 0.02)
    updates = msgs(core.tick(0.02), m.WireUpdate)
    assert all(u.msg.next_plan is not None for u in updates)
    assert {u.rank for u in updates} == {0, 1}


def test_cpu_cadence_sends_the_next_chunk_right_behind_request_params() -> None:
    core, out = started("cpu-cadence", total=1000)
    _train(core, plans(out), 0.0)
    out = core.tick(0.01)
    kinds = types(out)
    assert kinds.index("RequestParams") < kinds.index("StartEpoch")
    early = plans(out)
    assert set(early) == {0, 1} and all(p.epoch == 0 for p in early.values())
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 0.02)
    # the round's end carries no second plan: one chunk in flight per rank
    updates = msgs(core.tick(0.02), m.WireUpdate)
    assert {u.rank for u in updates} == {0, 1}
    assert all(u.msg.next_plan is None for u in updates)


def test_the_last_round_of_an_epoch_sends_the_next_epochs_chunks_after_its_aggregate() -> None:
    core, out = started("cpu-cadence", total=40, num_epochs=2, chunks_cross_windows=False)
    _train(core, plans(out), 0.0)
    for _ in range(100):  # train epoch 0 out, round by round
        out = core.tick(0.01)
        if msgs(out, m.EpochAggregated):
            break
        assert msgs(out, m.RequestParams)
        for r in (0, 1):
            core.handle(r, m.SyncAck(r, 0), 0.02)
        _train(core, plans(out), 0.03)
    else:
        raise AssertionError("epoch 0 never aggregated")
    kinds = types(out)
    # the epoch is aggregated first, then the round, then epoch 1's chunks behind it
    assert kinds.index("EpochAggregated") < kinds.index("RequestParams")
    assert kinds.index("RequestParams") < kinds.index("StartEpoch")
    assert {p.epoch for p in plans(out).values()} == {1}


def throttled_after(mode: str, steps: tuple[int, int], d: int | None) -> list[int]:
    core, _ = started(mode, max_batch_diff=d)
    feed(core, 0, steps[0])
    feed(core, 1, steps[1])
    return [o.rank for o in msgs(core.tick(0.01), m.Throttle)]


def test_throttle_sends_only_to_the_leader_when_diff_exceeded() -> None:
    assert throttled_after("cpu-sync", (5, 0), 3) == [0]


def test_throttle_no_send_within_limit() -> None:
    assert throttled_after("cpu-sync", (3, 0), 5) == []


def test_throttle_zero_is_strict_lockstep() -> None:
    assert throttled_after("cpu-sync", (1, 0), 0) == [0]


def test_throttle_skipped_for_nccl() -> None:
    assert throttled_after("nccl-sync", (5, 0), 3) == []


def test_throttle_disabled_when_none() -> None:
    assert throttled_after("cpu-sync", (5, 0), None) == []


def test_reduce_stall_ceiling_escalates_and_a_fresh_cycle_is_not_a_stall() -> None:
    core, _ = started("nccl-sync")
    feed(core, 0, 1)
    feed(core, 1, 1)
    core.tick(1.0)
    beat(core, [0, 1], 250.0)
    core.tick(250.0)
    assert not core.finished
    beat(core, [0, 1], 301.5)
    out = core.tick(301.5)
    assert core.finish_reason is m.SaveReason.REDUCE_STALL
    assert msgs(out, m.ShutdownWithSave)


def test_async_overshoot_auto_tunes_and_a_user_value_pins_it() -> None:
    core, _ = started("cpu-async")
    assert core.max_overshoot == 3
    for r in (0, 1):
        feed(core, r, 10)
    core.tick(0.01)
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0, 0.01, 1.0, 1.0), 0.02)
    core.tick(0.02)
    assert core.version == 1 and core.max_overshoot == 4
    pinned, _ = started("cpu-async", max_overshoot=7)
    for r in (0, 1):
        feed(pinned, r, 10)
    pinned.tick(0.01)
    for r in (0, 1):
        pinned.handle(r, m.SyncAck(r, 0), 0.02)
    pinned.tick(0.02)
    assert pinned.version == 1 and pinned.max_overshoot == 7


@pytest.mark.parametrize("mode", MODES)
def test_a_world_of_one_closes_its_windows_without_a_round_or_a_global_step(mode: str) -> None:
    core, _ = started(mode, ws=1, total=100)
    feed(core, 0, 12)
    out = core.tick(0.01)
    # The average of one model is the model: nothing goes to the rank, whose own step
    # counter (never reset by a round) already places its LR.
    assert not {"SyncNow", "RequestParams", "Throttle", "SetGlobalStep", "WireUpdate"} & set(
        types(out)
    )
    assert core.version == 1 and core.global_step == 12 and core.ledger.steps == [0]
    assert core.reduce.settled() and core.should_average() is False
    fed = 0
    while not core.should_average():
        feed(core, 0, 1)
        fed += 1
    core.tick(0.02)
    assert core.version == 2 and core.global_step == 12 + fed


def test_only_a_sync_ack_acks_a_round_and_records_before_bridges_keep_the_batch_ack() -> None:
    for bridge_idle in (True, False):
        core, _ = started("nccl-sync", bridge_idle=bridge_idle)
        feed(core, 0, 1)
        feed(core, 1, 1)
        assert msgs(core.tick(0.01), m.SyncNow)
        # A batch above the snapshot may have been trained before the SyncNow arrived.
        feed(core, 0, 1)
        feed(core, 1, 1)
        assert core.reduce.settled() is not bridge_idle
        core.handle(0, m.SyncAck(0, 3), 0.02)
        core.handle(1, m.SyncAck(1, 3), 0.02)
        assert core.reduce.settled()


def test_a_world_of_one_in_a_record_made_before_still_averages_alone() -> None:
    core, _ = started("nccl-sync", ws=1, total=100, solo_without_rounds=False)
    feed(core, 0, 1)
    assert types(core.tick(0.01))[:2] == ["SyncNow", "SetGlobalStep"]


# ----------------------------------------------------------- the delivered timing feed
def window_of(
    steps: list[int], wall: list[float], delivered: list[float], batches: list[int]
) -> Ledger:
    w = Ledger(len(steps))
    w.steps, w.wall_ms = list(steps), list(wall)
    w.delivered_ms, w.delivered_batches = list(delivered), list(batches)
    return w


def test_movers_delivered_complete_requires_every_mover() -> None:
    core = make("cpu-cadence")
    w = window_of([4, 4], [40.0, 100.0], [80.0, 0.0], [4, 0])
    assert not core.reduce.movers_delivered_complete(w)
    w.delivered_ms[1], w.delivered_batches[1] = 200.0, 4
    assert core.reduce.movers_delivered_complete(w)


def test_movers_delivered_complete_ignores_idle_and_dead_ranks() -> None:
    core = make("cpu-cadence", ws=3)
    core.start(0.0)
    core.declare_dead(2, 0.0)
    # rank 1 idle this window (a quiesced tail), rank 2 stepped before it died
    w = window_of([4, 0, 4], [40.0, 0.0, 40.0], [80.0, 0.0, 0.0], [4, 0, 0])
    assert core.reduce.movers_delivered_complete(w)


def test_a_mover_whose_callback_time_took_all_its_delivered_time_has_no_sample() -> None:
    core = make("cpu-cadence")
    w = window_of([4, 4], [40.0, 100.0], [80.0, 200.0], [3, 3])
    w.delivered_ms[1] = 0.0  # Ledger.exclude clamps at 0 after a long eval
    assert not core.reduce.movers_delivered_complete(w)
    assert core.reduce.timing_feed(w) == ([40.0, 100.0], [4, 4])


def test_timing_feed_all_or_none_falls_back_to_compute_scale() -> None:
    # Rank 0's delivered cost is twice its compute; rank 1 has no delivered sample:
    # mixing the two scales would make rank 0 look 5x slower, not 2.5x.
    core = make("cpu-cadence")
    w = window_of([4, 4], [40.0, 100.0], [80.0, 0.0], [4, 0])
    assert core.reduce.timing_feed(w) == ([40.0, 100.0], [4, 4])
    assert core.reduce.window_report(w, 0.0).ms_per_batch == (10.0, 25.0)


def test_timing_feed_uses_delivered_when_window_complete() -> None:
    core = make("cpu-cadence")
    w = window_of([4, 4], [40.0, 100.0], [80.0, 220.0], [4, 4])
    assert core.reduce.timing_feed(w) == ([80.0, 220.0], [4, 4])
    assert core.reduce.window_report(w, 0.0).ms_per_batch == (20.0, 55.0)


def test_window_report_gives_each_mover_its_own_fill_on_the_delivered_scale() -> None:
    core = make("cpu-cadence")
    w = window_of([4, 4], [40.0, 100.0], [60.0, 150.0], [3, 3])
    w.first_batch_ms = [50.0, 40.0]
    # rank 0: 50 ms first batch against 20 ms marginal; rank 1's first was no slower
    assert core.reduce.window_report(w, 0.0).fill_ms == (30.0, 0.0)
    w.delivered_batches[1] = 0  # compute scale: no marginal rate, no fill
    assert core.reduce.window_report(w, 0.0).fill_ms == (0.0, 0.0)


def test_timing_feed_sync_keeps_compute_scale() -> None:
    for mode in ("cpu-sync", "nccl-sync"):
        core = make(mode)
        w = window_of([1, 1], [10.0, 20.0], [99.0, 99.0], [1, 1])
        assert core.reduce.timing_feed(w) == ([10.0, 20.0], [1, 1])


def test_timing_feed_nccl_cadence_rides_the_delivered_scale() -> None:
    core = make("nccl-cadence")
    w = window_of([4, 4], [40.0, 100.0], [80.0, 220.0], [4, 4])
    assert core.reduce.timing_feed(w) == ([80.0, 220.0], [4, 4])


# ----------------------------------------------------------- the window-completion wait
def batch(core: Coordinator, r: int, now: float, data_ms: float = 10.0) -> None:
    step = core.reduce.last_step_count[r] + 1
    core.handle(r, m.Batch(r, 10.0, data_ms, step, 0.5), now)


def one_batch_windows(mode: str = "nccl-cadence", **kw: Any) -> tuple[Coordinator, list[Any]]:
    """Each rank has a 3-batch chunk out when the anchor drops to 1: rank 0 trains its
    chunk, rank 1 one batch, and the gate opens with rank 1 short of a delivered sample."""
    core, out = started(mode, anchor=3, **kw)
    assert [p.partition_size for p in plans(out).values()] == [3, 3]
    core.elche.report_window(WindowReport((20.0, 20.0)))  # both ranks measured at 20 ms
    core.elche.nudge_anchor_down(0.1)
    assert core.elche.counts == [1, 1]
    for _ in range(3):
        batch(core, 0, 0.0)
    batch(core, 1, 0.0)
    assert core.should_average()
    return core, out


def test_nccl_cadence_waits_for_a_movers_chunk_to_complete_its_delivered_sample() -> None:
    core, _ = one_batch_windows()
    assert not msgs(core.tick(0.01), m.SyncNow)
    batch(core, 1, 0.02)  # the rest of rank 1's chunk: its marginal sample lands
    assert msgs(core.tick(0.03), m.SyncNow)
    # ElChe learned the delivered scale (10 ms compute + 10 ms data), not compute alone
    assert core.elche.smoothed_ms(0) == core.elche.smoothed_ms(1) == 20.0  # (20 + 20) / 2


def test_nccl_cadence_wait_ends_when_the_movers_chunks_come_back() -> None:
    # Anchor 1: one-batch chunks, one-batch windows, never a delivered sample.
    core, out = started("nccl-cadence", anchor=1)
    assert [p.partition_size for p in plans(out).values()] == [1, 1]
    for r in (0, 1):
        batch(core, r, 0.0)
    assert not msgs(core.tick(0.01), m.SyncNow)
    core.handle(0, metrics(0, 0, 1), 0.02)
    assert not msgs(core.tick(0.02), m.SyncNow)
    core.handle(1, metrics(1, 0, 1), 0.03)  # nothing more can come for this window
    assert msgs(core.tick(0.03), m.SyncNow)
    assert core.elche.smoothed_ms(1) == 10.0  # fed on the compute scale


def test_nccl_cadence_wait_gives_up_at_its_ceiling_on_the_compute_scale() -> None:
    core, _ = one_batch_windows()
    assert "window_wait_since" not in core.state_summary()
    assert not msgs(core.tick(1.0), m.SyncNow)
    # the tick that began the wait changed the recorded state: a replay counts from it
    assert core.state_summary()["window_wait_since"] == 1.0
    beat(core, [0, 1], 32.0)
    assert not msgs(core.tick(32.0), m.SyncNow)
    beat(core, [0, 1], 33.1)
    assert msgs(core.tick(33.1), m.SyncNow)  # heartbeat_timeout 30 s + 2 s
    assert "window_wait_since" not in core.state_summary()
    assert core.elche.smoothed_ms(0) == 15.0  # (20 + 10 ms compute) / 2
    quick, _ = one_batch_windows(elastic=False)
    assert not msgs(quick.tick(0.05), m.SyncNow)
    assert msgs(quick.tick(0.16), m.SyncNow)  # 0.1 s without the staleness sweep


def test_only_nccl_cadence_waits_for_the_window() -> None:
    cpu, _ = one_batch_windows("cpu-cadence", chunks_cross_windows=False)
    assert msgs(cpu.tick(0.01), m.RequestParams)
    legacy, _ = one_batch_windows(window_wait=False)  # a record from before the wait
    assert msgs(legacy.tick(0.01), m.SyncNow)
