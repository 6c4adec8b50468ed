"""The one home of the wire: every message <-> msgpack conversion and its validation.

A body is a msgpack map with named fields (never positional variant indices)::

    {"v": SCHEMA_VERSION, "type": "StartEpoch", "plan": {...}}

Adding a message means adding its class to ``messages`` and one ``_spec(...)`` line here.

Decoding is strict: every malformed input raises ``DecodeError`` naming the reason, and
never another exception type, so a transport can route any bad entry to the dead-letter
stream with that reason and carry on.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Annotated, Any, Final, Literal

import msgspec

from flodl_bus.protocol import messages as m

SCHEMA_VERSION: Final = 1

#: Limits enforced before and while unpacking, so a hostile entry cannot make us allocate.
MAX_BODY_BYTES: Final = 1 << 20
MAX_STR_LEN: Final = 64 * 1024
MAX_BIN_LEN: Final = 4096
MAX_ARRAY_LEN: Final = 65_536
MAX_MAP_LEN: Final = 4096
_U64_LIMIT: Final = 2**64

CONTROL: Final = "control"
UPSTREAM: Final = "upstream"
JOIN: Final = "join"


#: A reason quotes offending values (a type name, a field name); a hostile entry must not
#: turn that into a 64 KiB dead-letter record or log line.
MAX_REASON_CHARS: Final = 200


class DecodeError(ValueError):
    """A body that cannot become a message. ``reason`` is short and safe to log."""

    def __init__(self, reason: str) -> None:
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[: MAX_REASON_CHARS - 3] + "..."
        super().__init__(reason)
        self.reason = reason


# ------------------------------------------------------------------- field decoders
# Each takes the raw unpacked value and the field path (for the error message).

Decoder = Callable[[Any, str], Any]
Encoder = Callable[[Any], Any]


def _u64(v: Any, path: str) -> int:
    # `type(v) is int` rejects bool (a subclass of int) and floats such as NaN.
    if type(v) is not int:
        raise DecodeError(f"{path}: expected a non-negative int, got {type(v).__name__}")
    if v < 0 or v >= _U64_LIMIT:
        raise DecodeError(f"{path}: {v} is out of range for an unsigned 64-bit int")
    return v


def _f64(v: Any, path: str) -> float:
    t = type(v)
    if t is float:
        return v  # type: ignore[no-any-return]
    if t is int and -_U64_LIMIT < v < _U64_LIMIT:
        return float(v)
    raise DecodeError(f"{path}: expected a float, got {t.__name__}")


def _optional(inner: Decoder) -> Decoder:
    def dec(v: Any, path: str) -> Any:
        return None if v is None else inner(v, path)

    return dec


def _str(v: Any, path: str) -> str:
    if type(v) is not str:
        raise DecodeError(f"{path}: expected a string, got {type(v).__name__}")
    return v


def _bool(v: Any, path: str) -> bool:
    if type(v) is not bool:
        raise DecodeError(f"{path}: expected a bool, got {type(v).__name__}")
    return v


def _bin(v: Any, path: str) -> bytes:
    if type(v) is not bytes:
        raise DecodeError(f"{path}: expected bytes, got {type(v).__name__}")
    return v


def _array(v: Any, path: str) -> tuple[Any, ...]:
    if type(v) is not tuple:
        raise DecodeError(f"{path}: expected an array, got {type(v).__name__}")
    return v  # type: ignore[no-any-return]


# Composite decoders run a fast pass that hands children the parent's path (formatting a
# path per item was most of the decode cost). Decoders are pure, so when the fast pass
# fails, a second pass with exact per-item paths fails at the same item and names it.


def _tuple_of(inner: Decoder) -> Decoder:
    def exact(t: tuple[Any, ...], path: str) -> tuple[Any, ...]:
        return tuple(inner(x, f"{path}[{i}]") for i, x in enumerate(t))

    def dec(v: Any, path: str) -> tuple[Any, ...]:
        t = _array(v, path)
        try:
            return tuple([inner(x, path) for x in t])
        except DecodeError:
            return exact(t, path)

    return dec


def _u64s(v: Any, path: str) -> tuple[int, ...]:
    t = _array(v, path)
    for x in t:
        if type(x) is not int or x < 0 or x >= _U64_LIMIT:
            break
    else:
        return t
    return tuple(_u64(x, f"{path}[{i}]") for i, x in enumerate(t))


def _f64s(v: Any, path: str) -> tuple[float, ...]:
    t = _array(v, path)
    for x in t:
        if type(x) is not float:
            break
    else:
        return t
    return tuple(_f64(x, f"{path}[{i}]") for i, x in enumerate(t))


def _pair(a: Decoder, b: Decoder) -> Decoder:
    def dec(v: Any, path: str) -> tuple[Any, Any]:
        t = _array(v, path)
        if len(t) != 2:
            raise DecodeError(f"{path}: expected a pair, got {len(t)} items")
        try:
            return (a(t[0], path), b(t[1], path))
        except DecodeError:
            return (a(t[0], f"{path}[0]"), b(t[1], f"{path}[1]"))

    return dec


_exact_u64_pair = _pair(_u64, _u64)


def _u64_pair(v: Any, path: str) -> tuple[int, int]:
    if type(v) is tuple and len(v) == 2:
        a, b = v
        if type(a) is int and type(b) is int and 0 <= a < _U64_LIMIT and 0 <= b < _U64_LIMIT:
            return v  # type: ignore[no-any-return]
    return _exact_u64_pair(v, path)  # type: ignore[no-any-return]


def _map_of(value: Decoder) -> Decoder:
    def exact(v: dict[Any, Any], path: str) -> dict[str, Any]:
        return {_str(k, f"{path} key"): value(x, f"{path}[{k!r}]") for k, x in v.items()}

    def dec(v: Any, path: str) -> dict[str, Any]:
        if type(v) is not dict:
            raise DecodeError(f"{path}: expected a map, got {type(v).__name__}")
        for k in v:
            if type(k) is not str:
                return exact(v, path)
        try:
            return {k: value(x, path) for k, x in v.items()}
        except DecodeError:
            return exact(v, path)

    return dec


def _record(cls: type, decoders: Mapping[str, Decoder]) -> Decoder:
    """A nested record (EpochPlan, EpochMetrics) as a map of named fields."""
    required = {
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    }

    allowed = frozenset(decoders)
    # EpochPlan rides on every StartEpoch: when every field is a u64, check them inline.
    all_u64 = all(d is _u64 for d in decoders.values())

    def dec(v: Any, path: str) -> Any:
        if type(v) is not dict:
            raise DecodeError(f"{path}: expected a map, got {type(v).__name__}")
        if not allowed.issuperset(v):
            unknown = next(k for k in v if k not in allowed)
            raise DecodeError(f"{path}: unknown field {unknown!r}")
        # every key is allowed, so a full-length map has no missing field
        if len(v) != len(allowed):
            missing = required.difference(v)
            if missing:
                raise DecodeError(f"{path}: missing field {sorted(missing)[0]!r}")
        if all_u64:
            for x in v.values():
                if type(x) is not int or x < 0 or x >= _U64_LIMIT:
                    break
            else:
                return cls(**v)
        try:
            kwargs = {k: decoders[k](x, path) for k, x in v.items()}
        except DecodeError:
            kwargs = {k: decoders[k](x, f"{path}.{k}") for k, x in v.items()}
        return cls(**kwargs)

    return dec


def _target(v: Any, path: str) -> int:
    rank = _u64(v, path)
    if rank == m.RESERVED_TARGET:
        raise DecodeError(
            f"{path}: target_rank 2**64-1 is reserved for a controller-side executor; "
            "the coordinator must name a worker rank"
        )
    return rank


# Built once: an enum lookup per decode cost more than the rest of ShutdownWithSave.
_REASON_OF_BYTE: Final = tuple(m.SaveReason.from_byte(b) for b in range(256))


def _save_reason(v: Any, path: str) -> m.SaveReason:
    byte = _u64(v, path)
    if byte > 255:
        raise DecodeError(f"{path}: SaveReason must be one byte, got {byte}")
    return _REASON_OF_BYTE[byte]


_INTENTS = {k.value: k for k in m.IntentKind}


def _intent(v: Any, path: str) -> m.IntentKind:
    try:
        return _INTENTS[_str(v, path)]
    except KeyError:
        raise DecodeError(f"{path}: unknown intent {v!r}") from None


_opt_f64 = _optional(_f64)
_opt_str = _optional(_str)
_opt_u64 = _optional(_u64)
_ENTRY_ID: Final = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


def _entry_id(v: Any, path: str) -> str:
    """A stream entry id, ``ms-seq`` (what a heartbeat says a rank has read)."""
    text = _str(v, path)
    if not _ENTRY_ID.fullmatch(text):
        raise DecodeError(f"{path}: not a stream entry id: {text[:40]!r}")
    return text


_opt_id = _optional(_entry_id)

_plan = _record(
    m.EpochPlan,
    {"epoch": _u64, "partition_offset": _u64, "partition_size": _u64},
)
_float_map = _map_of(_f64)
_resources = _record(
    m.ResourceSample,
    {
        "rss_bytes": _opt_u64,
        "device_index": _opt_u64,
        "gpu_util_percent": _opt_f64,
        "vram_allocated_bytes": _opt_u64,
        "vram_reserved_peak_bytes": _opt_u64,
        "vram_total_bytes": _opt_u64,
    },
)
_opt_resources = _optional(_resources)
_epoch_metrics = _record(
    m.EpochMetrics,
    {
        "epoch": _u64,
        "avg_loss": _f64,
        "epoch_ms": _f64,
        "scalars": _float_map,
        "per_rank": _tuple_of(_float_map),
        "per_rank_throughput": _f64s,
        "per_rank_batch_share": _f64s,
        "per_rank_share_complete_ms": _f64s,
        "per_rank_compute_only_ms": _f64s,
        "per_rank_data_starve_ms": _f64s,
        "device_indices": _u64s,
        "per_rank_loss": _tuple_of(_opt_f64),
        "per_rank_samples": _u64s,
        "per_rank_resources": _tuple_of(_opt_resources),
        "per_rank_skipped": _u64s,
    },
)
_segments = _tuple_of(_pair(_u64, _tuple_of(_u64_pair)))
_scalar_sums = _map_of(_pair(_f64, _u64))


# ------------------------------------------------------------------- field encoders


def plan_to_map(p: m.EpochPlan) -> dict[str, int]:
    """An ``EpochPlan``'s map (the one spelling: records and rank logs use it too)."""
    return {
        "epoch": p.epoch,
        "partition_offset": p.partition_offset,
        "partition_size": p.partition_size,
    }


