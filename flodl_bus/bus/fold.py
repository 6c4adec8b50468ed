"""Folded upstream: many ranks' signed entries carried in one entry of a host's stream.

A host agent (``flodl_bus.agent``) writes its ranks' upstream into one stream,
``flodl:{RUN}:up:host:<name>``, one entry per tick. The agent holds no rank key, so
what it carries must stay verifiable as each rank signed it:

* a rank signs an item with its own rank key over ``signing.signed_bytes`` of its own
  upstream stream key (``up:<r>``, the run's hash tag included), the entry-id slot set
  to ``FOLD_ID`` (``b"fold"``: a real entry id is ``<ms>-<n>``, so a folded item never
  verifies as a direct entry and a direct entry never as a folded item), its type, its
  rank, its own per-stream seq and its body. The id the agent picks is not covered: the
  rank's seq, strictly increasing, does what the id did (replay protection, order).
* the folded entry is five plain fields like any entry: ``type`` ``Fold``, ``rank``
  ``host:<name>``, ``seq`` (the agent's), ``body`` (msgpack list of items, each
  ``[rank, seq, type, body, mac]`` exactly as the rank made them) and ``mac`` — here a
  digest of the body, which the agent uses to tell after a lost reply whether its
  write landed (``stream_ops.landed``). It authenticates nothing: each item does.

The coordinator unpacks (``unpack``) and runs each item through ``entries.parse`` with
the item's rank's key, its logical stream ``up:<r>`` and that stream's last accepted
seq: a forged, altered, replayed or re-ranked item is dead-lettered alone, the others of
the entry are dispatched. Each item is delivered as from ``up:<r>`` under a synthetic id
``<ms>-<n * FOLD_SLOTS + k>`` (fold entry ``<ms>-<n>``, item k of it): ids stay unique
and increasing per rank, so records, ``flodl-bus replay`` and the coordinator's rank
lookup see what they see for a direct entry (replay re-signs items as direct entries).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple

import msgspec

from flodl_bus.bus import entries
from flodl_bus.bus.api import Delivery
from flodl_bus.bus.cursor import Received
from flodl_bus.bus.ids import EntryId, format_id, parse_id
from flodl_bus.bus.stream_ops import log
from flodl_bus.protocol import signing, wire

FOLD_ID: Final = b"fold"
FOLD_TYPE: Final = b"Fold"
HOST_PREFIX: Final = "host:"
#: most items in one folded entry (the synthetic ids leave this many per entry)
FOLD_SLOTS: Final = 4096
#: a folded entry's body: items of at most ``MAX_BODY_BYTES`` each, but a tick of 8
#: ranks is a few kB; anything past this is not an agent's
MAX_FOLD_BYTES: Final = 8 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def host_stream(prefix: str, host: str) -> str:
    """The fold stream of host ``host`` under a run (or shard) key prefix."""
    if not host or any(c in host for c in "{}:*?[] \t\n"):
        raise ValueError(f"host name {host!r}: use letters, digits, '.', '_' or '-'")
    return f"{prefix}up:{HOST_PREFIX}{host}"


def sign_item(
    key: signing.Signer, up_stream: str, rank: int, seq: int, encoded: tuple[bytes, bytes]
) -> list[Any]:
    """One rank's item, signed by the rank for its own ``up:<r>`` and seq."""
    type_, body = encoded
    rank_b = str(rank).encode()
    seq_b = str(seq).encode()
    data = signing.signed_bytes(up_stream.encode(), FOLD_ID, type_, rank_b, seq_b, body)
    return [rank, seq, type_, body, key.sign(data)]


def digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=16).hexdigest().encode()


def fold_fields(host: str, seq: int, items: list[list[Any]]) -> dict[bytes, bytes]:
    body = _encoder.encode(items)
    return {
        entries.F_TYPE: FOLD_TYPE,
        entries.F_RANK: f"{HOST_PREFIX}{host}".encode(),
        entries.F_SEQ: str(seq).encode(),
        entries.F_BODY: body,
        entries.F_MAC: digest(body),
    }


class Item(NamedTuple):
    """One unpacked item: delivered (``msg`` set) or refused (``reason`` set)."""

    stream: str
    entry_id: EntryId
    msg: object
    reason: str | None
    fields: dict[bytes, bytes]


class Unpacked(NamedTuple):
    items: list[Item]


