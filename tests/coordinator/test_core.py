"""The coordinator core: gate, acks, reduce cycles, throttle, dispatch, liveness,
lifecycle (reference §4.3-§4.16; test groups of §7.3-§7.11)."""

from __future__ import annotations

from typing import Any

from flodl_bus.coordinator.config import CoordinatorConfig, MaxFailure
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Broadcast, Finished, Out, Send, WriteMeta
from flodl_bus.coordinator.elche import WindowReport
from flodl_bus.protocol import messages as m


def make(mode: str, ws: int = 2, total: int = 1000, bs: int = 1, **kw: Any) -> Coordinator:
    kw.setdefault("num_epochs", 1)
    return Coordinator(
        CoordinatorConfig(mode=mode, world_size=ws, total_samples=total, batch_size=bs, **kw)
    )


def started(mode: str, **kw: Any) -> tuple[Coordinator, list[Out]]:
    core = make(mode, **kw)
    return core, core.start(0.0)


def feed(core: Coordinator, rank: int, n: int, now: float = 0.0, ms: float = 10.0) -> list[Out]:
    out: list[Out] = []
    for _ in range(n):
        step = core.reduce.last_step_count[rank] + 1
        out += core.handle(rank, m.Batch(rank, ms, 0.0, step, 0.5), now)
    return out


def msgs(outs: list[Out], kind: type) -> list[Any]:
    found = []
    for o in outs:
        if isinstance(o, (Send, Broadcast)) and isinstance(o.msg, kind):
            found.append(o)
    return found


def types(outs: list[Out]) -> list[str]:
    return [type(o.msg).__name__ for o in outs if isinstance(o, (Send, Broadcast))]


def plans(outs: list[Out]) -> dict[int, m.EpochPlan]:
    return {o.rank: o.msg.plan for o in msgs(outs, m.StartEpoch)}


# ================================================================= gate (§4.5)


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
    core, out = started("nccl-cadence", total=10, anchor=4)
    first = plans(out)
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


def test_slot_zero_final_window_rank_does_not_block_the_gate() -> None:
    core = make("nccl-cadence", ws=3, total=18, anchor=1)
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


# ================================================================= NCCL ack (§4.4)


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


# ================================================================= reduce + global step


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


def test_cpu_cadence_update_carries_the_next_chunk() -> None:
    core, out = started("cpu-cadence", total=1000)
    for r, plan in plans(out).items():
        feed(core, r, plan.partition_size)
        core.handle(r, metrics(r, 0, plan.partition_size), 0.0)
    assert msgs(core.tick(0.01), m.RequestParams)
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 0.02)
    updates = msgs(core.tick(0.02), m.WireUpdate)
    assert all(u.msg.next_plan is not None for u in updates)
    assert {u.rank for u in updates} == {0, 1}


# ================================================================= throttle (§4.8)


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


# ================================================================= dispatch


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


# ================================================================= callbacks


def test_checkpoint_failure_fails_over_to_the_next_live_rank() -> None:
    core, _ = started("nccl-sync", ws=3)
    out = core.handle(0, m.CheckpointResult(0, 4, 5.0, "disk full"), 0.0)
    assert [(o.rank, o.msg) for o in msgs(out, m.Checkpoint)] == [(1, m.Checkpoint(4, 1))]
    core.handle(1, m.CheckpointResult(1, 4, 100.0), 0.0)
    core.handle(1, m.CheckpointResult(1, 5, 50.0), 0.0)
    assert core.roles.checkpoint == 1
    assert core.roles.ewma_ms["checkpoint"] == 85.0


def test_callback_time_is_excluded_from_the_window_wall() -> None:
    core, _ = started("nccl-cadence")
    feed(core, 0, 4)
    core.handle(0, m.EvalResult(0, 1, 1, 0.9, 25.0), 0.0)
    assert core.ledger.wall_ms[0] == 15.0
    core.handle(0, m.EpochFnElapsed(0, 1, 100.0), 0.0)
    assert core.ledger.wall_ms[0] == 0.0


def test_eval_result_is_broadcast() -> None:
    core, _ = started("nccl-sync")
    out = core.handle(1, m.EvalResult(1, 2, 2, 0.93, 1.0), 0.0)
    assert [o.msg for o in msgs(out, m.EvalBroadcast)] == [m.EvalBroadcast(2, 0.93)]


def test_cpu_eval_is_armed_before_request_params() -> None:
    core, out = started("cpu-cadence", total=20, num_epochs=3, eval_every=1)
    core.roles.pending_eval_intent = True
    for r, plan in plans(out).items():
        feed(core, r, plan.partition_size)
    order = types(core.tick(0.01))
    assert order.index("ArmConsensusEval") < order.index("RequestParams")


# ================================================================= liveness (§4.15)


