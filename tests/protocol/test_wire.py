"""The wire: every variant round-trips, seed 004's conversion rules hold, and any malformed
body becomes one ``DecodeError`` naming the reason, never another exception."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_bus.bench.codec import sample_messages
from flodl_bus.protocol import messages as m
from flodl_bus.protocol import wire
from flodl_bus.protocol.wire import (
    CONTROL,
    CONTROL_TYPES,
    JOIN,
    JOIN_TYPES,
    SCHEMA_VERSION,
    UPSTREAM,
    UPSTREAM_TYPES,
    DecodeError,
    decode,
    decode_control,
    decode_join,
    decode_upstream,
    encode,
    from_map,
    to_map,
    type_name,
)
from tests.protocol.strategies import STRATEGIES, same

ALL_TYPES = CONTROL_TYPES | UPSTREAM_TYPES | JOIN_TYPES
SAMPLES = sample_messages()
DECODERS: dict[str, Callable[[bytes], Any]] = {
    CONTROL: decode_control,
    UPSTREAM: decode_upstream,
    JOIN: decode_join,
}
RESERVED = 2**64 - 1
TARGETED = (
    "Checkpoint",
    "ExecuteEvalCallback",
    "SaveConsensusModel",
    "ArmConsensusEval",
    "ArmEpochEval",
)


def channel(name: str) -> str:
    ch = wire.channel_of(name)
    assert ch is not None, name
    return ch


def thaw(v: Any) -> Any:
    """A wire map with lists and fresh dicts, so a test can edit nested values."""
    if isinstance(v, tuple | list):
        return [thaw(x) for x in v]
    if isinstance(v, dict):
        return {k: thaw(x) for k, x in v.items()}
    return v


def sample_map(name: str) -> dict[str, Any]:
    out: dict[str, Any] = thaw(to_map(SAMPLES[name]))
    return out


def with_value(name: str, path: tuple[Any, ...], value: Any) -> bytes:
    """The sample body of ``name`` with the value at ``path`` replaced."""
    data = sample_map(name)
    node: Any = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return msgpack.packb(data, use_bin_type=True)


def rejected(body: Any, ch: str | None = None) -> str:
    """Decode must raise DecodeError (a subclass check would let other errors through)."""
    with pytest.raises(DecodeError) as info:
        decode(body, ch)
    assert type(info.value) is DecodeError
    return info.value.reason


def outcome(body: bytes, ch: str | None = None) -> object | DecodeError:
    """What decoding gives: a message or the DecodeError. Anything else fails the test."""
    try:
        return decode(body, ch)
    except DecodeError as exc:
        return exc


# ---------------------------------------------------------------------- round trips


def test_strategies_and_samples_cover_every_wire_type() -> None:
    assert set(STRATEGIES) == ALL_TYPES
    assert set(SAMPLES) == ALL_TYPES
    # the three channels are disjoint, so a type name fixes its stream
    assert not (CONTROL_TYPES & UPSTREAM_TYPES or CONTROL_TYPES & JOIN_TYPES)
    assert not UPSTREAM_TYPES & JOIN_TYPES


@pytest.mark.parametrize("name", sorted(ALL_TYPES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_variant_round_trips_through_its_channel(name: str, data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[name])
    assert type_name(msg) == name
    body = encode(msg)
    assert same(DECODERS[channel(name)](body), msg)
    assert same(decode(body), msg)
    assert same(from_map(to_map(msg), channel(name)), msg)


@pytest.mark.parametrize("name", sorted(ALL_TYPES))
def test_body_is_a_map_of_named_fields_with_schema_version(name: str) -> None:
    msg = SAMPLES[name]
    raw = msgpack.unpackb(encode(msg))
    field_names = {f.name for f in dataclasses.fields(msg)}
    assert raw["v"] == SCHEMA_VERSION
    assert raw["type"] == name
    # A field added later is left off the wire when None (Exiting.reason, a Heartbeat's
    # read positions, MetricsMsg.resources, Hello.model_sig): the message reads as before
    later = wire._BY_CLASS[type(msg)].omit_none
    field_names -= {f for f in later if getattr(msg, f) is None}
    assert set(raw) == {"v", "type"} | field_names


def test_nan_and_infinities_survive_in_float_and_optional_float_fields() -> None:
    msg = m.Batch(
        rank=0,
        batch_ms=math.inf,
        data_ms=-math.inf,
        step_count=1,
        batch_loss=math.nan,
        param_norm=math.nan,
        sync_divergence=None,
    )
    back = decode_upstream(encode(msg))
    assert isinstance(back, m.Batch)
    assert math.isnan(back.batch_loss) and math.isnan(back.param_norm or 0.0)
    assert back.batch_ms == math.inf and back.data_ms == -math.inf
    assert back.sync_divergence is None


def test_an_int_in_a_float_field_decodes_as_a_float() -> None:
    back = decode(with_value("LrUpdate", ("lr",), 3))
    assert isinstance(back, m.LrUpdate)
    assert type(back.lr) is float and back.lr == 3.0


def test_optional_fields_may_be_omitted_and_take_their_default() -> None:
    data = sample_map("Batch")
    del data["param_norm"], data["sync_divergence"]
    back = decode_upstream(msgpack.packb(data))
    assert isinstance(back, m.Batch)
    assert back.param_norm is None and back.sync_divergence is None


def test_a_ranks_resource_sample_round_trips_through_its_metrics() -> None:
    sent = SAMPLES["Metrics"]
    assert isinstance(sent, m.MetricsMsg) and sent.resources is not None
    back = decode_upstream(encode(sent))
    assert isinstance(back, m.MetricsMsg)
    assert back.resources == sent.resources
    cpu = dataclasses.replace(sent, resources=m.ResourceSample(rss_bytes=123 * 2**20))
    # a CPU rank's sample carries its RSS alone: the GPU fields are left off the wire
    assert msgpack.unpackb(encode(cpu))["resources"] == {"rss_bytes": 123 * 2**20}
    assert decode_upstream(encode(cpu)) == cpu


def test_metrics_recorded_before_resources_decode_without_them_and_encode_the_same() -> None:
    old = sample_map("Metrics")
    del old["resources"]
    body = msgpack.packb(old, use_bin_type=True)
    back = decode_upstream(body)
    assert isinstance(back, m.MetricsMsg) and back.resources is None
    # re-encoded, it is the record's body byte for byte (a replay compares these)
    assert encode(back) == body


def test_an_aggregate_without_any_rank_resources_reads_as_before_they_existed() -> None:
    metrics = SAMPLES["EpochAggregated"].metrics
    bare = dataclasses.replace(metrics, per_rank_resources=())
    raw = msgpack.unpackb(encode(m.EpochAggregated(bare)))
    assert "per_rank_resources" not in raw["metrics"]
    with_them = msgpack.unpackb(encode(m.EpochAggregated(metrics)))["metrics"]
    assert with_them["per_rank_resources"][1] is None  # a rank that sent no sample
    assert decode_control(encode(m.EpochAggregated(metrics))) == m.EpochAggregated(metrics)


def test_an_aggregate_that_skipped_nothing_reads_as_before_the_count_existed() -> None:
    metrics = dataclasses.replace(SAMPLES["EpochAggregated"].metrics, per_rank_skipped=())
    assert "per_rank_skipped" not in msgpack.unpackb(encode(m.EpochAggregated(metrics)))["metrics"]
    skipped = dataclasses.replace(metrics, per_rank_skipped=(0, 4))
    assert decode_control(encode(m.EpochAggregated(skipped))) == m.EpochAggregated(skipped)


@pytest.mark.parametrize("name", TARGETED)
def test_reserved_target_rank_is_a_decode_error_naming_reserved(name: str) -> None:
    reason = rejected(with_value(name, ("target_rank",), RESERVED), CONTROL)
    assert "reserved" in reason
    assert f"{name}.target_rank" in reason


@pytest.mark.parametrize("name", TARGETED)
def test_largest_unreserved_target_rank_is_accepted(name: str) -> None:
    back = decode_control(with_value(name, ("target_rank",), RESERVED - 1))
    assert back.target_rank == RESERVED - 1


@pytest.mark.parametrize("name", TARGETED)
def test_encoding_reserved_target_rank_raises_value_error(name: str) -> None:
    msg = dataclasses.replace(SAMPLES[name], target_rank=RESERVED)
    with pytest.raises(ValueError, match="reserved"):
        encode(msg)


def test_save_reason_bytes_0_to_5_are_a_fixed_contract() -> None:
    expected = [
        m.SaveReason.GRACEFUL_SHUTDOWN,
        m.SaveReason.MAX_FAILURE_EXCEEDED,
        m.SaveReason.SINGLE_SURVIVOR,
        m.SaveReason.ALL_RANKS_LOST,
        m.SaveReason.REDUCE_STALL,
        m.SaveReason.CHECKPOINT,
    ]
    for byte, reason in enumerate(expected):
        raw = to_map(m.ShutdownWithSave(reason=reason))["reason"]
        assert type(raw) is int and raw == byte
        back = decode_control(with_value("ShutdownWithSave", ("reason",), byte))
        assert back == m.ShutdownWithSave(reason=reason)
        assert type(back.reason) is m.SaveReason


@pytest.mark.parametrize("byte", range(len(m.SaveReason), 256))
def test_unknown_save_reason_byte_falls_back_to_graceful_shutdown(byte: int) -> None:
    back = decode_control(with_value("ShutdownWithSave", ("reason",), byte))
    assert back == m.ShutdownWithSave(reason=m.SaveReason.GRACEFUL_SHUTDOWN)


@pytest.mark.parametrize("value", [256, 2**64 - 1, -1, True, 1.0, "Checkpoint"])
def test_save_reason_outside_one_byte_is_rejected(value: Any) -> None:
    rejected(with_value("ShutdownWithSave", ("reason",), value))


def _int_fields() -> list[tuple[str, tuple[Any, ...]]]:
    """Every unsigned integer on the wire, top level and nested, as (type, path)."""
    out: list[tuple[str, tuple[Any, ...]]] = []
    for name in sorted(ALL_TYPES):
        for f in dataclasses.fields(SAMPLES[name]):
            if f.type in ("int", "int | None"):
                out.append((name, (f.name,)))
    out += [
        ("StartEpoch", ("plan", "epoch")),
        ("StartEpoch", ("plan", "partition_offset")),
        ("StartEpoch", ("plan", "partition_size")),
        ("Update", ("next_plan", "partition_size")),
        ("EpochAggregated", ("metrics", "epoch")),
        ("EpochAggregated", ("metrics", "device_indices", 2)),
        ("EpochAggregated", ("metrics", "per_rank_samples", 0)),
        ("StageAdvisory", ("counts", 3)),
        ("StageAdvisory", ("segments", 0, 0)),
        ("StageAdvisory", ("segments", 1, 1, 0, 1)),
        ("Metrics", ("scalars", "accuracy", 1)),
    ]
    return out


INT_FIELDS = _int_fields()


def test_int_field_list_covers_ranks_sizes_and_steps() -> None:
    top = {path[0] for _, path in INT_FIELDS}
    assert {"rank", "new_rank", "new_world_size", "world_size", "step_count"} <= top
    assert {"global_step", "partition_offset", "partition_size", "target_rank"} <= top


@pytest.mark.parametrize(("name", "path"), INT_FIELDS, ids=lambda x: str(x))
@pytest.mark.parametrize(
    "bad",
    [-1, -(2**63), True, False, 1.0, 0.0, math.nan, math.inf, "1"],
    ids=["neg1", "i64min", "true", "false", "float1", "float0", "nan", "inf", "str"],
)
def test_unsigned_int_fields_reject_negatives_bools_floats_and_nan(
    name: str, path: tuple[Any, ...], bad: Any
) -> None:
    rejected(with_value(name, path, bad), channel(name))


@pytest.mark.parametrize("bad", [-1, True, 1.0, 2**64, None])
def test_an_unsigned_int_field_out_of_range_is_refused_at_the_sender_naming_it(bad: Any) -> None:
    msg = dataclasses.replace(SAMPLES["Batch"], rank=bad)
    for fn in (encode, to_map):
        with pytest.raises(ValueError, match=r"Batch\.rank = .*unsigned 64-bit"):
            fn(msg)
    # an optional one may be None, but not negative
    assert (
        to_map(dataclasses.replace(SAMPLES["Hello"], requested_rank=None))["requested_rank"] is None
    )
    with pytest.raises(ValueError, match=r"Hello\.requested_rank = -1"):
        encode(dataclasses.replace(SAMPLES["Hello"], requested_rank=-1))


def test_in_process_update_has_no_wire_form() -> None:
    update = m.Update(avg=m.AveragedParams(params=(), buffers=(), version=3))
    for fn in (encode, to_map, type_name):
        with pytest.raises(TypeError, match="Update"):
            fn(update)
    # only the wire-only twin travels, under the name "Update"
    assert type_name(m.WireUpdate(version=3)) == "Update"
    assert isinstance(decode_control(encode(m.WireUpdate(version=3))), m.WireUpdate)


@pytest.mark.parametrize("obj", [m.EpochPlan(1, 2, 3), object(), {"type": "SyncNow"}, None])
def test_non_messages_have_no_wire_form(obj: object) -> None:
    with pytest.raises(TypeError):
        encode(obj)


# ---------------------------------------------------------------------- bad input

# Wrong-typed values per field annotation. A new annotation fails the coverage test below.
WRONG: dict[str, list[Any]] = {
    "int": ["1", 1.5, True, None, (1,), {"a": 1}, b"\x01"],
    "int | None": ["1", 1.5, True, (1,), b"\x01"],
    "float": ["1.0", True, None, (1.0,), b"x", {"a": 1.0}],
    "float | None": ["1.0", False, (1.0,), b"x"],
    "str": [1, b"host", None, ("a",), 1.0],
    "str | None": [1, b"err", ("a",), False],
    "bytes": ["uid", 1, None, (1, 2)],
    "bool": [1, 0, "true", None, 1.0],
    "EpochPlan": [1, (1, 2, 3), "plan", None, {}, {"epoch": 1}],
    "EpochPlan | None": [1, (1, 2, 3), "plan", {}],
    "EpochMetrics": [1, (), "metrics", None, {}],
    "SaveReason": ["GracefulShutdown", 1.5, True, None, -1, 256],
    "IntentKind": ["eval_now", "CHECKPOINT_NOW", 0, None, b"EvalNow"],
    "tuple[int, ...]": [1, "1,2", ((1,),), (1.0,), (-1,), (True,), None],
    "tuple[tuple[int, tuple[tuple[int, int], ...]], ...]": [
        1,
        ((1,),),
        ((1, ((1, 2, 3),)),),
        ((1, ((1, -2),)),),
        ((1.0, ()),),
        ((1, (), 2),),
        ((1, 5),),
    ],
    "Mapping[str, tuple[float, int]]": [
        1,
        (),
        {"a": 1.0},
        {"a": (1.0,)},
        {"a": (1.0, -1)},
        {"a": (1.0, 1.5)},
        {"a": ("x", 1)},
        {b"a": (1.0, 1)},
    ],
    # EpochMetrics fields
    "Mapping[str, float]": [1.0, (), {"a": "x"}, {"a": None}, {b"a": 1.0}, {"a": True}],
    "tuple[Mapping[str, float], ...]": [{}, ({"a": "x"},), (1.0,), ({b"k": 1.0},)],
    "tuple[float, ...]": [1.0, "x", ("x",), (True,), (None,), ((1.0,),)],
    "tuple[float | None, ...]": [1.0, ("x",), (True,), ((None,),)],
    "ResourceSample | None": [1, (), "rss", {"rss_bytes": -1}, {"gpu_util_percent": "x"}],
    "tuple[ResourceSample | None, ...]": [{}, (1,), ({"rss_bytes": 1.5},), ({"x": 1},)],
}


def _typed_fields() -> list[tuple[str, tuple[str, ...], str]]:
    out = []
    for name in sorted(ALL_TYPES):
        for f in dataclasses.fields(SAMPLES[name]):
            out.append((name, (f.name,), str(f.type)))
    for f in dataclasses.fields(m.EpochMetrics):
        out.append(("EpochAggregated", ("metrics", f.name), str(f.type)))
    for f in dataclasses.fields(m.EpochPlan):
        out.append(("StartEpoch", ("plan", f.name), str(f.type)))
    return out


TYPED_FIELDS = _typed_fields()


def test_every_field_annotation_has_wrong_typed_values() -> None:
    missing = {ann for _, _, ann in TYPED_FIELDS} - set(WRONG)
    assert not missing, f"add wrong-typed values for {missing}"


@pytest.mark.parametrize(("name", "path", "ann"), TYPED_FIELDS, ids=lambda x: str(x))
def test_wrong_field_types_are_decode_errors_naming_the_field(
    name: str, path: tuple[str, ...], ann: str
) -> None:
    for bad in WRONG[ann]:
        reason = rejected(with_value(name, path, bad), channel(name))
        if not reason.startswith("body: not valid msgpack"):
            assert path[-1] in reason, (bad, reason)


def test_error_names_the_exact_nested_item() -> None:
    reason = rejected(
        with_value("EpochAggregated", ("metrics", "per_rank_throughput", 2), "x"), CONTROL
    )
    assert reason.startswith("EpochAggregated.metrics.per_rank_throughput[2]:")
    reason = rejected(with_value("StageAdvisory", ("segments", 1, 1, 0, 1), -2), CONTROL)
    assert reason.startswith("StageAdvisory.segments[1][1][0][1]:")
    reason = rejected(with_value("Metrics", ("scalars", "grad_norm", 0), "x"), UPSTREAM)
    assert reason.startswith("Metrics.scalars['grad_norm'][0]:")
    reason = rejected(with_value("EpochAggregated", ("metrics", "per_rank", 3, "k"), None))
    assert reason.startswith("EpochAggregated.metrics.per_rank[3]['k']:")


@pytest.mark.parametrize(
    "bad_type", ["Nope", "", "syncnow", "Update ", "WireUpdate", "MetricsMsg", 5, None, b"SyncNow"]
)
def test_unknown_type_name_is_a_decode_error(bad_type: Any) -> None:
    body = msgpack.packb({"v": SCHEMA_VERSION, "type": bad_type}, use_bin_type=True)
    assert "unknown message type" in rejected(body)


def test_missing_type_is_a_decode_error() -> None:
    assert "unknown message type" in rejected(msgpack.packb({"v": SCHEMA_VERSION}))


@pytest.mark.parametrize("name", sorted(ALL_TYPES))
def test_unknown_field_is_a_decode_error(name: str) -> None:
    data = sample_map(name)
    data["extra"] = 1
    assert "unknown field 'extra'" in rejected(msgpack.packb(data, use_bin_type=True))


def test_unknown_nested_field_is_a_decode_error() -> None:
    reason = rejected(with_value("StartEpoch", ("plan", "extra"), 1))
    assert "StartEpoch.plan: unknown field 'extra'" in reason
    reason = rejected(with_value("EpochAggregated", ("metrics", "per_rank_mem"), ()))
    assert "unknown field 'per_rank_mem'" in reason


@pytest.mark.parametrize("name", sorted(ALL_TYPES))
def test_each_missing_required_field_is_a_decode_error(name: str) -> None:
    required = [
        f.name
        for f in dataclasses.fields(SAMPLES[name])
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for field_name in required:
        data = sample_map(name)
        del data[field_name]
        reason = rejected(msgpack.packb(data, use_bin_type=True))
        assert f"missing field {field_name!r}" in reason


def test_missing_nested_field_is_a_decode_error() -> None:
    data = sample_map("StartEpoch")
    del data["plan"]["partition_size"]
    assert "missing field 'partition_size'" in rejected(msgpack.packb(data))
    data = sample_map("EpochAggregated")
    del data["metrics"]["avg_loss"]
    assert "missing field 'avg_loss'" in rejected(msgpack.packb(data))


@pytest.mark.parametrize("version", [0, 2, -1, 2**64 - 1, "1", 1.0, True, None, b"\x01", (1,)])
def test_wrong_schema_version_is_a_decode_error(version: Any) -> None:
    body = with_value("SyncNow", ("v",), version)
    assert "schema version" in rejected(body)


def test_missing_schema_version_is_a_decode_error() -> None:
    data = sample_map("Batch")
    del data["v"]
    assert "schema version" in rejected(msgpack.packb(data))


@pytest.mark.parametrize("name", ["DeclareDead", "Batch", "Heartbeat", "Assign", "Exiting"])
def test_negative_rank_is_a_decode_error(name: str) -> None:
    assert "out of range" in rejected(with_value(name, ("rank",), -3))


def test_nan_where_an_int_is_expected_is_a_decode_error() -> None:
    for name, path in [("Heartbeat", ("step_count",)), ("SetGlobalStep", ("global_step",))]:
        assert "expected a non-negative int" in rejected(with_value(name, path, math.nan))


def test_limits_accept_the_maximum_and_reject_one_more() -> None:
    at_str = with_value("Reject", ("reason",), "r" * wire.MAX_STR_LEN)
    assert decode_join(at_str).reason == "r" * wire.MAX_STR_LEN
    assert "max_str_len" in rejected(
        with_value("Reject", ("reason",), "r" * (wire.MAX_STR_LEN + 1))
    )

    at_bin = with_value("NewNcclIdGenerated", ("uid_bytes",), b"u" * wire.MAX_BIN_LEN)
    assert len(decode_upstream(at_bin).uid_bytes) == wire.MAX_BIN_LEN
    over_bin = with_value("NewNcclSession", ("uid_bytes",), b"u" * (wire.MAX_BIN_LEN + 1))
    assert "max_bin_len" in rejected(over_bin)

    at_arr = with_value("StageAdvisory", ("counts",), [7] * wire.MAX_ARRAY_LEN)
    assert len(decode_control(at_arr).counts) == wire.MAX_ARRAY_LEN
    over_arr = with_value("StageAdvisory", ("counts",), [7] * (wire.MAX_ARRAY_LEN + 1))
    assert "max_array_len" in rejected(over_arr)

    at_map = {f"k{i}": (1.0, 1) for i in range(wire.MAX_MAP_LEN)}
    back = decode_upstream(with_value("Metrics", ("scalars",), at_map))
    assert len(back.scalars) == wire.MAX_MAP_LEN
    over_map = {f"k{i}": 1.0 for i in range(wire.MAX_MAP_LEN + 1)}
    assert "max_map_len" in rejected(
        with_value("EpochAggregated", ("metrics", "scalars"), over_map)
    )


def test_oversized_header_is_rejected_before_allocating() -> None:
    # an array/map/str header claiming 4 billion items in a 5-byte body
    for header in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"):
        rejected(header)


def test_body_over_max_body_bytes_is_rejected_by_size() -> None:
    # 65,536 nine-byte counts and as many one-segment entries: valid structure, ~1.3 MB
    big = [RESERVED] * wire.MAX_ARRAY_LEN
    body = msgpack.packb(
        {
            "v": SCHEMA_VERSION,
            "type": "StageAdvisory",
            "counts": big,
            "segments": [[RESERVED, []]] * wire.MAX_ARRAY_LEN,
        }
    )
    assert len(body) > wire.MAX_BODY_BYTES
    assert "exceeds" in rejected(body) and str(wire.MAX_BODY_BYTES) in rejected(body)
    # the counts alone (~590 kB) are under the limit and decode
    assert len(decode_control(with_value("StageAdvisory", ("counts",), big)).counts) == len(big)


@pytest.mark.parametrize(
    "body",
    [
        b"\x91" * 100_000 + b"\xc0",  # 100k nested arrays
        b"\x81\xa1k" * 100_000 + b"\xc0",  # 100k nested maps
        msgpack.packb({"v": 1, "type": "StageAdvisory", "segments": None, "counts": None})[:-1]
        + b"\x91" * 100_000
        + b"\x00",
    ],
    ids=["arrays", "maps", "inside-a-field"],
)
def test_deep_nesting_is_a_decode_error(body: bytes) -> None:
    rejected(body)


def test_moderate_nesting_inside_a_field_is_a_decode_error() -> None:
    nested: Any = 1
    for _ in range(500):
        nested = [nested]
    rejected(with_value("StageAdvisory", ("counts",), nested))
    rejected(with_value("EpochAggregated", ("metrics", "per_rank"), nested))


@pytest.mark.parametrize(
    "value",
    [msgpack.ExtType(1, b"xy"), msgpack.Timestamp(1)],
    ids=["ext", "timestamp"],
)
def test_ext_types_are_decode_errors(value: Any) -> None:
    rejected(msgpack.packb(value))
    rejected(with_value("Hello", ("host",), value))
    rejected(with_value("EpochAggregated", ("metrics", "per_rank_throughput", 0), value))


@pytest.mark.parametrize("key", [1, -1, None, 1.5, True, b"v"])
def test_non_str_map_keys_are_decode_errors(key: Any) -> None:
    data = sample_map("Batch")
    data[key] = 1
    rejected(msgpack.packb(data, use_bin_type=True))
    rejected(with_value("Metrics", ("scalars", key), (1.0, 1)))
    rejected(with_value("EpochAggregated", ("metrics", "per_rank", 0, key), 1.0))
    rejected(with_value("StartEpoch", ("plan", key), 1))


def test_array_keys_are_decode_errors() -> None:
    # [1]: 1 as a map key; msgpack-python cannot pack it, so write the bytes
    rejected(b"\x81\x91\x01\x01")


@pytest.mark.parametrize("name", sorted(ALL_TYPES))
def test_decoding_on_the_wrong_channel_is_a_decode_error(name: str) -> None:
    body = encode(SAMPLES[name])
    for ch, dec in DECODERS.items():
        if ch == channel(name):
            continue
        with pytest.raises(DecodeError, match=f"is a {channel(name)} message, not {ch}"):
            dec(body)


def test_decode_control_on_a_batch_is_a_decode_error() -> None:
    with pytest.raises(DecodeError, match="Batch is a upstream message, not control"):
        decode_control(encode(SAMPLES["Batch"]))


@pytest.mark.parametrize(
    "body", ["text", bytearray(b"\x80"), memoryview(b"\x80"), None, 1, [b"\x80"]]
)
def test_non_bytes_input_is_a_decode_error(body: Any) -> None:
    rejected(body)


@pytest.mark.parametrize("value", [[1, 2], 1, None, "SyncNow", b"SyncNow", 1.5, True])
def test_a_body_that_is_not_a_map_is_a_decode_error(value: Any) -> None:
    assert "expected a map" in rejected(msgpack.packb(value, use_bin_type=True))


def test_invalid_utf8_and_trailing_bytes_are_decode_errors() -> None:
    good = encode(SAMPLES["Reject"])
    rejected(good + b"\xc0")
    head = msgpack.packb({"v": 1, "type": "Reject", "worker_id": "w", "reason": ""})[:-1]
    rejected(head + b"\xa2\xff\xfe")  # a 2-byte str that is not UTF-8


def test_decode_error_reason_stays_short_for_huge_offending_values() -> None:
    reason = rejected(msgpack.packb({"v": 1, "type": "T" * 60_000}))
    assert len(reason) <= wire.MAX_REASON_CHARS
    assert reason.startswith("body: unknown message type")


@pytest.mark.parametrize("name", sorted(ALL_TYPES))
def test_truncation_at_every_offset_is_a_decode_error(name: str) -> None:
    body = encode(SAMPLES[name])
    for cut in range(len(body)):
        rejected(body[:cut], channel(name))


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=512))
def test_random_bytes_give_decode_error_or_a_message(body: bytes) -> None:
    for ch in (None, CONTROL, UPSTREAM, JOIN):
        result = outcome(body, ch)
        assert isinstance(result, DecodeError) or type_name(result) in ALL_TYPES


# Arbitrary msgpack-able values, to put any shape into any field of a real type.
_any_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(
    name=st.sampled_from(sorted(ALL_TYPES)),
    overrides=st.dictionaries(
        st.sampled_from(
            [
                "rank",
                "plan",
                "metrics",
                "reason",
                "counts",
                "segments",
                "scalars",
                "kind",
                "uid_bytes",
                "error",
                "next_plan",
                "target_rank",
                "extra",
            ]
        ),
        _any_value,
        max_size=3,
    ),
)
def test_any_shape_in_any_field_gives_decode_error_or_a_message(
    name: str, overrides: dict[str, Any]
) -> None:
    data = sample_map(name)
    data.update(overrides)
    result = outcome(msgpack.packb(data, use_bin_type=True), channel(name))
    if not isinstance(result, DecodeError):
        assert type_name(result) == name
        assert same(decode(encode(result)), result)


# ---------------------------------------------------------------------- fuzz loop

_INTERESTING = bytes(
    [
        *(0x00, 0x01, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4),
        *range(0xC7, 0xE0),  # ext, float, uint/int, fixext, str/bin/array/map headers
        *(0xE0, 0xFF),
    ]
)


def _mutate(rng: random.Random, body: bytes, corpus: list[bytes]) -> bytes:
    b = bytearray(body)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(6)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:  # flip one bit
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # insert random bytes
            b[pos:pos] = rng.randbytes(rng.randint(1, 4))
        elif op == 2 and b:  # delete a range
            del b[pos : pos + rng.randint(1, 4)]
        elif op == 3:  # splice: our head, another body's tail
            other = rng.choice(corpus)
            b = b[:pos] + other[rng.randrange(len(other) + 1) :]
        elif op == 4 and b:  # overwrite with a msgpack type byte
            b[rng.randrange(len(b))] = rng.choice(_INTERESTING)
        elif op == 5 and b:  # duplicate a range
            j = rng.randrange(len(b))
            b[pos:pos] = b[j : j + rng.randint(1, 8)]
    return bytes(b)


_FIELD_NAMES = sorted(
    {f.name for msg in SAMPLES.values() for f in dataclasses.fields(msg)}
    | {f.name for f in dataclasses.fields(m.EpochMetrics)}
    | {"v", "type"}
)


def _random_value(rng: random.Random) -> Any:
    pick = rng.randrange(9)
    if pick == 0:
        return rng.choice([0, 1, -1, 255, 256, 2**63, 2**64 - 2, 2**64 - 1, -(2**63)])
    if pick == 1:
        return rng.choice([0.0, -0.0, 1.5, math.nan, math.inf, -math.inf, 1e308])
    if pick == 2:
        return rng.choice([True, False, None])
    if pick == 3:
        return rng.choice([*_FIELD_NAMES, *sorted(ALL_TYPES), "", "EvalNow", "\u00e9"])
    if pick == 4:
        return rng.randbytes(rng.randrange(4))
    if pick == 5:
        return [_random_value(rng) for _ in range(rng.randrange(3))] if rng.random() < 0.5 else []
    if pick == 6:
        return {rng.choice(_FIELD_NAMES): _random_value(rng) for _ in range(rng.randrange(3))}
    if pick == 7:
        return rng.randint(0, 2**64 - 1)
    return rng.uniform(-1e6, 1e6)


def _tree_mutate(rng: random.Random, body: bytes) -> bytes:
    """Edit one node of the unpacked body (replace, delete or add), so the mutation gets
    past the msgpack layer and exercises field validation."""
    data = thaw(msgpack.unpackb(body))
    nodes: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict | list):
            nodes.append(node)
            for child in node.values() if isinstance(node, dict) else node:
                walk(child)

    walk(data)
    node = rng.choice(nodes)
    op = rng.randrange(3)
    if isinstance(node, dict):
        if op == 0 and node:
            del node[rng.choice(list(node))]
        elif op == 1 or not node:
            node[rng.choice(_FIELD_NAMES)] = _random_value(rng)
        else:
            node[rng.choice(list(node))] = _random_value(rng)
    elif node and op < 2:
        node[rng.randrange(len(node))] = _random_value(rng)
    elif op == 2 and node:
        del node[rng.randrange(len(node))]
    else:
        node.append(_random_value(rng))
    return msgpack.packb(data, use_bin_type=True)


def test_fuzz_10000_mutations_give_decode_error_or_a_valid_message() -> None:
    corpus = [encode(msg) for msg in SAMPLES.values()]
    rng = random.Random(20260401)
    valid = past_msgpack = 0
    for case in range(10_000):
        body = rng.choice(corpus)
        # even cases edit the structure, odd cases the bytes
        body = _tree_mutate(rng, body) if case % 2 == 0 else _mutate(rng, body, corpus)
        result = outcome(body)
        if isinstance(result, DecodeError):
            assert result.reason and len(result.reason) <= wire.MAX_REASON_CHARS
            past_msgpack += not result.reason.startswith("body: not valid msgpack")
            continue
        valid += 1
        name = type_name(result)
        assert name in ALL_TYPES
        # a message that decoded is a real one: it re-encodes and comes back the same
        assert same(DECODERS[channel(name)](encode(result)), result)
    # the loop must reach validation, not just the msgpack parser, and must also produce
    # valid messages (flipped float bits, edited values), or it tests nothing
    assert past_msgpack > 3_000 and valid > 200, (past_msgpack, valid)


def test_a_hello_with_a_device_score_round_trips_and_one_before_the_field_reads_as_before() -> None:
    sent = m.Hello(worker_id="w", host="h", dataset_sig="s", device="cuda:0", device_score=884.0)
    assert decode_join(encode(sent)) == sent
    # a CPU worker's Hello leaves the field off the wire: its body is as before the field
    cpu = dataclasses.replace(sent, device="cpu", device_score=None)
    assert "device_score" not in msgpack.unpackb(encode(cpu))
    old = sample_map("Hello")
    old.pop("device_score", None)
    body = msgpack.packb(old, use_bin_type=True)
    back = decode_join(body)
    assert isinstance(back, m.Hello) and back.device_score is None
    assert encode(back) == body  # byte for byte, as a replay compares
    # the score is a float: a string there is refused, naming the field
    assert "Hello.device_score" in rejected(with_value("Hello", ("device_score",), "880"))


@pytest.mark.parametrize("msg", SAMPLES.values(), ids=list(SAMPLES))
def test_a_message_handed_to_the_ranks_bus_process_decodes_to_itself(msg: object) -> None:
    name, raw = wire.encode_local(msg)
    assert name == wire.type_name(msg)
    assert wire.decode_local(name, raw) == msg


def test_a_local_message_of_an_unknown_type_or_of_bad_bytes_is_a_decode_error() -> None:
    name, raw = wire.encode_local(
        m.Batch(rank=0, batch_ms=1.0, data_ms=0.1, step_count=1, batch_loss=0.5)
    )
    with pytest.raises(DecodeError, match="unknown message type"):
        wire.decode_local("NoSuchMessage", raw)
    with pytest.raises(DecodeError, match="Batch"):
        wire.decode_local(name, raw[:-3])
    with pytest.raises(DecodeError, match="Batch"):
        wire.decode_local(name, wire.encode_local(m.Exiting(rank=0))[1])  # fields missing
