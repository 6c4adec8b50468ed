"""flodl's timeline events from real coordinator records (``record.telemetry``): where
the state and the effects say each kind belongs, and only there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from flodl_bus.record import states
from flodl_bus.record.log import read_records
from flodl_bus.record.telemetry import KINDS, derive
from flodl_bus.replay import events as events_cli

SESSIONS = Path(__file__).resolve().parents[1] / "sessions"
GPU_SESSIONS = Path(__file__).resolve().parents[1] / "sessions_gpu"
MODES = ("cpu-sync", "cpu-cadence", "cpu-async", "nccl-sync", "nccl-cadence")


def _load(run: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    raw = read_records(run / "coordinator.jsonl.zst")
    return list(states.expand(raw)), list(derive(raw))


def _core(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in recs if isinstance(r.get("after"), dict) and "i" in r]


def _sent(o: dict[str, Any], kind: str) -> bool:
    return isinstance(o.get("msg"), dict) and o["msg"].get("type") == kind


@pytest.mark.parametrize("mode", MODES)
def test_each_kind_sits_where_the_record_says_it_happened(mode: str) -> None:
    recs, evs = _load(SESSIONS / mode)
    core = _core(recs)
    by_line: dict[int, list[str]] = {}
    for e in evs:
        assert e["kind"] in KINDS
        by_line.setdefault(e["i"], []).append(e["kind"])

    # AnchorChanged exactly where a call changed the anchor, with its two values
    moved = {r["i"]: (r["before"]["anchor"], r["after"]["anchor"]) for r in core}
    moved = {i: ft for i, ft in moved.items() if ft[0] != ft[1]}
    assert {e["i"]: (e["from"], e["to"]) for e in evs if e["kind"] == "AnchorChanged"} == moved

    # one SyncEnd (and one Divergence) per closed window, on the line that closed it
    closes = [
        r["i"]
        for r in core
        if r["event"] != "start" and r["after"]["avg_count"] != r["before"]["avg_count"]
    ]
    assert closes and [e["i"] for e in evs if e["kind"] == "SyncEnd"] == closes
    assert [e["i"] for e in evs if e["kind"] == "Divergence"] == closes
    assert core[-1]["after"]["avg_count"] == len(closes)
    # SyncStart and SyncEnd alternate: every round opens before it closes
    pairs = [e["kind"] for e in evs if e["kind"] in ("SyncStart", "SyncEnd")]
    assert pairs[::2] == ["SyncStart"] * len(pairs[::2])
    assert pairs[1::2] == ["SyncEnd"] * len(pairs[1::2])
    # each round opens on the line that sent SyncNow / RequestParams
    trigger = "RequestParams" if mode.startswith("cpu") else "SyncNow"
    opened = [r["i"] for r in core for o in r["out"] if _sent(o, trigger)]
    assert [e["i"] for e in evs if e["kind"] == "SyncStart"] == opened
    cpu_rounds = [e for e in evs if e["kind"] in ("CpuAvgStart", "CpuAvgEnd")]
    assert bool(cpu_rounds) == mode.startswith("cpu")

    # a Throttle for each Throttle effect
    throttles = [r["i"] for r in core for o in r["out"] if _sent(o, "Throttle")]
    assert [e["i"] for e in evs if e["kind"] == "Throttle"] == throttles
    assert bool(throttles) == (mode == "cpu-sync")  # the barrier of its rounds

    # a DivergenceEpoch per EpochAggregated, over the windows closed since the last one
    aggregated = [r["i"] for r in core for o in r["out"] if _sent(o, "EpochAggregated")]
    epochs = [e for e in evs if e["kind"] == "DivergenceEpoch"]
    assert [e["i"] for e in epochs] == aggregated[: len(epochs)]
    assert sum(e["sync_count"] for e in epochs) <= len(closes)
    assert not [e for e in evs if e["kind"] in ("LostBroadcast", "MetaNudge")]


def test_divergence_is_what_the_ranks_acked_since_the_window_before() -> None:
    recs, evs = _load(SESSIONS / "cpu-cadence")
    acks: dict[int, dict[str, Any]] = {}
    for r in _core(recs):
        if r["event"] == "dispatch" and r["msg"]["type"] == "SyncAck":
            acks[r["sender"]] = r["msg"]
        if r["event"] != "start" and r["after"]["avg_count"] != r["before"]["avg_count"]:
            (div,) = [e for e in evs if e["kind"] == "Divergence" and e["i"] == r["i"]]
            assert div["deltas"] == [acks[k]["divergence"] for k in range(3)]
            assert div["pre_norms"] == [acks[k]["pre_norm"] for k in range(3)]
            assert div["d_raw"] == max(div["deltas"])
            assert div["k_used"] == r["after"]["global_step"] - r["before"]["global_step"]
            assert div["step"] == r["after"]["global_step"]
            assert div["lambda_raw"] is None and div["lambda_ema"] is None
            acks = {}
    # the guard's telemetry carries the same value, on the same line
    guard = [e for e in evs if e["kind"] == "GuardTelemetry"]
    assert [g["values"]["d_history_last"] for g in guard] == [
        e["d_raw"] for e in evs if e["kind"] == "Divergence"
    ]


def test_a_cpu_round_lasts_from_its_request_to_its_close() -> None:
    recs, evs = _load(SESSIONS / "cpu-async")
    now = {r["i"]: r["now"] for r in _core(recs)}
    starts = [e for e in evs if e["kind"] == "CpuAvgStart"]
    ends = [e for e in evs if e["kind"] == "CpuAvgEnd"]
    assert ends and len(starts) >= len(ends)
    for s, e in zip(starts, ends, strict=False):
        assert e["duration_ms"] == pytest.approx((now[e["i"]] - now[s["i"]]) * 1e3)
        assert e["duration_ms"] > 0


def test_an_lr_drop_nudge_is_a_meta_nudge_with_the_anchors_it_moved_between() -> None:
    run = GPU_SESSIONS / "h200-1rank-nccl-cadence"
    recs, evs = _load(run)
    drift = [
        r
        for r in _core(recs)
        for o in r["out"]
        if o.get("kind") == "Alert" and o.get("event") == "drift"
    ]
    nudges = [e for e in evs if e["kind"] == "MetaNudge"]
    assert len(nudges) == len(drift) == 1
    (n,), (r,) = nudges, drift
    assert n["i"] == r["i"] and n["fired"] == ["lr_drop"]
    assert (n["from"], n["to"]) == (r["before"]["anchor"], r["after"]["anchor"]) == (10, 5)
    assert n["factor"] is None  # not in the record: never guessed
    # a world of one closes its windows without a round: the pair sits on the close
    assert not any(_sent(o, "SyncNow") for r in _core(recs) for o in r["out"])
    ends = [e for e in evs if e["kind"] == "SyncEnd"]
    assert ends and all(e["duration_ms"] == 0.0 for e in ends)


def test_events_prints_the_timeline_and_its_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = SESSIONS / "cpu-cadence"
    evs = list(derive(read_records(run / "coordinator.jsonl.zst")))
    assert events_cli.main([str(run), "--kind", "AnchorChanged"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "AnchorChanged" in lines[0] and "from=10 to=20" in lines[0]
    assert lines[0].lstrip().startswith("+0.077s") and "i=113" in lines[0]

    assert events_cli.main([str(run), "--json"]) == 0
    got = [orjson.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert got == evs


def test_events_refuses_a_missing_run_and_names_a_damaged_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert events_cli.main([str(tmp_path / "nope")]) == events_cli.BAD_INPUT
    assert events_cli.main([str(tmp_path)]) == events_cli.BAD_INPUT
    assert "no coordinator record" in capsys.readouterr().err
    lines = (SESSIONS / "cpu-sync" / "coordinator.jsonl.zst").read_bytes()
    import zstandard

    text = zstandard.ZstdDecompressor().decompressobj().decompress(lines).decode()
    rows = text.splitlines()
    rows[5] = rows[5].replace('"now":', '"now": 1e9, "was":', 1)
    (tmp_path / "coordinator.jsonl").write_text("\n".join(rows) + "\n")
    assert events_cli.main([str(tmp_path)]) == events_cli.DAMAGED
    assert "coordinator.jsonl" in capsys.readouterr().err