def beat(core: Coordinator, ranks: list[int], now: float) -> None:
    for r in ranks:
        core.handle(r, m.Heartbeat(r, 0), now)


def test_coordinator_heartbeat_every_second() -> None:
    core, _ = started("cpu-sync")
    assert not msgs(core.tick(0.5), m.CoordHeartbeat)
    assert msgs(core.tick(1.0), m.CoordHeartbeat)
    assert not msgs(core.tick(1.5), m.CoordHeartbeat)


def test_heartbeat_stale_declares_rank_dead_and_unblocks_should_average() -> None:
    core, _ = started("cpu-sync", ws=3)
    feed(core, 0, 1)
    feed(core, 1, 1)
    assert not core.should_average()
    beat(core, [0, 1], 29.5)
    core.tick(29.5)
    assert not core.live.dead[2]
    beat(core, [0, 1], 31.0)
    out = core.tick(31.0)
    assert core.live.dead == [False, False, True]
    assert msgs(out, m.RequestParams)  # the reduce fires without the dead rank


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


def test_progressive_death_forfeits_chunks_to_survivors() -> None:
    core, out = started("cpu-cadence", ws=3, total=300)
    first = plans(out)
    for r in (0, 1):
        feed(core, r, first[r].partition_size)
        core.handle(r, metrics(r, 0, first[r].partition_size), 1.0)
    beat(core, [0, 1], 31.0)
    out = core.tick(31.0)
    assert core.live.dead == [False, False, True]
    assert not core.dispatch.pools[0].has_in_flight(2)
    assert msgs(out, m.RequestParams)  # the dead rank no longer holds the gate
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 31.1)
    updates = {o.rank: o.msg.next_plan for o in msgs(core.tick(31.2), m.WireUpdate)}
    # reclaimed ranges are served first: rank 0's next chunk is rank 2's lost one
    assert updates[0] == first[2]
    assert 2 not in updates


def test_nccl_death_broadcasts_declare_dead_then_resessions_survivors() -> None:
    core, _ = started("nccl-sync", ws=3)
    beat(core, [0, 1], 31.0)
    out = core.tick(31.0)
    assert [o.msg for o in msgs(out, m.DeclareDead)] == [m.DeclareDead(2)]
    req = msgs(out, m.RequestNewNcclId)
    assert [o.rank for o in req] == [0]
    out = core.handle(0, m.NewNcclIdGenerated(0, b"u" * 128), 31.5)
    sessions = [(o.rank, o.msg.new_rank, o.msg.new_world_size) for o in msgs(out, m.NewNcclSession)]
    assert sessions == [(0, 0, 2), (1, 1, 2)]


def test_cpu_death_also_resessions_survivors_whose_reduce_group_held_the_dead_rank() -> None:
    # The cpu backend reduces over a gloo group of the ranks: without DeclareDead and a
    # new session the survivors' next round waits on the dead peer until it fails.
    core, _ = started("cpu-cadence", ws=3)
    beat(core, [0, 1], 31.0)
    out = core.tick(31.0)
    assert [o.msg for o in msgs(out, m.DeclareDead)] == [m.DeclareDead(2)]
    assert [o.rank for o in msgs(out, m.RequestNewNcclId)] == [0]
    out = core.handle(0, m.NewNcclIdGenerated(0, b"u" * 32), 31.5)
    sessions = [(o.rank, o.msg.new_rank, o.msg.new_world_size) for o in msgs(out, m.NewNcclSession)]
    assert sessions == [(0, 0, 2), (1, 1, 2)]


def test_a_single_cpu_survivor_gets_a_session_of_one_and_trains_on() -> None:
    core, _ = started("cpu-sync", ws=2)
    beat(core, [0], 31.0)
    out = core.tick(31.0)
    assert core.finish_reason is None
    out = core.handle(0, m.NewNcclIdGenerated(0, b"u" * 32), 31.5)
    assert [(o.rank, o.msg.new_world_size) for o in msgs(out, m.NewNcclSession)] == [(0, 1)]
    assert not core.finished


def test_rendezvous_retry_picks_next_survivor_on_generator_death() -> None:
    core, _ = started("nccl-sync", ws=4, heartbeat_timeout=10.0)
    beat(core, [0, 1, 2], 11.0)
    assert [o.rank for o in msgs(core.tick(11.0), m.RequestNewNcclId)] == [0]
    beat(core, [1, 2], 21.5)
    out = core.tick(21.5)  # rank 0 (the generator) went silent too
    assert core.live.dead[0]
    assert [o.rank for o in msgs(out, m.RequestNewNcclId)] == [1]
    stray = core.handle(0, m.NewNcclIdGenerated(0, b"x" * 128), 21.6)
    assert not msgs(stray, m.NewNcclSession)


