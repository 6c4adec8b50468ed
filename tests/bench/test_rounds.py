"""``bench.rounds``: a round's phases read off the coordinator's record."""

from __future__ import annotations

from typing import Any

import pytest

from flodl_bus.bench.rounds import round_phases


def _read(now: float, kind: str, rank: int) -> dict[str, Any]:
    return {"event": "dispatch", "now": now, "msg": {"type": kind, "rank": rank}, "out": []}


def _sent(now: float, *kinds: str, event: str = "tick") -> dict[str, Any]:
    return {
        "event": event,
        "now": now,
        "out": [{"kind": "Send", "msg": {"type": k}} for k in kinds],
    }


def _cpu_round(
    t: float, snaps: tuple[float, float], acks: tuple[float, float], close: float
) -> list[dict[str, Any]]:
    return [
        _sent(t, "RequestParams", "StartEpoch"),
        _read(t + 0.0005, "Batch", 0),  # a step's report mid-round changes nothing
        _read(t + snaps[0], "SnapshotReady", 0),
        _read(t + snaps[1], "SnapshotReady", 1),
        _read(t + acks[0], "SyncAck", 1),
        _read(t + acks[1], "SyncAck", 0),
        _sent(t + acks[1] + close, "Update", "Update", "SetGlobalStep"),
    ]


def test_each_cpu_round_splits_into_snapshots_collectives_and_the_coordinators_turn() -> None:
    recs = [_sent(0.0, "StartEpoch", event="start")]
    recs += _cpu_round(0.010, (0.001, 0.003), (0.009, 0.010), 0.0002)
    recs += _cpu_round(0.050, (0.002, 0.005), (0.011, 0.012), 0.0004)
    recs += _cpu_round(0.090, (0.001, 0.004), (0.013, 0.014), 0.0003)
    recs.append(_sent(0.120, "EpochAggregated"))  # no round open: not one
    p = round_phases(recs)
    assert p is not None and p.rounds == 3
    assert p.snapshots_s == pytest.approx(0.004)  # the last rank's, median of 3, 4, 5 ms
    assert p.reduce_s == pytest.approx(0.007)  # last ack after last snapshot: 7, 7, 10 ms
    assert p.close_s == pytest.approx(0.0003)
    assert p.round_s == pytest.approx(0.0124)  # 10.2, 12.4, 14.3 ms


def test_an_nccl_round_closes_at_its_last_ack_and_one_a_death_left_open_is_dropped() -> None:
    recs = [
        {"event": "run", "config": {"world_size": 2}},
        _sent(1.0, "SyncNow"),
        _read(1.004, "SyncAck", 0),
        _read(1.006, "SyncAck", 1),  # the last ack closes it: no Update follows on NCCL
        _sent(1.5, "SyncNow"),  # rank 1 died inside this one: the next round drops it
        _read(1.503, "SyncAck", 0),
        {"event": "tick", "now": 1.9, "changed": {"dead": [1]}, "out": []},
        _sent(2.0, "SyncNow"),  # the survivor's ack alone closes the next one
        _read(2.002, "SyncAck", 0),
        _sent(3.0, "SyncNow"),  # and the run ended inside this one
    ]
    p = round_phases(recs)
    assert p is not None and p.rounds == 2
    assert p.snapshots_s is None and p.close_s is None
    assert p.round_s == pytest.approx(0.004) and p.reduce_s == pytest.approx(0.004)
    assert round_phases([_sent(0.0, "StartEpoch"), _read(0.1, "SyncAck", 0)]) is None