def _enc_plan(p: m.EpochPlan | None) -> dict[str, int] | None:
    return None if p is None else plan_to_map(p)


def resources_to_map(r: m.ResourceSample | None) -> dict[str, Any] | None:
    """A ``ResourceSample``'s map (the one spelling: ``status`` reads it from meta too).
    Fields not read (every GPU one on a CPU rank) are left out, not sent as nil."""
    if r is None:
        return None
    return {f.name: v for f in fields(r) if (v := getattr(r, f.name)) is not None}


def _enc_metrics(e: m.EpochMetrics) -> dict[str, Any]:
    out = {
        "epoch": e.epoch,
        "avg_loss": e.avg_loss,
        "epoch_ms": e.epoch_ms,
        "scalars": dict(e.scalars),
        # A tuple like every other sequence here, so from_map(to_map(msg)) round-trips.
        "per_rank": tuple(dict(r) for r in e.per_rank),
        "per_rank_throughput": e.per_rank_throughput,
        "per_rank_batch_share": e.per_rank_batch_share,
        "per_rank_share_complete_ms": e.per_rank_share_complete_ms,
        "per_rank_compute_only_ms": e.per_rank_compute_only_ms,
        "per_rank_data_starve_ms": e.per_rank_data_starve_ms,
        "device_indices": e.device_indices,
        "per_rank_loss": e.per_rank_loss,
        "per_rank_samples": e.per_rank_samples,
    }
    if e.per_rank_resources:
        # Left out when no rank sent a sample: the message then reads as it did before
        # resources existed, to an older rank and against an older record.
        out["per_rank_resources"] = tuple(resources_to_map(r) for r in e.per_rank_resources)
    if e.per_rank_skipped:
        # the same: left out in a run that skipped nothing
        out["per_rank_skipped"] = e.per_rank_skipped
    return out


