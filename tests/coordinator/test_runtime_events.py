"""The coordinator's live timeline (``events.jsonl``) is the one derived from its record."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from flodl_bus.bus.memory import MemoryCoordinatorBus, MemoryHub
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.protocol.messages import ControlWire, EpochAggregated
from flodl_bus.record.log import read_records
from flodl_bus.record.telemetry import EVENTS_FILE, derive
from tests.coordinator.test_runtime import EXIT_OK, config, run_loop, start_rank

pytestmark = pytest.mark.slow


class LosingBus(MemoryCoordinatorBus):
    """Refuses the first ``EpochAggregated`` broadcast (a write Redis rejected)."""

    def __init__(self, hub: MemoryHub) -> None:
        super().__init__(hub)
        self.refused: list[str] = []

    def broadcast(self, msg: ControlWire) -> None:
        if isinstance(msg, EpochAggregated) and not self.refused:
            self.refused.append(type(msg).__name__)
            raise ConnectionError("refused")
        super().broadcast(msg)


def test_live_events_equal_the_ones_derived_from_the_record(tmp_path: Path) -> None:
    # One rank with real CPU rounds (RequestParams, SyncAck, Update) rather than a
    # world-of-one's roundless windows.
    core = Coordinator(config("cpu-cadence", epochs=2, solo_without_rounds=False))
    hub = MemoryHub(1)
    bus = LosingBus(hub)
    world = start_rank(hub)
    code, loop = run_loop(core, bus, tmp_path)
    world.thread.join(30)
    assert code == EXIT_OK and loop.broadcasts_failed == 1
    assert bus.refused == ["EpochAggregated"]

    live = [orjson.loads(x) for x in (tmp_path / EVENTS_FILE).read_bytes().splitlines()]
    records = read_records(tmp_path / "coordinator.jsonl")
    assert live == list(derive(records))

    kinds = [e["kind"] for e in live]
    assert kinds.count("SyncStart") == kinds.count("SyncEnd") == core.avg_count > 0
    assert kinds.count("CpuAvgStart") == kinds.count("CpuAvgEnd") == core.avg_count
    # the refused EpochAggregated was lost on the one live rank
    (lost,) = [e for e in live if e["kind"] == "LostBroadcast"]
    assert (lost["control"], lost["failures"], lost["i"]) == ("EpochAggregated", 1, None)
    assert [r["control"] for r in records if r.get("event") == "lost_broadcast"] == [
        "EpochAggregated"
    ]
