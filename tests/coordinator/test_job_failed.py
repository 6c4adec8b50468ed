"""A rank whose job failed says so (``Exiting`` with a ``job_failed`` reason): the core
stops the whole run with ``ShutdownWithSave(JOB_FAILED)`` (the same code runs on every
rank), while any other reason is a single rank's death (the survivors re-form)."""

from __future__ import annotations

from flodl_bus.coordinator.effects import Alert, Finished, WriteMeta
from flodl_bus.protocol import leaving, wire
from flodl_bus.protocol import messages as m
from tests.coordinator.test_core import msgs, started

JOB = leaving.reason(leaving.JOB_FAILED, "loss_fn raised ValueError: bad batch")


def test_a_job_failure_stops_the_run_with_its_reason_and_names_rank_and_exception() -> None:
    core, _ = started("cpu-cadence", ws=3, total=3000, save_path="/tmp/x", heartbeat_timeout=30.0)
    out = core.handle(1, m.Exiting(1, reason=JOB), 0.5)
    assert [o.msg.reason for o in msgs(out, m.ShutdownWithSave)] == [m.SaveReason.JOB_FAILED]
    assert [o.reason for o in out if isinstance(o, Finished)] == [m.SaveReason.JOB_FAILED]
    # The checkpoint meta says why, so a resume after the fix knows what happened.
    (meta,) = [o.meta for o in out if isinstance(o, WriteMeta)]
    assert meta["reason"] == "job_failed"
    alerts = [o for o in out if isinstance(o, Alert) and o.event == "job_failed"]
    assert [a.detail for a in alerts] == ["rank 1: loss_fn raised ValueError: bad batch"]
    # The failed rank is gone (not waited for), and no re-formation was started.
    assert core.live.exited[1] and not core.alive(1)
    assert not msgs(out, m.RequestNewNcclId)
    assert core.finished


def test_a_job_failure_on_nccl_releases_peers_parked_in_the_collective() -> None:
    core, _ = started("nccl-cadence", ws=2, total=2000, heartbeat_timeout=30.0)
    core.reduce.armed, core.reduce.acked, core.reduce.unacked = True, [True, False], 1
    out = core.handle(1, m.Exiting(1, reason=JOB), 0.5)
    assert [o.msg.rank for o in msgs(out, m.DeclareDead)] == [1]
    assert msgs(out, m.ShutdownWithSave)


def test_an_averaging_failure_is_one_rank_s_death_and_the_survivors_re_form() -> None:
    core, _ = started("cpu-cadence", ws=3, total=3000, heartbeat_timeout=30.0)
    why = leaving.reason(leaving.AVERAGING_FAILED, "averaging round 3: RuntimeError('gone')")
    out = core.handle(2, m.Exiting(2, reason=why), 0.5)
    assert [o.msg.rank for o in msgs(out, m.DeclareDead)] == [2]
    assert core.live.dead[2] and not msgs(out, m.ShutdownWithSave)
    assert len(msgs(out, m.RequestNewNcclId)) == 1


def test_a_job_failure_after_the_run_stopped_changes_nothing() -> None:
    core, _ = started("cpu-cadence", ws=2, total=2000)
    core.handle(0, m.Exiting(0, reason=JOB), 0.5)
    out = core.handle(1, m.Exiting(1, reason=JOB), 0.6)
    assert not msgs(out, m.ShutdownWithSave) and core.live.exited[1]


def test_reason_kinds_and_the_wire() -> None:
    assert leaving.kind_of(JOB) == leaving.JOB_FAILED
    assert leaving.kind_of("SIGTERM") is None and leaving.kind_of("job: x") is None
    assert leaving.detail_of(JOB) == "loss_fn raised ValueError: bad batch"
    # One line whatever the exception held, and bounded.
    long = leaving.reason(leaving.JOB_FAILED, "a\nb " + "x" * 5000)
    assert "\n" not in long and len(long) <= len("job_failed: ") + leaving.MAX_DETAIL
    assert wire.decode(wire.encode(m.Exiting(1, reason=JOB))) == m.Exiting(1, reason=JOB)
    # A clean Exiting encodes as it always did: an older decoder refuses unknown fields.
    assert wire.to_map(m.Exiting(1)) == {"v": wire.SCHEMA_VERSION, "type": "Exiting", "rank": 1}
    # An unknown SaveReason byte still falls back (an older rank saves as graceful).
    assert m.SaveReason.from_byte(6) is m.SaveReason.JOB_FAILED
