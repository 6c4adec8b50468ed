"""Entry build/parse: readable fields, a MAC bound to the stream, the id and the seq,
reasons for the dlq."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from flodl_bus.bus import entries
from flodl_bus.protocol import messages as m
from flodl_bus.protocol import signing, wire
from flodl_bus.protocol.signing import CoordinatorIdentity, MacKey, fixed_keys, rank_keys_for

KEY = MacKey(b"k" * 32)
STREAM = "flodl:{r}:ctl:2"
EID = "1700000000000-3"

Fields = dict[bytes, bytes]


def _parse(
    f: Fields, *, key: MacKey = KEY, stream: str = STREAM, eid: str = EID, **kw: object
) -> object:
    opts: dict[str, object] = {"channel": wire.CONTROL, "rank": "2", **kw}
    return entries.parse(key, stream, eid.encode(), f, **opts)  # type: ignore[arg-type]


def test_an_entry_has_plain_readable_fields_and_parses_back() -> None:
    msg = m.StartEpoch(plan=m.EpochPlan(epoch=1, partition_offset=4, partition_size=8))
    f = entries.build(KEY, STREAM, EID, msg, "2", 17)
    assert list(f) == [b"type", b"rank", b"seq", b"body", b"mac"]
    assert (f[b"type"], f[b"rank"], f[b"seq"]) == (b"StartEpoch", b"2", b"17")
    assert len(f[b"mac"]) == 32 and f[b"mac"].isalnum()
    p = _parse(f)
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
        (lambda f: {**f, b"mac": b"f" * 2000}, "oversized"),
        (lambda f: {**f, b"seq": b"x1"}, "bad type, rank or seq"),
    ],
)
def test_bad_entries_are_rejected_with_a_reason(
    mutate: Callable[[Fields], Fields], reason: str
) -> None:
    f = entries.build(KEY, STREAM, EID, m.SyncNow(), "2", 1)
    out = _parse(mutate(f))
    assert isinstance(out, str) and reason in out


def test_an_entry_is_bound_to_its_stream_its_run_and_its_key() -> None:
    f = entries.build(KEY, STREAM, EID, m.SyncNow(), "2", 1)
    moved = _parse(f, stream="flodl:{r}:ctl:3")
    other_run = _parse(f, stream="flodl:{q}:ctl:2")
    other_key = _parse(f, key=MacKey(b"t" * 32))
    for out in (moved, other_run, other_key):
        assert isinstance(out, str) and out.startswith("authentication failed")


def test_an_entry_copied_under_a_new_id_fails_authentication() -> None:
    f = entries.build(KEY, STREAM, EID, m.SyncNow(), "2", 5)
    assert isinstance(_parse(f), entries.Parsed)
    out = _parse(f, eid="1700000000001-0")
    assert isinstance(out, str) and out.startswith("authentication failed")


def test_a_seq_the_reader_already_passed_is_refused_as_replayed() -> None:
    f = entries.build(KEY, STREAM, EID, m.SyncNow(), "2", 5)
    assert isinstance(_parse(f, last_seq=4), entries.Parsed)
    for last in (5, 6, 1000):
        out = _parse(f, last_seq=last)
        assert isinstance(out, str) and out.startswith(entries.REPLAYED), out


def test_broadcast_entries_carry_an_ed25519_signature_that_rank_keys_cannot_make() -> None:
    keys = fixed_keys()
    stream = "flodl:{r}:ctl:all"
    f = entries.build(keys.signing, stream, EID, m.Shutdown(), "all", 1)
    assert len(f[b"mac"]) == 128
    verify = keys.signing.public
    ok = entries.parse(verify, stream, EID.encode(), f, channel=wire.CONTROL, rank="all")
    assert isinstance(ok, entries.Parsed)
    # a rank holds its own MAC key, never the signing key: what it makes is refused
    forged = entries.build(keys.rank(0), stream, EID, m.Shutdown(), "all", 1)
    out = entries.parse(verify, stream, EID.encode(), forged, channel=wire.CONTROL, rank="all")
    assert isinstance(out, str) and out.startswith("authentication failed")
    other = CoordinatorIdentity.generate().signing
    foreign = entries.build(other, stream, EID, m.Shutdown(), "all", 1)
    out = entries.parse(verify, stream, EID.encode(), foreign, channel=wire.CONTROL, rank="all")
    assert isinstance(out, str) and out.startswith("authentication failed")


def test_a_small_worlds_broadcast_carries_a_mac_per_rank_each_checks_its_own() -> None:
    keys = fixed_keys(b"vector")
    for r in range(3):
        keys.rank(r)
    stream = "flodl:{r}:ctl:all"
    f = entries.build(keys.broadcast, stream, EID, m.Shutdown(), "all", 1)
    assert f[b"mac"].startswith(b"m") and len(f[b"mac"]) == 1 + 3 * 16
    for r in range(3):
        verify = rank_keys_for(keys, r).broadcast_verifier(r)
        ok = entries.parse(verify, stream, EID.encode(), f, channel=wire.CONTROL, rank="all")
        assert isinstance(ok, entries.Parsed), r
    # rank 1 holds its own key: the vector it can make passes only its own slot
    own = rank_keys_for(keys, 1)
    slot = own.rank_key.slot(
        signing.signed_bytes(stream.encode(), EID.encode(), b"Shutdown", b"all", b"1", f[b"body"])
    )
    forged = {**f, b"mac": b"m" + slot * 3}
    for r, want in ((0, False), (1, True), (2, False)):
        verify = rank_keys_for(keys, r).broadcast_verifier(r)
        out = entries.parse(verify, stream, EID.encode(), forged, channel=wire.CONTROL, rank="all")
        assert isinstance(out, entries.Parsed) is want, r
    # a rank beyond the vector has no slot
    verify = rank_keys_for(keys, 7).broadcast_verifier(7)
    out = entries.parse(verify, stream, EID.encode(), f, channel=wire.CONTROL, rank="all")
    assert isinstance(out, str)


def test_one_ranks_key_cannot_make_another_ranks_entries() -> None:
    keys = fixed_keys()
    up1 = "flodl:{r}:up:1"
    hb = m.Heartbeat(rank=1, step_count=3)
    by_rank0 = entries.build(keys.rank(0), up1, EID, hb, "1", 1)
    out = entries.parse(keys.rank(1), up1, EID.encode(), by_rank0, channel=wire.UPSTREAM, rank="1")
    assert isinstance(out, str) and out.startswith("authentication failed")


def test_upstream_body_rank_must_match_the_stream_rank() -> None:
    up = "flodl:{r}:up:1"
    f = entries.build(KEY, up, EID, m.Heartbeat(rank=4, step_count=1), "1", 1)
    out = _parse(f, stream=up, channel=wire.UPSTREAM, rank="1")
    assert isinstance(out, str) and "body rank 4" in out
    wrong = _parse(f, stream=up, channel=wire.CONTROL, rank="1")
    assert isinstance(wrong, str) and "wrong channel" in wrong


def test_a_dead_letter_keeps_origin_reason_and_trimmed_fields() -> None:
    f = {b"body": b"x" * 5000, b"type": b"SyncNow"}
    d = entries.dead_letter_fields(STREAM, "5-0", "bad fields", f, "rank2.reader")
    assert d[b"stream"] == STREAM.encode() and d[b"entry"] == b"5-0"
    assert d[b"reason"] == b"bad fields" and d[b"by"] == b"rank2.reader"
    assert len(d[b"orig.body"]) == 256 and d[b"orig.type"] == b"SyncNow"


def test_oversized_messages_are_refused_when_built() -> None:
    up = "flodl:{r}:up:0"
    huge = m.EvalResult(rank=0, schedule_id=1, epoch=1, metric=0.0, elapsed_ms=1.0, error="e")
    f = entries.build(KEY, up, EID, huge, "0", 1)
    assert isinstance(_parse(f, stream=up, channel=wire.UPSTREAM, rank="0"), entries.Parsed)
    f = {**f, b"body": b"\x00" * (entries.MAX_BODY_BYTES + 1)}
    out = _parse(f, stream=up, channel=wire.UPSTREAM, rank="0")
    assert isinstance(out, str) and out.startswith("oversized")
    with pytest.raises(entries.EntryTooLarge):
        entries.build(KEY, up, EID, m.EvalResult(0, 1, 1, 0.0, 1.0, "e" * 2_000_000), "0", 1)
