"""The C fast path of ``wire.decode`` (``expect=`` a type name): it accepts exactly what
the full decoder accepts and builds exactly the same message, or it steps aside."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import Batch, LrUpdate
from flodl_bus.protocol.wire import _FAST, DecodeError, decode, to_map
from tests.protocol.strategies import STRATEGIES, same

FAST = sorted(_FAST)


def both(body: bytes, name: str) -> tuple[Any, Any]:
    """(full decoder's outcome, fast path's outcome): a message or the reason."""
    ch = wire.channel_of(name)
    out = []
    for expect in (None, name):
        try:
            out.append(decode(body, ch, expect))
        except DecodeError as exc:
            out.append(exc.reason)
    return out[0], out[1]


def test_the_hot_upstream_and_control_messages_take_the_fast_path() -> None:
    assert {"Batch", "LrUpdate", "SyncAck", "Heartbeat", "SetGlobalStep"} <= set(FAST)
    # composite fields (plans, enums, bytes, strings) keep the full decoder only; Exiting
    # carries its reason as a string (once per rank: never hot)
    assert not {"StartEpoch", "Metrics", "NewNcclIdGenerated", "Intent", "Exiting"} & set(FAST)


@pytest.mark.parametrize("name", FAST)
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_valid_bodies_build_the_same_message_with_the_same_types(
    name: str, data: st.DataObject
) -> None:
    msg = data.draw(STRATEGIES[name])
    full, fast = both(wire.encode(msg), name)
    assert same(full, msg) and same(fast, msg)


#: values a forger or a bug could put in any field
ODD_VALUES = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(-9, 9), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(-9, 9), max_size=2),
)


@pytest.mark.parametrize("name", FAST)
@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mangled_maps_get_the_same_verdict_from_both_paths(name: str, data: st.DataObject) -> None:
    body_map: dict[Any, Any] = to_map(data.draw(STRATEGIES[name]))
    keys = list(body_map)
    for _ in range(data.draw(st.integers(1, 3))):
        action = data.draw(st.sampled_from(["set", "drop", "add"]))
        if action == "set":
            body_map[data.draw(st.sampled_from(keys))] = data.draw(ODD_VALUES)
        elif action == "drop":
            body_map.pop(data.draw(st.sampled_from(keys)), None)
        else:
            body_map[data.draw(st.one_of(st.text(max_size=6), st.integers(-9, 9)))] = data.draw(
                ODD_VALUES
            )
    body = msgpack.packb(body_map, use_bin_type=True, strict_types=False)
    full, fast = both(body, name)
    assert same(full, fast) if not isinstance(full, str) else full == fast


@pytest.mark.parametrize("name", FAST)
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupted_bytes_get_the_same_verdict_from_both_paths(
    name: str, data: st.DataObject
) -> None:
    body = bytearray(wire.encode(data.draw(STRATEGIES[name])))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        body += data.draw(st.binary(min_size=1, max_size=4))  # trailing bytes
    full, fast = both(bytes(body), name)
    assert same(full, fast) if not isinstance(full, str) else full == fast


# Fixed messages for the hand-built bodies below (the generated cases are above).
_BATCH = Batch(rank=1, batch_ms=12.5, data_ms=0.25, step_count=7, batch_loss=0.75)
_LR = LrUpdate(rank=0, lr=0.01)


def test_a_duplicated_key_takes_the_last_value_on_both_paths() -> None:
    fields = to_map(_BATCH)
    packed = msgpack.packb(fields, use_bin_type=True)
    # one more key than the map header says it has, then the header raised by one
    body = bytes([packed[0] + 1]) + packed[1:] + msgpack.packb("rank") + msgpack.packb(5)
    full, fast = both(body, "Batch")
    assert full.rank == fast.rank == 5
    assert same(full, fast)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rank", True),  # a bool is not an int
        ("rank", -1),
        ("rank", 3.0),  # a float is not an int, however integral
        ("batch_ms", False),  # nor a float
        ("v", True),  # schema version 1 is the int 1
        ("type", b"Batch"),  # the type name is a string
    ],
)
def test_lookalike_values_are_refused_by_both_paths(field: str, value: Any) -> None:
    fields = to_map(_BATCH)
    fields[field] = value
    full, fast = both(msgpack.packb(fields, use_bin_type=True), "Batch")
    assert isinstance(full, str) and full == fast


def test_an_int_in_a_float_field_comes_back_a_float_on_the_fast_path() -> None:
    fields = to_map(_LR)
    fields["lr"] = 3
    _, fast = both(msgpack.packb(fields), "LrUpdate")
    assert type(fast.lr) is float and fast.lr == 3.0


def test_a_float32_in_a_float_field_is_the_same_on_both_paths() -> None:
    fields = to_map(_LR)
    packed = msgpack.packb({k: v for k, v in fields.items() if k != "lr"})
    body = bytes([packed[0] + 1]) + packed[1:] + msgpack.packb("lr") + b"\xca"
    body += struct.pack(">f", 0.1)
    full, fast = both(body, "LrUpdate")
    assert same(full, fast)