def _enc_target(rank: int) -> int:
    if rank == m.RESERVED_TARGET:
        raise ValueError("target_rank 2**64-1 is reserved; dispatch to a worker rank")
    return rank


# --------------------------------------------------------------------- the registry


@dataclass(frozen=True, slots=True)
class _Spec:
    name: str
    cls: type
    channel: str
    #: (field, encoder or None for as-is, decoder)
    fields: tuple[tuple[str, Encoder | None, Decoder], ...]
    required: frozenset[str]
    allowed: frozenset[str]
    #: (field, error path, decoder), paths formatted once here rather than per decode
    decoders: tuple[tuple[str, str, Decoder], ...]
    #: optional fields added after the message first shipped: left out of the map when
    #: None, so the message reads as before to a decoder that predates them (which
    #: refuses unknown fields) and to a record written before them
    omit_none: frozenset[str] = frozenset()


_BY_NAME: dict[str, _Spec] = {}
#: see ``_Spec.omit_none``
_ADDED_LATER: Final[dict[type, frozenset[str]]] = {
    m.Exiting: frozenset({"reason"}),
    m.Heartbeat: frozenset({"ctl_read", "all_read"}),
    m.MetricsMsg: frozenset({"resources"}),
    m.Hello: frozenset({"model_sig", "device_score"}),
}
_BY_CLASS: dict[type, _Spec] = {}


