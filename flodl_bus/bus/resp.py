"""Commands packed as RESP by hand, for the hot writers.

redis-py's ``Connection.pack_commands`` spends about 8 µs of Python on one XADD of five
fields (it checks and converts every argument); on a rank that is the publisher's
largest cost under the GIL, paid once per training step (issue 27). An XADD of the bus
has a fixed shape: ``XADD <stream> MAXLEN ~ <n> <id>`` and the entry's five fields, so
all but the id and the field values is packed once per stream (``XaddPacker``).
Arguments are bytes (or ``str``, UTF-8): RESP bulk strings carry their length, so any
byte goes through unescaped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final


def bulk(arg: bytes | str) -> bytes:
    """One RESP bulk string."""
    raw = arg.encode() if isinstance(arg, str) else arg
    return b"$%d\r\n%b\r\n" % (len(raw), raw)


def command(*args: bytes | str) -> bytes:
    """One command as RESP: an array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(bulk(a) for a in args)


class XaddPacker:
    """``XADD stream MAXLEN ~ maxlen id k1 v1 ... kn vn`` for entries whose field names
    are ``fields``, in that order, every time (``entries.sign``'s order)."""

    def __init__(self, stream: str, maxlen: int, fields: tuple[bytes, ...]) -> None:
        self.fields = fields
        argc = 6 + 2 * len(fields)
        self._head: Final = b"*%d\r\n" % argc + b"".join(
            bulk(a) for a in ("XADD", stream, "MAXLEN", "~", str(maxlen))
        )
        self._names: Final = tuple(bulk(f) for f in fields)

    def pack(self, entry_id: str, values: Mapping[bytes, bytes]) -> bytes:
        if len(values) != len(self.fields):  # a missing one raises KeyError below
            raise ValueError(f"entry fields {sorted(values)} are not {sorted(self.fields)}")
        parts = [self._head, bulk(entry_id)]
        for name, key in zip(self._names, self.fields, strict=True):
            v = values[key]
            parts += (name, b"$%d\r\n%b\r\n" % (len(v), v))
        return b"".join(parts)
