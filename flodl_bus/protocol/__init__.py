"""The protocol: messages, their wire form (``wire``, the only codec), entry signing,
and the leaving rules of a rank.

Pure data and pure functions: no IO, no clock, no torch. Imports nothing of ours outside
this package; every plane above imports it.
"""

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
