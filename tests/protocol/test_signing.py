"""Entry MACs: deterministic, readable, and bound to every part of the entry."""

from __future__ import annotations

import re
from typing import Any

import pytest

from flodl_bus.protocol.signing import (
    MAC_BYTES,
    SECRET_BYTES,
    entry_mac,
    new_secret,
    verify,
    verify_fields,
)

SECRET = bytes(range(16))
ENTRY: dict[str, Any] = {
    "stream": "flodl:{run1}:ctl:0",
    "type_": "StartEpoch",
    "rank": 0,
    "seq": 41,
    "body": b"\x83\xa1v\x01",
}


def mac(secret: bytes = SECRET, **changes: Any) -> bytes:
    return entry_mac(secret, **{**ENTRY, **changes})


def test_mac_is_deterministic() -> None:
    assert mac() == mac()


def test_mac_is_32_lowercase_hex_ascii_bytes() -> None:
    out = mac()
    assert isinstance(out, bytes)
    assert len(out) == 2 * MAC_BYTES == 32
    assert re.fullmatch(rb"[0-9a-f]{32}", out)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "flodl:{run1}:ctl:1"),
        ("stream", "flodl:{run2}:ctl:0"),
        ("type_", "SyncNow"),
        ("rank", 1),
        ("seq", 42),
        ("body", b"\x83\xa1v\x02"),
        ("body", b"\x83\xa1v\x01\x00"),
    ],
)
def test_mac_changes_when_any_part_of_the_entry_changes(field: str, value: Any) -> None:
    assert mac(**{field: value}) != mac()


def test_mac_changes_with_the_secret() -> None:
    assert mac(secret=bytes(16)) != mac()
    assert mac(secret=SECRET[:-1] + b"\x10") != mac()  # last byte only


def test_mac_is_unambiguous_across_field_boundaries() -> None:
    # moving characters between adjacent fields must not keep the MAC
    assert mac(rank=1, seq=23) != mac(rank=12, seq=3)
    assert mac(type_="Sync", stream="flodl:{r}:ctl:0") != mac(
        type_="", stream="flodl:{r}:ctl:0Sync"
    )


def test_int_str_and_bytes_forms_of_rank_and_seq_agree() -> None:
    # redis returns fields as bytes; the writer has ints: both must give the same MAC
    assert mac(rank=b"0", seq=b"41") == mac(rank="0", seq="41") == mac()
    assert mac(stream=b"flodl:{run1}:ctl:0", type_=b"StartEpoch") == mac()


def test_verify_accepts_the_right_mac_only() -> None:
    good = mac()
    assert verify(SECRET, good, **ENTRY)
    assert not verify(bytes(16), good, **ENTRY)
    assert not verify(SECRET, good, **{**ENTRY, "seq": 42})
    assert not verify(SECRET, good, **{**ENTRY, "body": b""})
    assert not verify(SECRET, good[:-1] + (b"0" if good[-1:] != b"0" else b"1"), **ENTRY)
    assert not verify(SECRET, b"", **ENTRY)


def test_new_secret_is_random_and_sized() -> None:
    a, b = new_secret(), new_secret()
    assert len(a) == SECRET_BYTES and a != b


@pytest.mark.parametrize("field", ["stream", "type_", "rank", "seq", "body"])
def test_the_bytes_fast_path_accepts_exactly_what_verify_accepts(field: str) -> None:
    raw = {k: v if isinstance(v, bytes) else str(v).encode() for k, v in ENTRY.items()}
    good = mac()
    assert verify_fields(SECRET, good, **raw)
    assert not verify_fields(SECRET, good, **{**raw, field: raw[field] + b"0"})
    assert not verify_fields(new_secret(), good, **raw)