def test_rendezvous_retry_fires_on_timeout_without_death() -> None:
    core, _ = started("nccl-sync", ws=3)
    beat(core, [0, 1], 31.0)
    core.tick(31.0)
    beat(core, [0, 1], 35.0)
    assert not msgs(core.tick(35.0), m.RequestNewNcclId)
    beat(core, [0, 1], 36.1)
    assert [o.rank for o in msgs(core.tick(36.1), m.RequestNewNcclId)] == [1]


def test_rendezvous_exhaustion_dispatches_shutdown_with_save() -> None:
    core, _ = started("nccl-sync", ws=3, save_path="/tmp/run")
    beat(core, [0, 1], 31.0)
    core.tick(31.0)
    beat(core, [0, 1], 36.1)
    core.tick(36.1)
    beat(core, [0, 1], 41.2)
    out = core.tick(41.2)
    assert isinstance(out[-1], Finished)
    assert out[-1].reason is m.SaveReason.SINGLE_SURVIVOR
    kinds = [type(o).__name__ for o in out]
    assert kinds.index("WriteMeta") < kinds.index("Broadcast", kinds.index("WriteMeta"))
    assert msgs(out, m.ShutdownWithSave)[0].msg.reason is m.SaveReason.SINGLE_SURVIVOR


def test_max_failure_threshold_breach_dispatches_shutdown_with_save() -> None:
    core, _ = started("cpu-sync", ws=4, max_failure=MaxFailure(absolute=2))
    beat(core, [0, 1], 31.0)
    out = core.tick(31.0)
    metas = [o for o in out if isinstance(o, WriteMeta)]
    assert metas and metas[0].meta["reason"] == "max_failure_exceeded"
    assert core.finish_reason is m.SaveReason.MAX_FAILURE_EXCEEDED


def test_single_nccl_survivor_and_all_cpu_ranks_lost_reasons() -> None:
    nccl, _ = started("nccl-sync", ws=2)
    beat(nccl, [0], 31.0)
    nccl.tick(31.0)
    assert nccl.finish_reason is m.SaveReason.SINGLE_SURVIVOR
    cpu, _ = started("cpu-sync", ws=2)
    cpu.tick(31.0)
    assert cpu.finish_reason is m.SaveReason.ALL_RANKS_LOST


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


def test_exiting_decrements_active_count_once() -> None:
    core, _ = started("cpu-sync", ws=3)
    core.handle(1, m.Exiting(1), 0.0)
    core.handle(1, m.Exiting(1), 0.0)
    assert core.live.active_count == 2
    # an exited rank is not declared dead by the staleness sweep
    beat(core, [0, 2], 40.0)
    core.tick(40.0)
    assert not any(core.live.dead)


# ================================================================= shutdown (§4.16.1)


def metrics(rank: int, epoch: int, samples: int, bs: int = 1) -> m.MetricsMsg:
    return m.MetricsMsg(rank, epoch, 0.5, samples // bs, 10.0, samples, 8.0, 6.0, 2.0)


def test_final_reduce_precedes_shutdown_and_nccl_settle_gate_waits() -> None:
    core, out = started("nccl-sync", total=4)
    assert [p.partition_size for p in plans(out).values()] == [2, 2]
    feed(core, 0, 2)
    core.handle(0, metrics(0, 0, 2), 0.0)
    feed(core, 1, 1)
    assert msgs(core.tick(0.01), m.SyncNow)
    core.handle(0, m.SyncAck(0, 3), 0.02)
    feed(core, 1, 1)  # step 2 > snapshot 1: acks rank 1
    core.handle(1, metrics(1, 0, 2), 0.02)
    out = core.tick(0.03)
    assert msgs(out, m.EpochAggregated)
    # trailing step of rank 1: a final consensus reduce, not yet Shutdown
    assert msgs(out, m.SyncNow) and not msgs(out, m.Shutdown)
    assert not msgs(core.tick(0.04), m.Shutdown)  # settle gate: SyncNow unacked
    core.handle(0, m.SyncAck(0, 4), 0.05)
    core.handle(1, m.SyncAck(1, 3), 0.05)
    out = core.tick(0.06)
    assert msgs(out, m.Shutdown) and isinstance(out[-1], Finished)
    assert core.global_step == 4


def test_final_eval_runs_before_shutdown_when_no_trailing_steps() -> None:
    core, out = started("cpu-sync", total=2, final_eval=True)
    for r in (0, 1):
        feed(core, r, 1)
    assert msgs(core.tick(0.01), m.RequestParams)
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 0.02)
        core.handle(r, metrics(r, 0, 1), 0.02)
    out = core.tick(0.03)
    assert msgs(out, m.WireUpdate) and msgs(out, m.EpochAggregated)
    evals = msgs(out, m.ExecuteEvalCallback)
    assert evals and evals[0].msg.schedule_id == m.FINAL_EVAL_SCHEDULE
    assert evals[0].msg.adopt_consensus  # CPU: score the retained consensus
    assert not msgs(out, m.Shutdown)
    assert not msgs(core.tick(0.04), m.Shutdown)
    core.handle(0, m.EvalResult(0, m.FINAL_EVAL_SCHEDULE, 1, 0.97, 3.0), 0.05)
    out = core.tick(0.06)
    assert types(out)[-1] == "Shutdown" and isinstance(out[-1], Finished)