def _spec(cls: type, channel: str, name: str | None = None, **decoders: Decoder) -> None:
    encoders: dict[str, Encoder] = {
        "plan": _enc_plan,
        "next_plan": _enc_plan,
        "metrics": _enc_metrics,
        "reason": int,
        "kind": lambda k: k.value,
        "scalars": dict,
        "resources": resources_to_map,
    }
    for f in ("target_rank",):
        encoders[f] = _enc_target
    # A field name alone does not fix its encoding: Reject.reason is free text, only
    # ShutdownWithSave.reason is a SaveReason byte.
    if decoders.get("reason") is not _save_reason:
        del encoders["reason"]
    declared = {f.name: f for f in fields(cls)}
    if set(declared) != set(decoders):
        raise AssertionError(
            f"{cls.__name__}: wire fields {sorted(decoders)} != {sorted(declared)}"
        )
    required = frozenset(
        n for n, f in declared.items() if f.default is MISSING and f.default_factory is MISSING
    )
    spec = _Spec(
        name=name or cls.__name__,
        cls=cls,
        channel=channel,
        fields=tuple((n, encoders.get(n), decoders[n]) for n in declared),
        required=required,
        allowed=frozenset(declared) | {"v", "type"},
        decoders=tuple((n, f"{name or cls.__name__}.{n}", decoders[n]) for n in declared),
        omit_none=_ADDED_LATER.get(cls, frozenset()),
    )
    _BY_NAME[spec.name] = spec
    _BY_CLASS[cls] = spec


