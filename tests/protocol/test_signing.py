"""Keys of a run's roles: MACs and signatures over every part of an entry; rank keys only
that rank and the coordinator can compute; an identity bound to the run secret."""

from __future__ import annotations

import re
from typing import Any

import pytest

from flodl_bus.protocol.signing import (
    MAC_BYTES,
    SECRET_BYTES,
    SIG_HEX,
    BadKey,
    CoordinatorIdentity,
    MacKey,
    RankKx,
    RunIdentity,
    fixed_keys,
    new_secret,
    signed_bytes,
)

KEY = MacKey(bytes(range(32)))
ENTRY: dict[str, bytes] = {
    "stream": b"flodl:{run1}:ctl:0",
    "entry_id": b"1700000000000-0",
    "type_": b"StartEpoch",
    "rank": b"0",
    "seq": b"41",
    "body": b"\x83\xa1v\x01",
}


def data(**changes: bytes) -> bytes:
    return signed_bytes(**{**ENTRY, **changes})


def test_a_mac_is_deterministic_and_32_lowercase_hex_bytes() -> None:
    out = KEY.sign(data())
    assert out == KEY.sign(data())
    assert len(out) == 2 * MAC_BYTES == 32
    assert re.fullmatch(rb"[0-9a-f]{32}", out)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", b"flodl:{run1}:ctl:1"),
        ("stream", b"flodl:{run2}:ctl:0"),
        ("entry_id", b"1700000000000-1"),
        ("type_", b"SyncNow"),
        ("rank", b"1"),
        ("seq", b"42"),
        ("body", b"\x83\xa1v\x02"),
        ("body", b"\x83\xa1v\x01\x00"),
    ],
)
def test_mac_and_signature_change_when_any_part_of_the_entry_changes(
    field: str, value: Any
) -> None:
    assert not KEY.verify(data(**{field: value}), KEY.sign(data()))
    signer = fixed_keys().signing
    assert not signer.public.verify(data(**{field: value}), signer.sign(data()))


def test_the_signed_bytes_are_unambiguous_across_field_boundaries() -> None:
    assert data(rank=b"1", seq=b"23") != data(rank=b"12", seq=b"3")
    assert data(type_=b"Sync", stream=b"flodl:{r}:ctl:0") != data(
        type_=b"", stream=b"flodl:{r}:ctl:0Sync"
    )


def test_verify_accepts_the_right_mac_only() -> None:
    good = KEY.sign(data())
    assert KEY.verify(data(), good)
    assert not MacKey(bytes(32)).verify(data(), good)
    assert not KEY.verify(data(), good[:-1] + (b"0" if good[-1:] != b"0" else b"1"))
    assert not KEY.verify(data(), b"")


def test_a_signature_is_128_hex_and_verifies_with_the_public_key_only() -> None:
    signer = CoordinatorIdentity.generate().signing
    sig = signer.sign(data())
    assert len(sig) == SIG_HEX and re.fullmatch(rb"[0-9a-f]+", sig)
    assert signer.public.verify(data(), sig)
    assert not CoordinatorIdentity.generate().signing.public.verify(data(), sig)
    for bad in (b"", b"zz" * 64, sig[:-2], KEY.sign(data())):
        assert not signer.public.verify(data(), bad)


def test_a_rank_key_is_the_same_on_both_sides_and_differs_per_rank_and_run() -> None:
    coord = CoordinatorIdentity.generate()
    kx = RankKx.generate()
    a = coord.rank_key("run1", 3, kx.pub)
    assert a == kx.rank_key(coord.public, "run1", 3)
    assert a != coord.rank_key("run1", 4, kx.pub)
    assert a != coord.rank_key("run2", 3, kx.pub)
    # another rank, holding its own key and every public key, computes something else
    other = RankKx.generate()
    assert other.rank_key(coord.public, "run1", 3) != a


def test_a_bad_public_key_is_refused_with_a_reason() -> None:
    with pytest.raises(BadKey, match="kx_pub"):
        CoordinatorIdentity.generate().rank_key("r", 0, "00" * 5)
    with pytest.raises(BadKey):
        RunIdentity.from_fields({"sign_pub": "nothex", "kx_pub": "00"})


def test_the_identity_check_binds_the_public_keys_to_the_run_secret() -> None:
    secret = new_secret()
    ident = CoordinatorIdentity.generate().public
    fields = ident.to_fields(secret, "run1")
    back = RunIdentity.from_fields(fields)
    assert back.check(secret, "run1") == fields["check"]
    assert back.check(new_secret(), "run1") != fields["check"]
    assert back.check(secret, "run2") != fields["check"]
    swapped = CoordinatorIdentity.generate().public
    assert swapped.check(secret, "run1") != fields["check"]


def test_a_seed_gives_the_same_identity_and_fixed_keys_any_rank() -> None:
    seed = bytes(range(32))
    assert CoordinatorIdentity.from_seed(seed).public.kx_pub == (
        CoordinatorIdentity.from_seed(seed).public.kx_pub
    )
    with pytest.raises(BadKey):
        CoordinatorIdentity.from_seed(b"short")
    keys = fixed_keys(b"x")
    assert keys.rank(7) == fixed_keys(b"x").rank(7) != keys.rank(8)


def test_new_secret_is_random_and_sized() -> None:
    a, b = new_secret(), new_secret()
    assert len(a) == SECRET_BYTES and a != b


@pytest.mark.parametrize("key_len", [0, 1, 16, 32, 63, 64, 65, 200])
def test_prepared_macs_and_slots_are_hmac_sha256_for_any_key_length(key_len: int) -> None:
    # The prepared pads must give exactly the standard HMAC: records made before them,
    # and ranks still running the one-shot ``hmac.digest``, check the same bytes.
    import hashlib
    import hmac
    import os
    import pickle

    key = os.urandom(key_len)
    data = signed_bytes(**ENTRY)
    mk = MacKey(key)
    want = hmac.new(key, data, hashlib.sha256).digest()
    assert mk.sign(data) == want[:MAC_BYTES].hex().encode()
    slot = hmac.new(key, b"broadcast\x1f" + data, hashlib.sha256).digest()[:8]
    assert mk.slot(data) == slot.hex().encode()
    # the pads are copied, never consumed: a second MAC is the same
    assert mk.sign(data) == mk.sign(data) and mk.slot(data) == mk.slot(data)
    again = pickle.loads(pickle.dumps(mk))
    assert again == mk and again.sign(data) == mk.sign(data)


def test_a_broadcast_vector_is_every_ranks_slot_with_zeros_for_a_gap() -> None:
    keys = fixed_keys(b"vector")
    for r in (0, 1, 3):  # rank 2 never admitted
        keys.rank(r)
    data = signed_bytes(**ENTRY)
    vec = keys.broadcast.sign(data)
    slots = [keys.ranks[r].slot(data) if r in keys.ranks else b"0" * 16 for r in range(4)]
    assert vec == b"m" + b"".join(slots)
    for r in (0, 1, 3):
        verifier = keys.ranks[r]
        assert vec[1 + 16 * r : 17 + 16 * r] == verifier.slot(data)
