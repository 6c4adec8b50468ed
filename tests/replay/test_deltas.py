"""A coordinator record of state deltas (``record.states``) replays as a whole-state one
does: identically when untouched, a divergence naming the key where a delta says
otherwise, a damaged record where a delta has nothing to apply to.

The run: a 64-rank nccl-cadence coordinator driven message by message as its loop drives
it (one summary per core call, the previous one handed back), recorded both ways."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest

from flodl_bus.bus.keys import RunKeys
from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Send
from flodl_bus.protocol import messages as m
from flodl_bus.record import chain
from flodl_bus.record.dispatch import DispatchRecorder
from flodl_bus.record.log import read_records
from flodl_bus.replay import load_run, replay
from flodl_bus.replay.cli import DAMAGED, DIVERGED, main

RANKS = 64


def record_coordinator(run_dir: Path, *, deltas: bool) -> Path:
    """Every rank trains its plan step by step (ticks between rounds, SyncNow acked by
    the next Batch), as ``CoordinatorLoop`` records it."""
    cfg = CoordinatorConfig(
        mode="nccl-cadence", world_size=RANKS, total_samples=RANKS * 24, batch_size=1, num_epochs=2
    )
    core = Coordinator(cfg)
    keys = RunKeys("deltas")
    rec = DispatchRecorder(run_dir, "coordinator", compress=False, deltas=deltas)
    rec.header(run="deltas", config=dataclasses.asdict(cfg))
    now = 100.0
    state = core.state_summary()
    seq = [0] * RANKS
    left = [0] * RANKS
    step = [0] * RANKS

    def call(event: str, outs: list[Any], **extra: Any) -> None:
        nonlocal state
        after = core.state_summary(state)
        if event == "dispatch":
            rec.dispatch(now=now, before=state, after=after, out=outs, **extra)
        elif event != "tick" or outs or after != state:
            rec.core_call(event, now=now, before=state, after=after, out=outs, **extra)
        state = after
        for o in outs:
            if isinstance(o, Send) and isinstance(o.msg, m.StartEpoch):
                left[o.rank] = o.msg.plan.partition_size

    call("start", core.start(now))
    for _ in range(120):
        if core.finished:
            break
        for r in range(RANKS):
            msgs: list[Any] = []
            if left[r]:
                left[r] -= 1
                step[r] += 1
                msgs = [m.Batch(r, 5.0 + r % 3, 0.1, step[r], 0.5), m.LrUpdate(r, 0.1)]
                if not left[r]:
                    msgs.append(m.MetricsMsg(r, core.dispatch.rank_epochs()[r], 0.5, 1, 1.0,
                                             1, 1.0, 1.0, 0.0))  # fmt: skip
            for msg in msgs:
                now += 0.0001
                seq[r] += 1
                outs = core.handle(r, msg, now)
                call("dispatch", outs, stream=keys.up(r), entry_id=f"{1000 + seq[r]}-0",
                     msg=msg, sender=r)  # fmt: skip
        now += 0.0001
        call("tick", core.tick(now))
    assert any(isinstance(o.get("msg"), dict) and o["msg"].get("type") == "SyncNow"
               for e in read_records(rec.path) for o in e.get("out") or ()
               if isinstance(o, dict))  # fmt: skip
    rec.end(dispatches=sum(seq))
    rec.close()
    return rec.path


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("deltas")
    record_coordinator(base / "deltas", deltas=True)
    record_coordinator(base / "whole", deltas=False)
    return base / "deltas", base / "whole"


def test_a_delta_record_replays_identically_and_is_a_fraction_of_the_whole_one(
    recorded: tuple[Path, Path],
) -> None:
    deltas, whole = recorded
    raw = read_records(deltas / "coordinator.jsonl")
    core = [r for r in raw if "i" in r]
    assert "after" in core[0] and all("changed" in r for r in core[1:])
    results = {name: replay(load_run(d)["coordinator"]) for name, d in recorded_runs(recorded)}
    for name, result in results.items():
        assert result.identical, f"{name}: {result.summary()}"
    assert results["deltas"].replayed == results["whole"].replayed > 1000
    # the two records say the same: the expanded delta record is the whole one
    assert load_run(deltas)["coordinator"].events == load_run(whole)["coordinator"].events
    size = {name: (d / "coordinator.jsonl").stat().st_size for name, d in recorded_runs(recorded)}
    assert size["deltas"] * 5 < size["whole"]


def recorded_runs(recorded: tuple[Path, Path]) -> list[tuple[str, Path]]:
    return [("deltas", recorded[0]), ("whole", recorded[1])]


def _rechain(src: Path, dst: Path, edit: Any) -> None:
    """``src``'s coordinator record with ``edit(records)`` applied, chained again (a tool
    that rewrites lines on purpose)."""
    dst.mkdir()
    records = [
        {k: v for k, v in r.items() if k != "d"} for r in read_records(src / "coordinator.jsonl")
    ]
    edit(records)
    last = chain.SEED
    with open(dst / "coordinator.jsonl", "wb") as f:
        for r in records:
            line, last = chain.seal(last, orjson.dumps(r))
            f.write(line)


def test_a_delta_that_says_otherwise_diverges_naming_the_key_and_rank(
    recorded: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target: dict[str, Any] = {}

    def edit(records: list[dict[str, Any]]) -> None:
        ev = next(r for r in records[5:] if "steps" in (r.get("patched") or {}))
        rank, value = ev["patched"]["steps"][:2]
        ev["patched"]["steps"][1] = value + 7
        target.update(i=ev["i"], rank=rank, value=value)

    _rechain(recorded[0], tmp_path / "run", edit)
    assert main([str(tmp_path / "run"), "--role", "coordinator"]) == DIVERGED
    out = capsys.readouterr().out
    assert out.startswith(f"divergence at event i={target['i']} ")
    line = (
        f"after.steps[{target['rank']}]: recorded {target['value'] + 7}, replayed {target['value']}"
    )
    assert line in out


def test_a_delta_with_no_whole_state_before_it_is_a_damaged_record(
    recorded: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def edit(records: list[dict[str, Any]]) -> None:
        start = next(r for r in records if r.get("event") == "start")
        del start["before"], start["after"]
        start["changed"] = {}

    _rechain(recorded[0], tmp_path / "run", edit)
    # the coordinator's record alone was copied: replayed as that role
    assert main([str(tmp_path / "run"), "--role", "coordinator"]) == DAMAGED
    err = capsys.readouterr().err
    assert "coordinator.jsonl" in err and "no event before it a whole state" in err
