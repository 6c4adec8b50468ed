"""``bench.idle``: the gaps between a rank's batches, split at averaging points."""

from __future__ import annotations

from typing import Any

import pytest

from flodl_bus.bench.idle import averaging_idle


def _batch(now: float, rank: int, ms: float) -> dict[str, Any]:
    msg = {"v": 1, "type": "Batch", "rank": rank, "batch_ms": ms, "data_ms": 0.0}
    return {"event": "dispatch", "now": now, "msg": msg, "out": []}


def _sync(now: float, epoch_end: bool = False) -> dict[str, Any]:
    out = [{"kind": "Broadcast", "msg": {"type": "SyncNow"}}]
    if epoch_end:
        out.append({"kind": "Broadcast", "msg": {"type": "EpochAggregated"}})
    return {"event": "tick", "now": now, "out": out}


def test_a_fast_rank_waiting_for_the_slow_one_at_a_sync_is_counted_at_averaging() -> None:
    # rank 0 steps 10 ms, rank 1 steps 30 ms; the sync at t=1.0 holds rank 0 for 0.25 s
    recs = [
        _batch(0.96, 0, 10.0),
        _batch(0.97, 1, 30.0),
        _sync(1.0),
        _batch(1.22, 0, 10.0),  # 260 ms after its last, 10 of them its step: 0.25 s
        _batch(1.04, 1, 30.0),  # 70 ms after its last, 30 its step: 0.04 s
        _batch(1.30, 0, 10.0),  # 70 ms gap, no sync inside: elsewhere
        _batch(1.07, 1, 30.0),
    ]
    idle = averaging_idle(recs, 2)
    assert idle is not None
    assert idle.syncs == 1
    assert idle.at_sync_s[0] == pytest.approx(0.25)
    assert idle.at_sync_s[1] == pytest.approx(0.04)
    assert idle.other_s[0] == pytest.approx(0.07)
    assert idle.other_s[1] == pytest.approx(0.0, abs=1e-9)
    assert idle.step_s == pytest.approx((0.01, 0.03))
    # 0.04 s of rank 0's wait is the round both waited; 0.21 s it waited for rank 1
    assert idle.peer_s == pytest.approx((0.21, 0.0))
    assert idle.median_peer_s == pytest.approx((0.21, 0.0))
    assert idle.peer_epoch_end_s == (0.0, 0.0)


def test_a_rank_waiting_as_long_as_its_peer_is_not_waiting_for_it() -> None:
    recs = [_batch(0.98, 0, 10.0), _batch(0.98, 1, 10.0), _sync(1.0)]
    recs += [_batch(1.05, 0, 10.0), _batch(1.05, 1, 10.0), _sync(1.1, epoch_end=True)]
    recs += [_batch(1.15, 0, 10.0), _batch(1.20, 1, 10.0)]
    idle = averaging_idle(recs, 2)
    assert idle is not None and idle.syncs == 2
    assert idle.at_sync_s == pytest.approx((0.15, 0.2))
    assert idle.peer_s == pytest.approx((0.0, 0.05))
    assert idle.peer_epoch_end_s == pytest.approx((0.0, 0.05))


def test_a_record_without_a_sync_or_batches_has_no_figure() -> None:
    assert averaging_idle([_batch(1.0, 0, 1.0), _batch(1.1, 0, 1.0)], 1) is None
    assert averaging_idle([_sync(1.0)], 1) is None