# control (coordinator -> rank)
_spec(m.RequestParams, CONTROL)
_spec(m.WireUpdate, CONTROL, "Update", version=_u64, next_plan=_optional(_plan))
_spec(m.StageAdvisory, CONTROL, counts=_u64s, segments=_segments)
_spec(m.SyncNow, CONTROL)
_spec(m.StartEpoch, CONTROL, plan=_plan)
_spec(m.DeclareDead, CONTROL, rank=_u64)
_spec(m.NewNcclSession, CONTROL, uid_bytes=_bin, new_rank=_u64, new_world_size=_u64)
_spec(m.RequestNewNcclId, CONTROL)
_spec(m.ShutdownWithSave, CONTROL, reason=_save_reason)
_spec(m.ExtendPartition, CONTROL, partition_offset=_u64, partition_size=_u64)
_spec(m.Throttle, CONTROL)
_spec(m.SetGlobalStep, CONTROL, global_step=_u64)
_spec(m.Checkpoint, CONTROL, version=_u64, target_rank=_target)
_spec(
    m.ExecuteEvalCallback,
    CONTROL,
    schedule_id=_u64,
    epoch=_u64,
    target_rank=_target,
    adopt_consensus=_bool,
)
_spec(m.ArmConsensusEval, CONTROL, schedule_id=_u64, epoch=_u64, target_rank=_target)
_spec(m.ArmEpochEval, CONTROL, schedule_id=_u64, epoch=_u64, target_rank=_target)
_spec(m.SetEpochCallbackRole, CONTROL, rank=_u64)
_spec(m.Shutdown, CONTROL)
_spec(m.EpochAggregated, CONTROL, metrics=_epoch_metrics)
_spec(m.EvalBroadcast, CONTROL, epoch=_u64, metric=_f64)
_spec(m.SaveConsensusModel, CONTROL, target_rank=_target)
_spec(m.CoordHeartbeat, CONTROL)

# upstream (rank -> coordinator): timing and metrics on one ordered stream
_spec(
    m.Batch,
    UPSTREAM,
    rank=_u64,
    batch_ms=_f64,
    data_ms=_f64,
    step_count=_u64,
    batch_loss=_f64,
    param_norm=_opt_f64,
    sync_divergence=_opt_f64,
)
_spec(
    m.SyncAck,
    UPSTREAM,
    rank=_u64,
    step_count=_u64,
    divergence=_opt_f64,
    post_norm=_opt_f64,
    pre_norm=_opt_f64,
)
_spec(m.Exiting, UPSTREAM, rank=_u64, reason=_opt_str)
_spec(m.LrUpdate, UPSTREAM, rank=_u64, lr=_f64)
_spec(m.Heartbeat, UPSTREAM, rank=_u64, step_count=_u64, ctl_read=_opt_id, all_read=_opt_id)
_spec(m.Intent, UPSTREAM, rank=_u64, kind=_intent)
_spec(m.SnapshotReady, UPSTREAM, rank=_u64)
_spec(m.NewNcclIdGenerated, UPSTREAM, rank=_u64, uid_bytes=_bin)
_spec(
    m.EvalResult,
    UPSTREAM,
    rank=_u64,
    schedule_id=_u64,
    epoch=_u64,
    metric=_f64,
    elapsed_ms=_f64,
    error=_opt_str,
)
_spec(m.CheckpointResult, UPSTREAM, rank=_u64, version=_u64, elapsed_ms=_f64, error=_opt_str)
_spec(m.EpochFnElapsed, UPSTREAM, rank=_u64, epoch=_u64, elapsed_ms=_f64)
_spec(
    m.MetricsMsg,
    UPSTREAM,
    "Metrics",
    rank=_u64,
    epoch=_u64,
    avg_loss=_f64,
    batches_processed=_u64,
    epoch_ms=_f64,
    samples_processed=_u64,
    share_complete_ms=_f64,
    compute_only_ms=_f64,
    data_starve_ms=_f64,
    scalars=_scalar_sums,
    resources=_opt_resources,
)

