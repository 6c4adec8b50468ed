"""Entry authentication, and the keys of a run's roles.

Three kinds of key, so that what a rank holds never lets it speak for anyone else:

- the **run secret** (shared by the coordinator and every worker): it authenticates a
  worker's ``Hello`` on the join stream and the coordinator's published identity. It is
  what makes a process a member of the run, nothing more.
- the **coordinator identity**: an Ed25519 key that signs what goes to every rank (the
  broadcast stream and the join answers) and an X25519 key for key agreement. Only the
  coordinator holds the private halves; ranks verify with the public ones.
- a **rank key** per rank: X25519 between the rank's own fresh key (its public half rides
  in its Hello) and the coordinator's. Only that rank and the coordinator can compute it;
  it MACs the rank's upstream stream and its unicast control stream. Another rank cannot
  forge either.

Every MAC or signature covers the stream key (the run's hash tag included), the entry id
the writer chose, the type, the rank field, the writer's per-stream sequence and the body:
an entry copied into another stream, another run, or re-added under another id fails.
HMAC-SHA256 costs about a microsecond and keeps the coordinator's ingest fast; Ed25519
is kept for the low-rate broadcast and join answers, where one signature serves all ranks.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

MAC_BYTES: Final = 16
SECRET_BYTES: Final = 16
#: A broadcast to a world of at most this many ranks carries one short MAC per rank
#: (``m`` + 16 hex a rank): each rank checks its own slot with its rank key, so no rank
#: can make what another accepts, at a microsecond a rank instead of an Ed25519
#: signature and verification (about 80 µs together on an H200 host, which alone took
#: the 8-rank dispatch p50 past 10x PING). Larger worlds get one Ed25519 signature:
#: constant size, where the vector would grow by 16 bytes a rank.
VECTOR_MAX_RANKS: Final = 64
VECTOR_TAG: Final = b"m"
SLOT_HEX: Final = 16
KEY_BYTES: Final = 32
#: hex length of an Ed25519 signature (64 bytes)
SIG_HEX: Final = 128


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def _as_bytes(v: bytes | str | int) -> bytes:
    if isinstance(v, bytes):
        return v
    return str(v).encode()


def signed_bytes(
    stream: bytes, entry_id: bytes, type_: bytes, rank: bytes, seq: bytes, body: bytes
) -> bytes:
    """What a MAC or signature covers. Unit and record separators cannot occur in a
    stream key, an entry id, a type name or a decimal int, so the join is unambiguous."""
    return b"".join(
        (stream, b"\x1f", entry_id, b"\x1f", type_, b"\x1f", rank, b"\x1f", seq, b"\x1e", body)
    )


class Signer(Protocol):
    def sign(self, data: bytes) -> bytes: ...


class Verifier(Protocol):
    def verify(self, data: bytes, mac: bytes) -> bool: ...


#: HMAC-SHA256's block size: a key is padded to it (or hashed first when longer)
_BLOCK: Final = 64
#: what a broadcast slot's HMAC covers before the signed bytes
_SLOT_LABEL: Final = b"broadcast\x1f"
_BLANK_SLOT: Final = b"\x00" * (SLOT_HEX // 2)


def _pads(key: bytes) -> tuple[hashlib._Hash, hashlib._Hash, hashlib._Hash]:
    """HMAC-SHA256's inner and outer hashes with the padded key already absorbed (and
    the inner one of a broadcast slot, its label absorbed too): a MAC then costs two
    state copies and two short hashes. ``hmac.digest`` sets the key up again on every
    call, which on OpenSSL 3 is most of its cost (3.3 µs against 1.4 µs a MAC here)."""
    if len(key) > _BLOCK:
        key = hashlib.sha256(key).digest()
    key = key.ljust(_BLOCK, b"\x00")
    inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
    outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))
    slot = inner.copy()
    slot.update(_SLOT_LABEL)
    return inner, outer, slot


def _hmac(inner: hashlib._Hash, outer: hashlib._Hash, data: bytes) -> bytes:
    """HMAC-SHA256 of ``data`` from prepared pads (equal to ``hmac.digest``)."""
    h = inner.copy()
    h.update(data)
    o = outer.copy()
    o.update(h.digest())
    return o.digest()


@dataclass(frozen=True, slots=True)
class MacKey:
    """An HMAC-SHA256 key; MACs are 32 lowercase hex bytes (readable in redis-cli)."""

    key: bytes = field(repr=False)
    #: the prepared pads (``_pads``); derived from ``key``, so never compared or pickled
    pads: tuple[hashlib._Hash, hashlib._Hash, hashlib._Hash] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "pads", _pads(self.key))

    def __reduce__(self) -> tuple[type[MacKey], tuple[bytes]]:
        # hash states do not pickle: a copy is made from the key again
        return (MacKey, (self.key,))

    def sign(self, data: bytes) -> bytes:
        inner, outer, _ = self.pads
        return _hmac(inner, outer, data)[:MAC_BYTES].hex().encode()

    def verify(self, data: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(self.sign(data), mac)

    def slot_digest(self, data: bytes) -> bytes:
        """This key's slot of a broadcast MAC vector, raw (8 bytes of the HMAC over
        ``broadcast\x1f`` + ``data``)."""
        _, outer, slot = self.pads
        return _hmac(slot, outer, data)[: SLOT_HEX // 2]

    def slot(self, data: bytes) -> bytes:
        """This key's slot of a broadcast MAC vector (8 bytes of the HMAC, in hex)."""
        return self.slot_digest(data).hex().encode()


