"""The in-process bus keeps the ``bus.api`` contract the runtimes rely on."""

from __future__ import annotations

import threading
import time

import pytest

from flodl_bus.bus.memory import MemoryHub
from flodl_bus.protocol.messages import (
    Batch,
    Checkpoint,
    EvalResult,
    Heartbeat,
    SetGlobalStep,
    Shutdown,
    SyncNow,
)
from flodl_bus.protocol.wire import MAX_STR_LEN


def test_a_rank_reads_unicast_and_broadcast_merged_in_send_order() -> None:
    hub = MemoryHub(2)
    coord, r0, r1 = hub.coordinator_bus(), hub.rank_bus(0), hub.rank_bus(1)
    coord.send(0, SetGlobalStep(1))
    coord.broadcast(SyncNow())
    coord.send(1, Checkpoint(version=1, target_rank=1))
    coord.send(0, SetGlobalStep(2))
    coord.broadcast(Shutdown())
    d0, d1 = r0.read_control(0), r1.read_control(0)
    assert [d.msg for d in d0] == [SetGlobalStep(1), SyncNow(), SetGlobalStep(2), Shutdown()]
    assert [d.msg for d in d1] == [SyncNow(), Checkpoint(1, 1), Shutdown()]
    assert [d.stream for d in d1] == ["ctl:all", "ctl:1", "ctl:all"]
    # One counter across unicast and broadcast: ids rise in the order sent.
    ids = [int(d.entry_id.split("-")[0]) for d in d0]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_a_restarted_reader_gets_unacked_entries_again_but_never_acked_ones() -> None:
    hub = MemoryHub(1)
    coord = hub.coordinator_bus()
    first = hub.rank_bus(0)
    for s in range(4):
        coord.send(0, SetGlobalStep(s))
    got = first.read_control(0)
    first.ack(got[:2])
    first.close()
    again = hub.rank_bus(0)
    assert [d.msg for d in again.read_control(0)] == [SetGlobalStep(2), SetGlobalStep(3)]
    coord.send(0, SetGlobalStep(4))
    assert [d.msg for d in again.read_control(0)] == [SetGlobalStep(4)]


def test_read_control_blocks_until_an_entry_arrives_or_the_timeout() -> None:
    hub = MemoryHub(1)
    coord, rank = hub.coordinator_bus(), hub.rank_bus(0)
    start = time.monotonic()
    assert rank.read_control(50) == []
    assert time.monotonic() - start >= 0.04
    threading.Timer(0.05, lambda: coord.send(0, SyncNow())).start()
    assert [d.msg for d in rank.read_control(2000)] == [SyncNow()]


def test_upstream_keeps_each_ranks_send_order() -> None:
    hub = MemoryHub(2)
    coord, r0, r1 = hub.coordinator_bus(), hub.rank_bus(0), hub.rank_bus(1)
    for i in range(3):
        r0.publish(Heartbeat(rank=0, step_count=i))
        r1.publish(Batch(rank=1, batch_ms=1.0, data_ms=0.0, step_count=i, batch_loss=0.5))
    got = coord.read_upstream(0)
    coord.ack(got)
    per_rank: dict[str, list[int]] = {}
    for d in got:
        per_rank.setdefault(d.stream, []).append(d.msg.step_count)  # type: ignore[attr-defined]
    assert per_rank == {"up:0": [0, 1, 2], "up:1": [0, 1, 2]}
    assert coord.read_upstream(0) == []


def test_messages_travel_through_the_wire_codec() -> None:
    hub = MemoryHub(1)
    coord, rank = hub.coordinator_bus(), hub.rank_bus(0)
    rank.publish(EvalResult(rank=0, schedule_id=1, epoch=1, metric=0.9, elapsed_ms=2.0))
    (d,) = coord.read_upstream(0)
    assert d.msg == EvalResult(rank=0, schedule_id=1, epoch=1, metric=0.9, elapsed_ms=2.0)
    with pytest.raises(ValueError, match="reserved"):
        coord.send(0, Checkpoint(version=1, target_rank=2**64 - 1))


def test_an_entry_that_does_not_decode_goes_to_the_dead_letters() -> None:
    hub = MemoryHub(1)
    coord, rank = hub.coordinator_bus(), hub.rank_bus(0)
    rank.publish(
        EvalResult(
            rank=0,
            schedule_id=1,
            epoch=1,
            metric=0.0,
            elapsed_ms=0.0,
            error="x" * (MAX_STR_LEN + 1),
        )
    )
    rank.publish(Heartbeat(rank=0, step_count=1))
    assert [d.msg for d in coord.read_upstream(0)] == [Heartbeat(rank=0, step_count=1)]
    assert len(hub.dlq) == 1 and hub.dlq[0][0] == "up:0"


def test_rank_out_of_range_is_refused() -> None:
    hub = MemoryHub(2)
    with pytest.raises(ValueError, match="world_size"):
        hub.rank_bus(2)
    with pytest.raises(ValueError, match="world_size"):
        hub.coordinator_bus().send(5, SyncNow())
