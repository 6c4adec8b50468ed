"""Entry build/parse: readable fields, MAC over the stream key, reasons for the dlq."""

from __future__ import annotations

import pytest

from flodl_bus.bus import entries
from flodl_bus.protocol import messages as m
from flodl_bus.protocol import wire

SECRET = b"s" * 16
STREAM = "flodl:{r}:ctl:2"


def test_an_entry_has_plain_readable_fields_and_parses_back() -> None:
    msg = m.StartEpoch(plan=m.EpochPlan(epoch=1, partition_offset=4, partition_size=8))
    f = entries.build(SECRET, STREAM, msg, "2", 17)
    assert list(f) == [b"type", b"rank", b"seq", b"body", b"mac"]
    assert (f[b"type"], f[b"rank"], f[b"seq"]) == (b"StartEpoch", b"2", b"17")
    assert len(f[b"mac"]) == 32 and f[b"mac"].isalnum()
    p = entries.parse(SECRET, STREAM, f, channel=wire.CONTROL, rank="2")
    assert isinstance(p, entries.Parsed)
    assert (p.msg, p.type, p.seq) == (msg, "StartEpoch", 17)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda f: {**f, b"mac": b"f" * 32}, "authentication failed"),
        (lambda f: {**f, b"seq": b"18"}, "authentication failed"),  # MAC covers seq
        (lambda f: {k: v for k, v in f.items() if k != b"mac"}, "bad fields"),
        (lambda f: {**f, b"x": b"1"}, "bad fields"),
        (lambda f: {}, "trimmed"),
        (lambda f: {**f, b"type": b"T" * 100}, "oversized"),
    ],
)
def test_bad_entries_are_rejected_with_a_reason(mutate: object, reason: str) -> None:
    f = entries.build(SECRET, STREAM, m.SyncNow(), "2", 1)
    assert callable(mutate)
    out = entries.parse(SECRET, STREAM, mutate(f), channel=wire.CONTROL, rank="2")
    assert isinstance(out, str) and reason in out


def test_an_entry_is_bound_to_its_stream_and_its_run_secret() -> None:
    f = entries.build(SECRET, STREAM, m.SyncNow(), "2", 1)
    moved = entries.parse(SECRET, "flodl:{r}:ctl:3", f, channel=wire.CONTROL, rank="2")
    other_run = entries.parse(SECRET, "flodl:{q}:ctl:2", f, channel=wire.CONTROL, rank="2")
    other_secret = entries.parse(b"t" * 16, STREAM, f, channel=wire.CONTROL, rank="2")
    for out in (moved, other_run, other_secret):
        assert isinstance(out, str) and out.startswith("authentication failed")


def test_upstream_body_rank_must_match_the_stream_rank() -> None:
    up = "flodl:{r}:up:1"
    f = entries.build(SECRET, up, m.Heartbeat(rank=4, step_count=1), "1", 1)
    out = entries.parse(SECRET, up, f, channel=wire.UPSTREAM, rank="1")
    assert isinstance(out, str) and "body rank 4" in out
    wrong = entries.parse(SECRET, up, f, channel=wire.CONTROL, rank="1")
    assert isinstance(wrong, str) and "wrong channel" in wrong


def test_a_dead_letter_keeps_origin_reason_and_trimmed_fields() -> None:
    f = {b"body": b"x" * 5000, b"type": b"SyncNow"}
    d = entries.dead_letter_fields(STREAM, "5-0", "bad fields", f, "rank2.reader")
    assert d[b"stream"] == STREAM.encode() and d[b"entry"] == b"5-0"
    assert d[b"reason"] == b"bad fields" and d[b"by"] == b"rank2.reader"
    assert len(d[b"orig.body"]) == 256 and d[b"orig.type"] == b"SyncNow"


def test_oversized_messages_are_refused_when_built() -> None:
    huge = m.EvalResult(rank=0, schedule_id=1, epoch=1, metric=0.0, elapsed_ms=1.0, error="e")
    f = entries.build(SECRET, "flodl:{r}:up:0", huge, "0", 1)
    assert entries.parse(SECRET, "flodl:{r}:up:0", f, channel=wire.UPSTREAM, rank="0")
    f = {**f, b"body": b"\x00" * (entries.MAX_BODY_BYTES + 1)}
    out = entries.parse(SECRET, "flodl:{r}:up:0", f, channel=wire.UPSTREAM, rank="0")
    assert isinstance(out, str) and out.startswith("oversized")