@dataclass(frozen=True, slots=True)
class SigningKey:
    """The coordinator's Ed25519 key; signatures are 128 hex bytes."""

    key: Ed25519PrivateKey = field(repr=False)

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data).hex().encode()

    @property
    def public(self) -> VerifyKey:
        return VerifyKey(self.key.public_key())


@dataclass(frozen=True, slots=True)
class VerifyKey:
    key: Ed25519PublicKey

    @classmethod
    def from_hex(cls, text: str) -> VerifyKey:
        return cls(Ed25519PublicKey.from_public_bytes(bytes.fromhex(text)))

    @property
    def hex(self) -> str:
        return self.key.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()

    def verify(self, data: bytes, mac: bytes) -> bool:
        if len(mac) != SIG_HEX:
            return False
        try:
            self.key.verify(bytes.fromhex(mac.decode("ascii")), data)
        except (InvalidSignature, ValueError, UnicodeDecodeError):
            return False
        return True


def _kdf(*parts: bytes) -> bytes:
    # HMAC as an extract-and-expand step with a fixed label: one output block is all we
    # need, and every input is length-prefixed so no two inputs collide.
    h = hmac.new(b"flodl-bus key v1", digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


def _x_pub_hex(key: X25519PrivateKey) -> str:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def _rank_key(shared: bytes, run: str, rank: int, rank_pub: str, coord_pub: str) -> MacKey:
    return MacKey(
        _kdf(
            b"rank", shared, run.encode(), str(rank).encode(), rank_pub.encode(), coord_pub.encode()
        )
    )


class BadKey(ValueError):
    """A public key or identity that does not parse, or does not belong to the run."""


def _x_public(text: str, what: str) -> X25519PublicKey:
    try:
        return X25519PublicKey.from_public_bytes(bytes.fromhex(text))
    except ValueError:
        raise BadKey(f"{what} is not an X25519 public key") from None


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """The coordinator's public keys, as every rank learns them."""

    sign_pub: VerifyKey
    kx_pub: str

    def check(self, secret: bytes, run: str) -> str:
        """Binds the public keys to the run secret: a process without the secret cannot
        publish an identity that ranks accept, and a rank whose secret is wrong finds out
        before it says anything."""
        return (
            MacKey(secret)
            .sign(
                b"\x1f".join(
                    (b"identity", run.encode(), self.sign_pub.hex.encode(), self.kx_pub.encode())
                )
            )
            .decode()
        )

    def to_fields(self, secret: bytes, run: str) -> dict[str, str]:
        return {
            "sign_pub": self.sign_pub.hex,
            "kx_pub": self.kx_pub,
            "check": self.check(secret, run),
        }

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> RunIdentity:
        try:
            sign_pub = VerifyKey.from_hex(fields["sign_pub"])
            kx_pub = fields["kx_pub"]
        except (KeyError, ValueError):
            raise BadKey("the run identity is incomplete or malformed") from None
        _x_public(kx_pub, "the identity's kx_pub")
        return cls(sign_pub, kx_pub)


@dataclass(frozen=True, slots=True)
class CoordinatorIdentity:
    """The coordinator's private keys. Made fresh per coordinator, or from a 32-byte
    seed (``flodl-bus up`` hands one to its coordinator, so its own console can check
    the ranks' upstream entries as the coordinator does)."""

    signing: SigningKey = field(repr=False)
    kx: X25519PrivateKey = field(repr=False)

    @classmethod
    def generate(cls) -> CoordinatorIdentity:
        return cls.from_seed(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_seed(cls, seed: bytes) -> CoordinatorIdentity:
        if len(seed) != KEY_BYTES:
            raise BadKey(f"a coordinator key seed is {KEY_BYTES} bytes, got {len(seed)}")
        return cls(
            SigningKey(Ed25519PrivateKey.from_private_bytes(_kdf(b"sign", seed))),
            X25519PrivateKey.from_private_bytes(_kdf(b"kx", seed)),
        )

    @property
    def public(self) -> RunIdentity:
        return RunIdentity(self.signing.public, _x_pub_hex(self.kx))

    def rank_key(self, run: str, rank: int, rank_pub: str) -> MacKey:
        shared = self.kx.exchange(_x_public(rank_pub, f"rank {rank}'s kx_pub"))
        return _rank_key(shared, run, rank, rank_pub, self.public.kx_pub)


@dataclass(frozen=True, slots=True)
class RankKx:
    """A worker's fresh X25519 key: its public half goes into its Hello."""

    key: X25519PrivateKey = field(repr=False)

    @classmethod
    def generate(cls) -> RankKx:
        return cls(X25519PrivateKey.generate())

    @property
    def pub(self) -> str:
        return _x_pub_hex(self.key)

    def rank_key(self, identity: RunIdentity, run: str, rank: int) -> MacKey:
        shared = self.key.exchange(_x_public(identity.kx_pub, "the identity's kx_pub"))
        return _rank_key(shared, run, rank, self.pub, identity.kx_pub)


# --------------------------------------------------------------- per-role key sets


@dataclass(frozen=True, slots=True)
class RankKeys:
    """What a rank signs and verifies with: its rank key both ways on its own streams,
    the coordinator's public key for the broadcast stream."""

    rank_key: MacKey
    broadcast: VerifyKey

    def broadcast_verifier(self, rank: int) -> BroadcastVerifier:
        return BroadcastVerifier(rank, self.rank_key, self.broadcast)


@dataclass(frozen=True, slots=True)
class BroadcastVerifier:
    """Rank ``rank``'s check of a broadcast: its slot of a MAC vector, or the
    coordinator's Ed25519 signature (worlds above ``VECTOR_MAX_RANKS``)."""

    rank: int
    rank_key: MacKey
    public: VerifyKey

    def verify(self, data: bytes, mac: bytes) -> bool:
        if mac[:1] == VECTOR_TAG:
            start = 1 + self.rank * SLOT_HEX
            got = mac[start : start + SLOT_HEX]
            return len(got) == SLOT_HEX and hmac.compare_digest(self.rank_key.slot(data), got)
        return self.public.verify(data, mac)


@dataclass(slots=True)
class CoordinatorKeys:
    """The coordinator's signer for broadcasts, and one key per admitted rank."""

    signing: SigningKey
    ranks: dict[int, MacKey] = field(default_factory=dict)
    #: derives the key of a rank not in ``ranks`` (fixed keys only)
    derive: Callable[[int], MacKey] | None = None

    def rank(self, rank: int) -> MacKey:
        key = self.ranks.get(rank)
        if key is None:
            if self.derive is None:
                raise KeyError(f"no key for rank {rank}: it was never admitted")
            key = self.ranks[rank] = self.derive(rank)
        return key

    @property
    def broadcast(self) -> Signer:
        """What broadcasts are signed with (see ``VECTOR_MAX_RANKS``)."""
        return _VectorSigner(self) if len(self.ranks) <= VECTOR_MAX_RANKS else self.signing

    @property
    def broadcast_check(self) -> Verifier:
        return _VectorSigner(self)


@dataclass(frozen=True, slots=True)
class _VectorSigner:
    keys: CoordinatorKeys

    def verify(self, data: bytes, mac: bytes) -> bool:
        """The coordinator's own check of a broadcast it may have written (a restart
        continuing a stream's seq): its vector, or its signature."""
        if mac[:1] == VECTOR_TAG:
            return hmac.compare_digest(self.sign(data), mac)
        return self.keys.signing.public.verify(data, mac)

    def sign(self, data: bytes) -> bytes:
        # One hex conversion for the whole vector (a rank never admitted: zeros). This
        # runs once per broadcast, a slot per rank: the loop is kept to plain calls.
        ranks = self.keys.ranks
        raw: list[bytes] = []
        for r in range(max(ranks, default=-1) + 1):
            key = ranks.get(r)
            if key is None:
                raw.append(_BLANK_SLOT)
                continue
            _, outer, slot = key.pads
            h = slot.copy()
            h.update(data)
            o = outer.copy()
            o.update(h.digest())
            raw.append(o.digest()[: SLOT_HEX // 2])
        return VECTOR_TAG + b"".join(raw).hex().encode()


def fixed_keys(seed: bytes = b"\x07" * KEY_BYTES) -> CoordinatorKeys:
    """Deterministic keys for any rank without a join, from one seed: tests, benches and
    replay (which re-signs recorded entries and has no run secret to protect). Any
    length of seed."""
    seed = hashlib.sha256(seed).digest()
    ident = CoordinatorIdentity.from_seed(seed)
    return CoordinatorKeys(
        ident.signing, derive=lambda r: MacKey(_kdf(b"fixed rank", seed, str(r).encode()))
    )


def rank_keys_for(coord: CoordinatorKeys, rank: int) -> RankKeys:
    """A rank's key set as the coordinator can build it (tests, replay, benches)."""
    return RankKeys(coord.rank(rank), coord.signing.public)