def test_the_final_eval_rank_dying_does_not_hold_the_shutdown_forever() -> None:
    core, out = started("cpu-sync", total=2, final_eval=True)
    for r in (0, 1):
        feed(core, r, 1)
    core.tick(0.01)
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 0.02)
        core.handle(r, metrics(r, 0, 1), 0.02)
    evals = msgs(core.tick(0.03), m.ExecuteEvalCallback)
    evaluator = evals[0].msg.target_rank
    assert not msgs(core.tick(0.04), m.Shutdown)
    # The evaluator dies before answering: the role moves on, the wait must not.
    core.declare_dead(evaluator, 0.05)
    out = core.tick(0.06)
    assert msgs(out, m.Shutdown) or msgs(out, m.ShutdownWithSave)
    assert any(isinstance(o, Finished) for o in out)


def test_an_interrupt_shuts_down_once_and_nothing_is_dispatched_after_it() -> None:
    core, out = started("cpu-cadence", total=64)
    out = core.interrupt(0.1)
    assert types(out) == ["Shutdown"] and isinstance(out[-1], Finished)
    assert core.interrupt(0.2) == []
    after = core.handle(0, metrics(0, 0, 2), 0.3) + core.tick(0.4)
    assert not msgs(after, m.StartEpoch) and not msgs(after, m.Shutdown)


def test_epoch_aggregated_carries_batch_weighted_loss() -> None:
    core, out = started("nccl-sync", total=100, num_epochs=2)
    core.handle(0, m.MetricsMsg(0, 0, 0.5, 60, 1.0, 50, 1.0, 1.0, 0.0), 0.0)
    core.handle(1, m.MetricsMsg(1, 0, 0.7, 40, 1.0, 50, 1.0, 1.0, 0.0), 0.0)
    out = core.tick(0.01)
    agg = msgs(out, m.EpochAggregated)
    assert abs(agg[0].msg.metrics.avg_loss - 0.58) < 1e-12
    assert {p.epoch for p in plans(out).values()} == {1}


def test_state_summary_reports_why_the_gate_is_closed() -> None:
    core, _ = started("nccl-cadence")
    feed(core, 0, 3)
    s = core.state_summary()
    assert s["gate"] == {"open": False, "why": "rank 0 at 3/10 steps"}
    assert s["steps"] == [3, 0] and s["version"] == 0
    assert s["in_flight"][0] > 0


def test_failed_start_epoch_is_rolled_back_and_reoffered_on_the_next_tick() -> None:
    core, out = started("nccl-cadence", total=1000)
    lost = msgs(out, m.StartEpoch)[0]
    core.send_failed(lost.rank, lost.msg, 0.0)
    assert not core.dispatch.pools[0].has_in_flight(lost.rank)
    again = plans(core.tick(0.01))
    assert again == {lost.rank: lost.msg.plan}  # the cursor was rewound: same chunk


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


def test_eval_intent_folds_into_the_next_nccl_epoch_dispatch() -> None:
    core, out = started("nccl-sync", total=4, num_epochs=2)
    core.handle(1, m.Intent(1, m.IntentKind.EVAL_NOW), 0.0)
    for r in (0, 1):
        feed(core, r, 2)
        core.handle(r, metrics(r, 0, 2), 0.0)
    out = core.tick(0.01)
    evals = msgs(out, m.ExecuteEvalCallback)
    assert [(o.rank, o.msg.epoch) for o in evals] == [(core.roles.eval, 1)]
    order = types(out)
    assert order.index("ExecuteEvalCallback") < order.index("StartEpoch")
    assert not core.roles.pending_eval_intent


def test_checkpoint_every_n_epochs_goes_to_the_checkpoint_role_only() -> None:
    core, out = started("nccl-sync", total=4, num_epochs=3, checkpoint_every=2)
    sent: list[tuple[int, m.Checkpoint]] = []
    for epoch in range(3):
        for r in (0, 1):
            feed(core, r, 2)
            core.handle(r, metrics(r, epoch, 2), 0.0)
        out = core.tick(0.01 * (epoch + 1))
        sent += [(o.rank, o.msg) for o in msgs(out, m.Checkpoint)]
        for r in (0, 1):
            core.handle(r, m.SyncAck(r, core.reduce.last_step_count[r] + 1), 0.0)
    assert sent == [(core.roles.checkpoint, m.Checkpoint(2, core.roles.checkpoint))]