# membership
_spec(
    m.Hello,
    JOIN,
    worker_id=_str,
    host=_str,
    dataset_sig=_str,
    device=_str,
    requested_rank=_opt_u64,
    kx_pub=_str,
    model_sig=_opt_str,
    device_score=_opt_f64,
)
_spec(m.Assign, JOIN, worker_id=_str, rank=_u64, world_size=_u64)
_spec(m.Reject, JOIN, worker_id=_str, reason=_str)

# ------------------------------------------------------------------ C fast path
# A body whose fields are all plain numbers or bools is validated and built by msgspec in
# C (a Batch about 5x cheaper than through the checks below: `bench codec`, typed
# column), on the coordinator's ingest path, where every rank's Batch and LrUpdate land.
# The fast path only ever *accepts*: a schema struct with the same rules (schema version,
# type name, no unknown field, unsigned ints, floats that take ints, no bool for a
# number) must pass before the message is built straight from the body; anything it
# refuses goes through the full decoder below, which accepts or names the reason.
# `test_wire_fast` pins that the fast path accepts nothing the full decoder refuses and
# builds what the full decoder builds.

_FAST_FIELD: Final[dict[Decoder, Any]] = {
    _opt_id: Annotated[str, msgspec.Meta(pattern=_ENTRY_ID.pattern.join("^$"))] | None,
    _u64: Annotated[int, msgspec.Meta(ge=0)],
    _opt_u64: Annotated[int, msgspec.Meta(ge=0)] | None,
    _f64: float,
    _opt_f64: float | None,
    _bool: bool,
}


@dataclass(frozen=True, slots=True)
class _Fast:
    channel: str
    check: msgspec.msgpack.Decoder[Any]
    build: msgspec.msgpack.Decoder[Any]


def _fast_for(spec: _Spec) -> _Fast | None:
    if any(dec not in _FAST_FIELD for _, _, dec in spec.decoders):
        return None
    defaults = {f.name: f.default for f in fields(spec.cls)}
    schema: list[Any] = [("v", Literal[SCHEMA_VERSION]), ("type", Literal[spec.name])]
    for name, _, dec in spec.decoders:
        default = defaults[name]
        schema.append(
            (name, _FAST_FIELD[dec]) if default is MISSING else (name, _FAST_FIELD[dec], default)
        )
    check = msgspec.defstruct(f"_Wire{spec.name}", schema, forbid_unknown_fields=True)
    return _Fast(spec.channel, msgspec.msgpack.Decoder(check), msgspec.msgpack.Decoder(spec.cls))


_FAST: Final[dict[str, _Fast]] = {
    name: fast for name, spec in _BY_NAME.items() if (fast := _fast_for(spec)) is not None
}


CONTROL_TYPES: Final = frozenset(s.name for s in _BY_NAME.values() if s.channel == CONTROL)
UPSTREAM_TYPES: Final = frozenset(s.name for s in _BY_NAME.values() if s.channel == UPSTREAM)
JOIN_TYPES: Final = frozenset(s.name for s in _BY_NAME.values() if s.channel == JOIN)


# ------------------------------------------------------------------------ public API


def type_name(msg: object) -> str:
    """The wire ``type`` of a message (``WireUpdate`` travels as ``Update``)."""
    try:
        return _BY_CLASS[type(msg)].name
    except KeyError:
        raise TypeError(f"{type(msg).__name__} has no wire form") from None


def channel_of(type_name_: str) -> str | None:
    spec = _BY_NAME.get(type_name_)
    return spec.channel if spec else None


