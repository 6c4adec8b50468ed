"""Entry authentication: an HMAC keyed by the run's secret over everything that matters.

flodl signs every frame with the session salt so a stale process from another run cannot
inject; here the MAC also covers the stream key, so an entry copied from ``ctl:0`` into
``ctl:1`` (or into another run's stream) fails authentication.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Final

MAC_BYTES: Final = 16
SECRET_BYTES: Final = 16


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def _as_bytes(v: bytes | str | int) -> bytes:
    if isinstance(v, bytes):
        return v
    return str(v).encode()


def entry_mac(
    secret: bytes,
    stream: bytes | str,
    type_: bytes | str,
    rank: bytes | str | int,
    seq: bytes | str | int,
    body: bytes,
) -> bytes:
    """Hex MAC (32 ASCII bytes) over the entry, so it reads cleanly in redis-cli."""
    # Unit and record separators cannot occur in a stream key, a type name or a decimal
    # int, so the concatenation is unambiguous.
    head = b"\x1f".join((_as_bytes(stream), _as_bytes(type_), _as_bytes(rank), _as_bytes(seq)))
    digest = hmac.digest(secret, head + b"\x1e" + body, "sha256")
    return digest[:MAC_BYTES].hex().encode()


def verify(
    secret: bytes,
    mac: bytes,
    stream: bytes | str,
    type_: bytes | str,
    rank: bytes | str | int,
    seq: bytes | str | int,
    body: bytes,
) -> bool:
    return hmac.compare_digest(entry_mac(secret, stream, type_, rank, seq, body), mac)


def verify_fields(
    secret: bytes, mac: bytes, stream: bytes, type_: bytes, rank: bytes, seq: bytes, body: bytes
) -> bool:
    """``verify`` for fields already in bytes, as read from Redis: one join, one HMAC
    call (the coordinator runs it for every upstream entry)."""
    signed = b"".join((stream, b"\x1f", type_, b"\x1f", rank, b"\x1f", seq, b"\x1e", body))
    digest = hmac.digest(secret, signed, "sha256")
    return hmac.compare_digest(digest[:MAC_BYTES].hex().encode(), mac)
