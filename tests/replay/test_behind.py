"""A tick the loop ran behind its input (``Coordinator.tick(behind=True)``) replays as
it ran: the silence it did not judge is not judged on replay, and a record that drops
the word diverges at that tick."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson

from flodl_bus.bus.keys import RunKeys
from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.protocol import messages as m
from flodl_bus.record import chain
from flodl_bus.record.dispatch import DispatchRecorder
from flodl_bus.record.log import read_records
from flodl_bus.replay import load_run, replay


def record(run_dir: Path) -> None:
    """Two ranks; rank 1 unheard for longer than the heartbeat timeout while the loop was
    behind (its entries waiting), then heard: no death, as the loop records it."""
    cfg = CoordinatorConfig(
        mode="cpu-sync", world_size=2, total_samples=64, batch_size=1, num_epochs=1
    )
    core = Coordinator(cfg)
    keys = RunKeys("behind")
    rec = DispatchRecorder(run_dir, "coordinator", compress=False)
    rec.header(run="behind", config=dataclasses.asdict(cfg))
    state = core.state_summary()
    seq = [0, 0]

    def call(event: str, now: float, outs: list[Any], **extra: Any) -> None:
        nonlocal state
        after = core.state_summary(state)
        if event == "dispatch":
            rec.dispatch(now=now, before=state, after=after, out=outs, **extra)
        else:
            rec.core_call(event, now=now, before=state, after=after, out=outs, **extra)
        state = after

    def beat(r: int, now: float) -> None:
        seq[r] += 1
        msg = m.Heartbeat(r, 0)
        call("dispatch", now, core.handle(r, msg, now), stream=keys.up(r),
             entry_id=f"{1000 + seq[r]}-0", msg=msg, sender=r)  # fmt: skip

    call("start", 100.0, core.start(100.0))
    beat(0, 110.0)
    beat(0, 131.0)
    call("tick", 131.5, core.tick(131.5, behind=True), behind=True)
    beat(1, 132.0)  # rank 1's entry, read once the loop caught up
    call("tick", 132.5, core.tick(132.5))
    assert not any(core.live.dead)
    rec.end(dispatches=sum(seq))
    rec.close()


def test_a_tick_recorded_behind_replays_identically_without_the_death_it_did_not_judge(
    tmp_path: Path,
) -> None:
    record(tmp_path)
    ticks = [r for r in read_records(tmp_path / "coordinator.jsonl") if r["event"] == "tick"]
    assert [t.get("behind") for t in ticks] == [True, None]
    result = replay(load_run(tmp_path)["coordinator"])
    assert result.identical, result.summary()
    assert [e.get("behind") for e in result.actual if e.get("event") == "tick"] == [True, None]


def test_a_record_that_drops_the_word_diverges_at_that_tick(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    record(src)
    records = [
        {k: v for k, v in r.items() if k not in ("d", "behind")}
        for r in read_records(src / "coordinator.jsonl")
    ]
    dst.mkdir()
    last = chain.SEED
    with open(dst / "coordinator.jsonl", "wb") as f:
        for r in records:
            line, last = chain.seal(last, orjson.dumps(r))
            f.write(line)
    result = replay(load_run(dst)["coordinator"])
    assert not result.identical
    first = result.divergences[0]
    assert first.event == "tick", str(first)
    assert "DeclareDead" in str(first.actual) or "dead" in str(first.actual), str(first)