def to_map(msg: object) -> dict[str, Any]:
    """The msgpack-ready map of a message (also what the recorder logs)."""
    try:
        spec = _BY_CLASS[type(msg)]
    except KeyError:
        raise TypeError(
            f"{type(msg).__name__} has no wire form (in-process Update travels as WireUpdate)"
        ) from None
    out: dict[str, Any] = {"v": SCHEMA_VERSION, "type": spec.name}
    omit = spec.omit_none
    for name, enc, dec in spec.fields:
        value = getattr(msg, name)
        if value is None and omit and name in omit:
            continue
        if (dec is _u64 or (dec is _opt_u64 and value is not None)) and not (
            type(value) is int and 0 <= value < _U64_LIMIT
        ):
            # Refused here, at the sender, with the field named: on the wire the receiver
            # could only dead-letter it.
            raise ValueError(
                f"{spec.name}.{name} = {value!r}: the wire carries an unsigned 64-bit int"
            )
        out[name] = value if enc is None else enc(value)
    return out


def encode(msg: object) -> bytes:
    """Message -> msgpack body."""
    return _ENCODER.encode(to_map(msg))


_LOCAL_ENCODER: Final = msgspec.msgpack.Encoder()
_LOCAL_DECODERS: dict[str, msgspec.msgpack.Decoder[Any]] = {}


def encode_local(msg: object) -> tuple[str, bytes]:
    """A message for another process of the same rank, which runs this same code (its
    bus process, ``agent.rank_io``): the wire type and msgspec's own packing of the
    class, without the checked map of ``encode`` (a fifth of its time, paid on the
    training thread per step). Never for Redis nor a record: ``encode`` is the wire,
    and the bus process encodes with it (checking what ``to_map`` checks) before a
    message leaves the rank."""
    return type_name(msg), _LOCAL_ENCODER.encode(msg)


def decode_local(name: str, raw: bytes) -> Any:
    """``encode_local``'s message again. Raises ``DecodeError`` on anything else."""
    dec = _LOCAL_DECODERS.get(name)
    if dec is None:
        spec = _BY_NAME.get(name)
        if spec is None:
            raise DecodeError(f"unknown message type {name!r}")
        dec = _LOCAL_DECODERS[name] = msgspec.msgpack.Decoder(spec.cls)
    try:
        return dec.decode(raw)
    except (msgspec.DecodeError, ValueError) as exc:
        raise DecodeError(f"{name}: {exc}") from None


def from_map(data: Any, channel: str | None = None) -> Any:
    """Validated map -> message. Raises ``DecodeError`` on anything malformed."""
    if type(data) is not dict:
        raise DecodeError(f"body: expected a map, got {type(data).__name__}")
    version = data.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise DecodeError(f"body: unsupported schema version {version!r} (want {SCHEMA_VERSION})")
    name = data.get("type")
    spec = _BY_NAME.get(name) if type(name) is str else None
    if spec is None:
        raise DecodeError(f"body: unknown message type {name!r}")
    if channel is not None and spec.channel != channel:
        raise DecodeError(f"body: {name} is a {spec.channel} message, not {channel}")
    if not spec.allowed.issuperset(data):
        unknown = next(k for k in data if k not in spec.allowed)
        raise DecodeError(f"{name}: unknown field {unknown!r}")
    kwargs: dict[str, Any] = {}
    for fname, path, dec in spec.decoders:
        if fname in data:
            kwargs[fname] = dec(data[fname], path)
        elif fname in spec.required:
            raise DecodeError(f"{name}: missing field {fname!r}")
    return spec.cls(**kwargs)


# One msgpack library (msgspec) both ways. Its encoder writes the bytes msgpack-python
# wrote with use_bin_type (smallest int and str headers, float64, bin for bytes), so
# recorded sessions replay unchanged. Its generic decoder is looser than the wire: it
# yields lists, any hashable map key, Ext objects and datetimes, and has no per-item
# limits. `_plain` narrows what it returns to the wire's value space (None, bool, int,
# float, str, bytes, tuples, str-keyed maps) within the limits above; an oversized header
# cannot make msgspec allocate beyond the body, which MAX_BODY_BYTES already bounds.
# What it refuses reads `body: not valid msgpack (...)`, as msgpack-python's limits did.
_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder()
#: deeper than any message nests (StageAdvisory.segments is 4 levels)
_MAX_DEPTH: Final = 32
_SCALARS: Final = frozenset((type(None), bool, int, float))


