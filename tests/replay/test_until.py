"""``replay --until T``: T counts from the coordinator's launch (or is a wall-clock time),
``--role rank:R`` prints that rank's state, and a divergence names its changed keys."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from flodl_bus.replay import load_run, save_run
from flodl_bus.replay.cli import BAD_INPUT, DIVERGED, main

GOLDEN = Path(__file__).resolve().parents[1] / "sessions" / "cpu-cadence"


def _stop_before(events: list[dict[str, object]], k: int) -> object:
    """The ``i`` of the core event just before ``events[k]``."""
    return events[k - 1]["i"]


def test_until_counts_from_the_coordinators_launch_not_its_first_event(
    capsys: pytest.CaptureFixture[str],
) -> None:
    coord = load_run(GOLDEN)["coordinator"]
    launched = coord.header["launched_at"]
    events = coord.core_events()
    timed = [k for k, e in enumerate(events) if "now" in e]
    # The coordinator waited for its workers: its first event comes seconds after launch.
    assert events[timed[0]]["now"] - launched > 1.0
    k = timed[len(timed) // 2]
    nxt = next(j for j in timed if events[j]["now"] > events[k]["now"])
    t = (events[k]["now"] + events[nxt]["now"]) / 2 - launched
    assert main([str(GOLDEN), "--until", f"{t}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"coordinator at t={t:.3f}s (after event i={_stop_before(events, nxt)},")
    # The same instant as a wall-clock time.
    wall = coord.header["launched_wall"] + t
    iso = datetime.fromtimestamp(wall, UTC).isoformat()
    assert main([str(GOLDEN), "--until", iso]) == 0
    by_wall = capsys.readouterr().out
    assert by_wall.startswith(f"coordinator at {iso} (t=")
    assert f"(after event i={_stop_before(events, nxt)}," in by_wall


def test_until_with_a_rank_role_prints_that_ranks_state_on_the_coordinators_timeline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = load_run(GOLDEN)
    rank = run["rank:1"]
    events = rank.core_events()
    timed = [k for k, e in enumerate(events) if "now" in e]
    k, nxt = timed[2], timed[3]
    limit = (events[k]["now"] + events[nxt]["now"]) / 2  # on the rank's own clock
    t = rank.header["launched_wall"] + limit - run["coordinator"].header["launched_wall"]
    assert main([str(GOLDEN), "--role", "rank:1", "--until", f"{t}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"rank 1 at t={t:.3f}s (after event i={_stop_before(events, nxt)},")
    assert not out.startswith("coordinator")
    state = events[nxt - 1].get("after") or {}
    for key in ("local_step", "global_step", "throttled", "pending_plan"):
        assert f"\n  {key}: " in out
    if "local_step" in state:
        assert f"\n  local_step: {state['local_step']}\n" in out


def test_until_refuses_what_is_neither_seconds_nor_a_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([str(GOLDEN), "--until", "soon"]) == BAD_INPUT
    assert "--until 'soon': give seconds" in capsys.readouterr().err


def test_a_divergence_names_the_changed_keys_with_recorded_and_replayed_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = load_run(GOLDEN)
    coord = run["coordinator"]
    batch = [e for e in coord.events if (e.get("msg") or {}).get("type") == "Batch"][3]
    batch["after"]["steps"][0] += 7  # the record says the core counted 7 more steps
    assert main([str(save_run(run, tmp_path / "changed")), "--role", "coordinator"]) == DIVERGED
    out = capsys.readouterr().out
    assert out.startswith(f"divergence at event i={batch['i']} ")
    recorded, replayed = batch["after"]["steps"][0], batch["after"]["steps"][0] - 7
    assert f"\n  after.steps[0]: recorded {recorded}, replayed {replayed}\n" in out
    changed = [ln for ln in out.splitlines() if re.match(r"^  \S+: recorded ", ln)]
    assert len(changed) == 1  # only that key, not the whole state
