"""Messages, their wire form, and entry signing."""

from flodl_bus.protocol.messages import *  # noqa: F403
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

__all__ = [
    "CONTROL",
    "CONTROL_TYPES",
    "JOIN",
    "JOIN_TYPES",
    "SCHEMA_VERSION",
    "UPSTREAM",
    "UPSTREAM_TYPES",
    "DecodeError",
    "decode",
    "decode_control",
    "decode_join",
    "decode_upstream",
    "encode",
    "from_map",
    "to_map",
    "type_name",
]