def _plain(v: Any, depth: int) -> Any:
    t = type(v)
    if t in _SCALARS:
        return v
    if t is str:
        if len(v) > MAX_STR_LEN:
            raise ValueError(f"a string of {len(v)} chars exceeds max_str_len {MAX_STR_LEN}")
        return v
    if t is bytes:
        if len(v) > MAX_BIN_LEN:
            raise ValueError(f"{len(v)} bytes of binary exceed max_bin_len {MAX_BIN_LEN}")
        return v
    if depth >= _MAX_DEPTH:
        raise ValueError(f"nested deeper than {_MAX_DEPTH} levels")
    depth += 1
    if t is list:
        if len(v) > MAX_ARRAY_LEN:
            raise ValueError(f"an array of {len(v)} items exceeds max_array_len {MAX_ARRAY_LEN}")
        # numbers need no walk (most arrays are counts or throughputs)
        return tuple([x if type(x) in _SCALARS else _plain(x, depth) for x in v])
    if t is dict:
        if len(v) > MAX_MAP_LEN:
            raise ValueError(f"a map of {len(v)} entries exceeds max_map_len {MAX_MAP_LEN}")
        for k, x in v.items():
            if type(k) is not str:
                raise ValueError(f"a map key of type {type(k).__name__}, not str")
            if type(x) not in _SCALARS:
                v[k] = _plain(x, depth)  # same keys: safe while iterating
        return v
    raise ValueError(f"{t.__name__} values are not part of the wire")


def decode(body: bytes, channel: str | None = None, expect: str | None = None) -> Any:
    """msgpack body -> message, optionally requiring a channel (control/upstream/join).

    ``expect``: the type name the body should carry (a stream entry's ``type`` field),
    which selects the C fast path; any body is still accepted only if it is valid.
    """
    if type(body) is not bytes:
        raise DecodeError(f"body: expected bytes, got {type(body).__name__}")
    if len(body) > MAX_BODY_BYTES:
        raise DecodeError(f"body: {len(body)} bytes exceeds the {MAX_BODY_BYTES}-byte limit")
    fast = _FAST.get(expect) if expect is not None else None
    if fast is not None and (channel is None or fast.channel == channel):
        try:
            fast.check.decode(body)
            return fast.build.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass  # the full decoder below names the reason (or accepts)
    try:
        data = _plain(_DECODER.decode(body), 0)
    except Exception as exc:
        raise DecodeError(f"body: not valid msgpack ({type(exc).__name__}: {exc})") from None
    try:
        msg = from_map(data, channel)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"body: malformed ({type(exc).__name__}: {exc})") from None
    if expect is not None and (got := _BY_CLASS[type(msg)].name) != expect:
        raise DecodeError(f"type field {expect!r} but body is {got!r}")
    return msg


def decode_validated(body: bytes, channel: str, expect: str) -> Any:
    """``decode(body, channel, expect)`` of a body that another process of the run
    already decoded and validated so (``bus.ingest``'s readers hand the coordinator
    verified bodies): the schema check is skipped where a fast decoder exists, which
    halves the cost. Anything it cannot build goes through ``decode`` in full."""
    fast = _FAST.get(expect)
    if fast is not None and fast.channel == channel:
        try:
            return fast.build.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass
    return decode(body, channel, expect)


def decode_control(body: bytes) -> m.ControlWire:
    return decode(body, CONTROL)  # type: ignore[no-any-return]


def decode_upstream(body: bytes) -> m.UpstreamMsg:
    return decode(body, UPSTREAM)  # type: ignore[no-any-return]


def decode_join(body: bytes) -> m.JoinMsg:
    return decode(body, JOIN)  # type: ignore[no-any-return]
