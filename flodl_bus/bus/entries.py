"""One stream entry: build it, and parse + authenticate + validate it.

An entry is five plain fields, readable with ``redis-cli XRANGE``::

    type  SyncNow            the wire type name
    rank  3 | all | join     the rank the stream belongs to
    seq   17                 the writer's sequence on this stream (1, 2, 3, ...)
    body  <msgpack>          ``flodl_bus.protocol.wire`` encoding of the message
    mac   <hex>              HMAC (rank key, run secret), or for a broadcast a MAC per rank
                             (``m...``) or an Ed25519 signature

The MAC covers the stream key, the entry's own id, and every field (see
``protocol.signing``), so an entry copied into another stream, another run, or re-added
under a new id fails authentication. ``seq`` grows by one per entry a writer puts on a
stream; a reader refuses a seq it has already passed (``replayed``) and names a jump
(entries deleted or trimmed before it read them). It is checked before the MAC is
computed, and the MAC before the body is unpacked, so unauthenticated bytes never reach
the decoder.

``parse`` never raises on bad input: it returns the reason the entry goes to the dlq.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, NamedTuple

from flodl_bus.protocol import signing, wire

F_TYPE: Final = b"type"
F_RANK: Final = b"rank"
F_SEQ: Final = b"seq"
F_BODY: Final = b"body"
F_MAC: Final = b"mac"
#: an entry's fields in the order ``sign`` gives them (and redis-cli shows them)
FIELD_ORDER: Final = (F_TYPE, F_RANK, F_SEQ, F_BODY, F_MAC)
FIELDS: Final = frozenset(FIELD_ORDER)

MAX_BODY_BYTES: Final = wire.MAX_BODY_BYTES
#: A join message (Hello, Assign, Reject) is a few short strings: a worker id, a host, a
#: dataset signature, a key. Anything larger is refused before its MAC is computed or
#: its body decoded: 300 signed 1 MiB Hellos stalled the coordinator's loop for 40 s
#: (issue 28), and every waiting worker read them all again.
MAX_JOIN_BODY_BYTES: Final = 4096
#: type names, rank and seq are short; anything longer is not ours.
MAX_HEAD_BYTES: Final = 64
#: the longest mac: a broadcast's MAC vector at its largest world, or an Ed25519 signature
MAX_MAC_BYTES: Final = max(signing.SIG_HEX, 1 + signing.SLOT_HEX * signing.VECTOR_MAX_RANKS)
#: the reason prefix of an entry refused as a replay (what the dlq and tests look for)
REPLAYED: Final = "replayed"


class EntryTooLarge(ValueError):
    pass


class Parsed(NamedTuple):
    type: str
    rank: str
    seq: int
    msg: object


def encode(msg: object) -> tuple[bytes, bytes]:
    """The type and body of an entry (encoded once; signed again if the id changes)."""
    type_ = wire.type_name(msg).encode()
    body = wire.encode(msg)
    if len(body) > MAX_BODY_BYTES:
        raise EntryTooLarge(f"{type_.decode()} body of {len(body)} bytes > {MAX_BODY_BYTES}")
    return type_, body


def sign(
    signer: signing.Signer,
    stream: str,
    entry_id: str,
    encoded: tuple[bytes, bytes],
    rank: str,
    seq: int,
) -> dict[bytes, bytes]:
    """The fields of one entry (in the order redis-cli will show them)."""
    type_, body = encoded
    rank_b = rank.encode()
    seq_b = str(seq).encode()
    data = signing.signed_bytes(stream.encode(), entry_id.encode(), type_, rank_b, seq_b, body)
    return {F_TYPE: type_, F_RANK: rank_b, F_SEQ: seq_b, F_BODY: body, F_MAC: signer.sign(data)}


def build(
    signer: signing.Signer, stream: str, entry_id: str, msg: object, rank: str, seq: int
) -> dict[bytes, bytes]:
    return sign(signer, stream, entry_id, encode(msg), rank, seq)


def parse(
    verifier: signing.Verifier,
    stream: str,
    entry_id: bytes,
    fields: Mapping[bytes, bytes] | None,
    *,
    channel: str,
    rank: str,
    last_seq: int = 0,
) -> Parsed | str:
    """A validated entry of ``stream`` (owned by ``rank``) at ``entry_id``, or why it is
    rejected. ``last_seq``: the highest seq this reader already accepted on the stream."""
    # The coordinator's ingest runs this once per upstream message on one thread, so the
    # happy path is kept to plain lookups; every check of the slow path still runs.
    if not fields:  # XREADGROUP gives a pending entry that was trimmed away no fields
        return "entry was trimmed or deleted before it was dispatched"
    try:
        type_ = fields[F_TYPE]
        rank_b = fields[F_RANK]
        seq_b = fields[F_SEQ]
        body = fields[F_BODY]
        mac = fields[F_MAC]
    except KeyError:
        type_ = None
    if type_ is None or len(fields) != len(FIELDS):
        extra = sorted(k.decode(errors="replace") for k in set(fields) - FIELDS)
        missing = sorted(k.decode() for k in FIELDS - set(fields))
        return f"bad fields: missing {missing}, unexpected {extra}"
    cap = MAX_JOIN_BODY_BYTES if channel == wire.JOIN else MAX_BODY_BYTES
    if len(body) > cap:
        return f"oversized: body of {len(body)} bytes > {cap}"
    if (
        len(type_) > MAX_HEAD_BYTES
        or len(rank_b) > MAX_HEAD_BYTES
        or len(seq_b) > MAX_HEAD_BYTES
        or len(mac) > MAX_MAC_BYTES
    ):
        return "oversized: type, rank, seq or mac field too long"
    try:
        seq = int(seq_b)
    except ValueError:
        return "bad type, rank or seq field"
    if seq <= last_seq:
        # Only a label: the entry is refused either way, MAC or not.
        return f"{REPLAYED}: seq {seq} at or below {last_seq}, already passed on this stream"
    data = signing.signed_bytes(stream.encode(), entry_id, type_, rank_b, seq_b, body)
    if not verifier.verify(data, mac):
        return (
            "authentication failed: bad mac (forged, another run's or stream's, "
            "or copied under a new entry id)"
        )
    try:
        type_name = type_.decode("ascii")
        rank_text = rank_b.decode("ascii")
    except UnicodeDecodeError:
        return "bad type, rank or seq field"
    if rank_text != rank:
        return f"rank field {rank_text!r} on a stream of rank {rank!r}"
    kind = wire.channel_of(type_name)
    if kind is None:
        return f"unknown type {type_name!r}"
    if kind != channel:
        return f"wrong channel: {type_name} is a {kind} message, this is a {channel} stream"
    try:
        # `expect`: a body of another type than the type field is refused in there
        msg = wire.decode(body, channel, type_name)
    except wire.DecodeError as exc:
        return f"undecodable: {exc.reason}"
    if channel == wire.UPSTREAM and str(getattr(msg, "rank", "")) != rank:
        return f"body rank {getattr(msg, 'rank', None)!r} on the stream of rank {rank}"
    return Parsed(type_name, rank_text, seq, msg)


def dead_letter_fields(
    stream: str, entry_id: str, reason: str, fields: Mapping[bytes, bytes] | None, by: str
) -> dict[bytes, bytes]:
    """A dlq entry: where it came from, why, and the original fields (trimmed)."""
    out: dict[bytes, bytes] = {
        b"stream": stream.encode(),
        b"entry": entry_id.encode(),
        b"reason": reason.encode()[:512],
        b"by": by.encode(),
    }
    for i, (k, v) in enumerate((fields or {}).items()):
        if i >= 16:
            out[b"truncated"] = b"1"
            break
        out[b"orig." + bytes(k)[:64]] = bytes(v)[:256]
    return out
