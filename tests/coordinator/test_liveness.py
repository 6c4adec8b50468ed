"""Liveness (``coordinator.liveness``) through the core: heartbeats, deaths,
re-rendezvous, unrecoverable worlds, exits (reference §4.15)."""

from __future__ import annotations

from flodl_bus.coordinator.config import MaxFailure
from flodl_bus.coordinator.effects import Finished, WriteMeta
from flodl_bus.protocol import messages as m
from tests.coordinator.drive import beat, feed, msgs, started


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


def test_a_tick_behind_its_input_declares_no_silent_rank_dead_until_caught_up() -> None:
    # The runtime's read left entries waiting: a rank's silence may be the coordinator's
    # own backlog (4,096 simulated ranks: every live rank was declared dead).
    core, _ = started("cpu-sync", ws=3)
    beat(core, [0, 1], 31.0)
    out = core.tick(31.0, behind=True)
    assert core.live.dead == [False, False, False]
    assert not msgs(out, m.DeclareDead)
    assert msgs(core.tick(45.0, behind=True), m.CoordHeartbeat)  # the rest of a tick runs
    assert core.live.dead == [False, False, False]
    # caught up: rank 2 is still unheard, and now that is its own silence
    beat(core, [0, 1], 46.0)
    out = core.tick(46.0)
    assert core.live.dead == [False, False, True]
    assert [o.msg for o in msgs(out, m.DeclareDead)] == [m.DeclareDead(2)]


def test_a_rank_heard_in_the_backlog_is_alive_once_caught_up() -> None:
    core, _ = started("cpu-sync", ws=2)
    beat(core, [0], 40.0)
    core.tick(40.0, behind=True)
    beat(core, [1], 41.0)  # its entries were waiting in the backlog
    core.tick(41.0)
    assert core.live.dead == [False, False]


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


def test_exiting_decrements_active_count_once() -> None:
    core, _ = started("cpu-sync", ws=3)
    core.interrupt(0.0)  # a clean leave comes after the run's Shutdown
    core.handle(1, m.Exiting(1), 0.0)
    core.handle(1, m.Exiting(1), 0.0)
    assert core.live.active_count == 2
    # an exited rank is not declared dead by the staleness sweep
    beat(core, [0, 2], 40.0)
    core.tick(40.0)
    assert not any(core.live.dead)
