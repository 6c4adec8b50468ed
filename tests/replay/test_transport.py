"""The ``direct`` transport (the bus's entry checks and decoding without the fakeredis
streams around them) reaches the same verdicts as the ``fakeredis`` one."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_bus.replay import Recording, load_run, replay, surgery
from flodl_bus.replay.cli import main
from flodl_bus.replay.testing import assert_identical, recorded_sessions

SESSIONS = recorded_sessions(Path(__file__).resolve().parents[1] / "sessions")
GOLDEN = Path(__file__).resolve().parents[1] / "sessions" / "cpu-cadence"


@pytest.mark.parametrize("recorded_run", SESSIONS, indirect=True, ids=[p.name for p in SESSIONS])
def test_every_golden_run_replays_identically_over_the_direct_transport(
    recorded_run: dict[str, Recording],
) -> None:
    direct = assert_identical(recorded_run, transport="direct")
    redis = assert_identical(recorded_run)
    assert {k: r.replayed for k, r in direct.items()} == {k: r.replayed for k, r in redis.items()}


@pytest.mark.parametrize("how", ["mac", "body"])
def test_a_corrupted_entry_is_dead_lettered_for_the_same_reason_by_both(how: str) -> None:
    run = load_run(GOLDEN)
    rank_type = next(
        e["msg"]["type"] for e in run["rank:0"].events if e["event"] == "dispatch" and e["stream"]
    )
    for key, type_ in (("coordinator", "Batch"), ("rank:0", rank_type)):
        stream, eid = surgery.find_entry(run, key, type_)
        changed = surgery.corrupt_entry(run, key, stream, eid, how)[key]
        a = replay(changed, transport="fakeredis")
        b = replay(changed, transport="direct")
        assert [(d["stream"], d["id"]) for d in a.dead_letters] == [(stream, eid)]
        assert a.dead_letters == b.dead_letters
        assert str(a.divergences[0]) == str(b.divergences[0])


def test_a_changed_entry_diverges_alike_over_both_transports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from flodl_bus.replay import save_run

    run = load_run(GOLDEN)
    batch = [e for e in run["coordinator"].events if (e.get("msg") or {}).get("type") == "Batch"]
    batch[4]["msg"]["batch_ms"] = 5000.0
    changed = str(save_run(run, tmp_path / "changed"))
    assert main([changed, "--role", "coordinator"]) == 1
    slow = capsys.readouterr().out
    assert main([changed, "--role", "coordinator", "--transport", "direct"]) == 1
    assert capsys.readouterr().out == slow