def unpack(
    eid: EntryId,
    fields: Mapping[bytes, bytes] | None,
    *,
    up_stream_of: Callable[[int], str | None],
    verifiers: Mapping[str, signing.Verifier],
    seqs: dict[str, int],
) -> Unpacked | str:
    """A folded entry's items, each verified with its rank's own key, or why the whole
    entry is refused. ``up_stream_of(rank)``: the rank's ``up:<r>`` key if this reader
    serves it; ``seqs``: last accepted seq per ``up:<r>`` (moved by accepted items)."""
    if not fields:
        return "entry was trimmed or deleted before it was dispatched"
    if fields.get(entries.F_TYPE) != FOLD_TYPE or set(fields) != entries.FIELDS:
        return "bad fields: not a folded entry"
    body = fields[entries.F_BODY]
    if len(body) > MAX_FOLD_BYTES:
        return f"oversized: folded body of {len(body)} bytes > {MAX_FOLD_BYTES}"
    if fields[entries.F_MAC] != digest(body):
        return "bad digest: folded body altered or truncated"
    try:
        raw = _decoder.decode(body)
    except (msgspec.DecodeError, ValueError):
        return "undecodable: folded body is not msgpack"
    if not isinstance(raw, list) or not raw or len(raw) > FOLD_SLOTS:
        return f"bad folded body: expected a list of 1..{FOLD_SLOTS} items"
    out: list[Item] = []
    for k, item in enumerate(raw):
        sid = (eid[0], eid[1] * FOLD_SLOTS + k)
        if (
            not isinstance(item, list)
            or len(item) != 5
            or type(item[0]) is not int
            or type(item[1]) is not int
            or not all(isinstance(x, bytes) for x in item[2:])
        ):
            out.append(Item("", sid, None, "bad folded item: not [rank, seq, type, body, mac]", {}))
            continue
        rank, seq, type_, ibody, mac = item
        item_fields = {
            entries.F_TYPE: type_,
            entries.F_RANK: str(rank).encode(),
            entries.F_SEQ: str(seq).encode(),
            entries.F_BODY: ibody,
            entries.F_MAC: mac,
        }
        stream = up_stream_of(rank) if rank >= 0 else None
        if stream is None or stream not in verifiers:
            why = f"folded item of rank {rank}, not a rank this host serves"
            out.append(Item("", sid, None, why, item_fields))
            continue
        p = entries.parse(
            verifiers[stream],
            stream,
            FOLD_ID,
            item_fields,
            channel=wire.UPSTREAM,
            rank=str(rank),
            last_seq=seqs.get(stream, 0),
        )
        if isinstance(p, str):
            out.append(Item(stream, sid, None, p, item_fields))
            continue
        last = seqs.get(stream, 0)
        if last and p.seq != last + 1:
            # as for a direct entry (``reader.read_parsed``): said once, loudly
            log.error(
                "bus_entries_missing",
                reader="fold",
                stream=stream,
                seqs=f"{last + 1}..{p.seq - 1}",
                reason="never folded, or withheld by the host's agent",
            )
        seqs[stream] = p.seq
        out.append(Item(stream, sid, p.msg, None, item_fields))
    return Unpacked(out)


def fold_entry_of(synthetic: EntryId) -> EntryId:
    """The folded entry a synthetic item id came from (what the coordinator acks)."""
    return (synthetic[0], synthetic[1] // FOLD_SLOTS)


def good_items(r: Received, unpacked: Unpacked, rejected: list[tuple[Received, str]]) -> list[Item]:
    """A verified folded entry's items that passed; each refused one goes to
    ``rejected`` as a dlq entry of its own (with the folded entry's id, which the dlq
    write acks)."""
    good: list[Item] = []
    for k, item in enumerate(unpacked.items):
        if item.reason is None:
            good.append(item)
        else:
            why = f"folded item {k} ({item.stream or 'no rank stream'}): {item.reason}"
            rejected.append((Received(r.stream, r.entry_id, item.fields), why))
    return good


def unfold_into(
    r: Received, unpacked: Unpacked, out: list[Delivery], rejected: list[tuple[Received, str]]
) -> None:
    """A verified folded entry's items: each good one a delivery as from its rank's own
    stream, each refused one a dlq entry of its own (``good_items``)."""
    for item in good_items(r, unpacked, rejected):
        out.append(Delivery(item.stream, format_id(item.entry_id), item.msg))


class FoldRoutes:
    """The coordinator's side of every host agent of a run: which ranks each fold
    stream may carry, the unpacker the reader calls, and the ack of an item (its folded
    entry, on the fold stream)."""

    def __init__(self, verifiers: Mapping[str, signing.Verifier], seqs: dict[str, int]) -> None:
        self._verifiers = verifiers
        self._seqs = seqs
        #: fold stream -> rank -> that rank's ``up:<r>``
        self.hosts: dict[str, dict[int, str]] = {}
        #: ``up:<r>`` -> the fold stream that carries it
        self.fold_of: dict[str, str] = {}

    def add(self, fold_stream: str, ranks: Mapping[int, str]) -> None:
        self.hosts.setdefault(fold_stream, {}).update(ranks)
        for up in ranks.values():
            self.fold_of[up] = fold_stream

    def check(self, stream: str, eid: EntryId, fields: Mapping[bytes, bytes] | None) -> object:
        return unpack(
            eid,
            fields,
            up_stream_of=self.hosts.get(stream, {}).get,
            verifiers=self._verifiers,
            seqs=self._seqs,
        )

    def acks(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """``deliveries`` with every folded item's ack pointed at its folded entry."""
        fold_of = self.fold_of
        if not fold_of:
            return list(deliveries)
        out: list[Delivery] = []
        for d in deliveries:
            host = fold_of.get(d.stream)
            if host is None:
                out.append(d)
            else:
                out.append(Delivery(host, format_id(fold_entry_of(parse_id(d.entry_id))), None))
        return out
