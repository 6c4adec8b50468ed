"""Message surgery on golden runs drives fresh cores into failure paths."""

from __future__ import annotations

from pathlib import Path

from flodl_bus.replay import load_run, replay, surgery
from flodl_bus.replay.testing import alerts, emitted, logged, run_span, what_if

SESSIONS = Path(__file__).resolve().parents[1] / "sessions"


def test_a_rank_silent_midway_is_lost_and_its_work_forfeited_to_survivors() -> None:
    run = load_run(SESSIONS / "cpu-cadence")
    original = what_if(run)
    assert not alerts(original, "rank_lost")
    changed = surgery.drop_upstream(run, 2, after=run_span(run) / 2)
    assert not replay(changed["coordinator"]).identical
    result = what_if(changed)
    # Rank 2 is lost first. The survivors' recorded Exiting, sent when the real run
    # ended, can reach this run while it still trains: a leave before the run's end.
    lost = alerts(result, "rank_lost")[:1]
    assert [a["detail"] for a in lost] == ["rank 2 silent or reported dead"]
    after = next(k for k, ev in enumerate(result.actual) if any(o in lost for o in ev["out"]))
    death = result.actual[after]
    assert death["after"]["dead"] == [2]
    # The forfeited work goes to the survivors: new chunks, never to rank 2.
    plans = [
        o
        for o in death["out"]
        if o.get("kind") == "Send" and o["msg"]["type"] in ("StartEpoch", "Update")
    ]
    assert plans and {o["rank"] for o in plans} <= {0, 1}


def test_a_silent_nccl_rank_is_declared_dead_and_a_new_session_is_requested() -> None:
    run = load_run(SESSIONS / "nccl-cadence")
    result = what_if(surgery.drop_upstream(run, 1, after=run_span(run) / 3))
    assert [m["rank"] for m in emitted(result, "DeclareDead")][:1] == [1]
    requests = emitted(result, "RequestNewNcclId")
    assert requests and requests[0]["_rank"] in (0, 2)


def test_a_duplicated_start_epoch_is_dispatched_into_the_one_chunk_in_flight_error() -> None:
    run = load_run(SESSIONS / "cpu-cadence")
    assert not logged(replay(run["rank:0"], explore=True), "one_chunk_in_flight_violated")
    # Two extra copies: the first fills the rank's one-plan mailbox, the second overwrites it.
    changed = surgery.duplicate_start_epoch(run, 0, copies=2)
    result = replay(changed["rank:0"], explore=True)
    errors = logged(result, "one_chunk_in_flight_violated")
    assert errors and errors[0]["level"] == "error"
    assert replay(changed["rank:0"]).divergences[0].field == "entry"


def test_a_delayed_sync_ack_keeps_the_cpu_cycle_open_until_it_arrives() -> None:
    run = load_run(SESSIONS / "cpu-cadence")
    changed = surgery.delay_sync_ack(run, 1, by=run_span(run))
    first = replay(changed["coordinator"]).divergences[0]
    result = what_if(changed)
    late = next(
        ev
        for ev in result.actual
        if ev.get("msg", {}).get("type") == "SyncAck" and ev.get("sender") == 1
    )
    assert late["before"]["cpu_pending"] is True
    assert late["before"]["gate"]["why"] == "cpu cycle in flight"
    assert first.index <= late["i"]


def test_a_corrupted_upstream_entry_is_dead_lettered_and_named() -> None:
    run = load_run(SESSIONS / "cpu-cadence")
    stream, eid = surgery.find_entry(run, "coordinator", "Batch", sender=0, nth=3)
    result = replay(surgery.corrupt_entry(run, "coordinator", stream, eid)["coordinator"])
    assert [(d["stream"], d["id"]) for d in result.dead_letters] == [(stream, eid)]
    first = result.divergences[0]
    assert (first.field, first.expected) == ("entry", f"{stream} {eid}")
    assert str(first.actual).startswith("dead-lettered: authentication failed")
