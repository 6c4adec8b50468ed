"""A rank that leaves mid-run says so (``Exiting`` with a reason): the core handles it as
a death at once, without waiting for the heartbeat timeout. An Exiting without a reason
is a clean completion only once the run said Shutdown; before, it left work undone and
is handled as a failure (issue 28: the work was never handed on, and a coordinator whose
ranks had all left idled for ever)."""

from __future__ import annotations

from flodl_bus.coordinator.effects import Alert, Finished, WriteMeta
from flodl_bus.protocol import leaving, wire
from flodl_bus.protocol import messages as m
from tests.coordinator.test_core import msgs, started


def test_exiting_with_a_reason_mid_run_declares_the_rank_dead_and_re_forms_at_once() -> None:
    core, _ = started("cpu-cadence", ws=3, total=3000, heartbeat_timeout=30.0)
    # Long before any heartbeat timeout could fire.
    out = core.handle(2, m.Exiting(2, reason="SIGTERM"), 0.5)
    assert [o.msg.rank for o in msgs(out, m.DeclareDead)] == [2]
    assert core.live.dead[2] and not core.alive(2)
    # The survivors are asked for a new group at once (a generator among them).
    new_id = msgs(out, m.RequestNewNcclId)
    assert len(new_id) == 1 and new_id[0].rank in (0, 1)
    # Nothing more from the rank that left changes anything.
    assert core.handle(2, m.Exiting(2), 0.6) == []


def test_exiting_without_a_reason_mid_run_is_a_failure_whose_work_is_handed_on() -> None:
    core, _ = started("cpu-cadence", ws=3, total=3000)
    out = core.handle(2, m.Exiting(2), 0.5)
    assert [o.msg.rank for o in msgs(out, m.DeclareDead)] == [2]
    assert core.live.dead[2] and not core.alive(2)
    assert any(
        isinstance(o, Alert) and "rank 2" in o.detail and "without a reason" in o.detail
        for o in out
    )


def test_every_rank_leaving_mid_run_without_a_reason_stops_the_run_in_order() -> None:
    core, _ = started("cpu-cadence", ws=2, total=3000)
    out = core.handle(0, m.Exiting(0), 0.5) + core.handle(1, m.Exiting(1), 0.6)
    reasons = [o.msg.reason for o in msgs(out, m.ShutdownWithSave)]
    assert reasons and reasons[0] in (m.SaveReason.SINGLE_SURVIVOR, m.SaveReason.ALL_RANKS_LOST)
    out += core.tick(0.7)
    assert core.finished or any(isinstance(o, Finished) for o in out)


def test_exiting_without_a_reason_after_the_shutdown_is_a_clean_completion() -> None:
    core, _ = started("cpu-cadence", ws=3, total=3000)
    core.interrupt(0.4)
    out = core.handle(2, m.Exiting(2), 0.5)
    assert not msgs(out, m.DeclareDead)
    assert core.live.exited[2] and not core.live.dead[2]


def test_the_last_rank_leaving_stops_the_run_with_a_save() -> None:
    core, _ = started("cpu-cadence", ws=1, total=100)
    out = core.handle(0, m.Exiting(0, reason="SIGHUP"), 0.1)
    assert [o.msg.reason for o in msgs(out, m.ShutdownWithSave)] == [m.SaveReason.ALL_RANKS_LOST]


def test_the_reason_crosses_the_wire_and_an_old_exiting_still_decodes() -> None:
    back = wire.from_map(wire.to_map(m.Exiting(1, reason="SIGTERM")))
    assert back == m.Exiting(1, reason="SIGTERM")
    assert wire.from_map({"v": wire.SCHEMA_VERSION, "type": "Exiting", "rank": 1}) == m.Exiting(1)


def test_a_rank_refusing_its_setup_stops_the_run_without_a_save_and_says_why() -> None:
    core, _ = started("nccl-sync", ws=2, total=3000, save_path="/x/ckpt")
    why = "--resume: /x/ckpt.model.pt does not fit this job's model (size mismatch)"
    out = core.handle(1, m.Exiting(1, reason=leaving.reason(leaving.CONFIG_ERROR, why)), 0.2)
    assert core.refused == why
    assert [(o.event, o.detail) for o in out if isinstance(o, Alert)] == [
        ("config_error", f"rank 1: {why}")
    ]
    # Shutdown, not ShutdownWithSave: a save would overwrite the checkpoint resumed from.
    assert msgs(out, m.Shutdown) and not msgs(out, m.ShutdownWithSave)
    assert not any(isinstance(o, WriteMeta) for o in out)
    assert [o.reason for o in out if isinstance(o, Finished)] == [None]
    assert not msgs(out, m.DeclareDead)
