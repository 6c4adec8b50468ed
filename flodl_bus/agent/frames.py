"""Frames between a host agent and its ranks: length-prefixed msgpack maps on a Unix
socket (local only: a path on the host's file system, never a network address).

Rank -> agent: ``hello`` (its rank and where it has read each control stream), ``up``
(signed upstream items, numbered ``n`` per connection), ``dlq`` (an entry the rank
refused, for the run's dlq). Agent -> rank: ``ctl`` (raw control entries, in id order),
``upack`` (every ``up`` frame up to ``n`` is in Redis).
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import Any, Final

import msgspec

_LEN: Final = struct.Struct(">I")
#: a frame of control entries or of one publisher batch; far above what either holds
MAX_FRAME: Final = 64 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class FrameError(ConnectionError):
    pass


def pack(obj: dict[str, Any]) -> bytes:
    body = _encoder.encode(obj)
    if len(body) > MAX_FRAME:
        raise FrameError(f"frame of {len(body)} bytes > {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def send(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(pack(obj))


class FrameReader:
    """Whole frames from a stream socket: ``read`` blocks, ``read_by`` waits up to a
    deadline; EOF or a bad frame raises ``FrameError``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        # A poll, not a select: a process's descriptors may number past select's 1024.
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def whole(self) -> bool:
        """Whether a whole frame is buffered already (``read`` will not touch the socket)."""
        if len(self.buf) < _LEN.size:
            return False
        size: int = _LEN.unpack_from(self.buf)[0]
        return len(self.buf) >= _LEN.size + size

    def waiting(self) -> bool:
        """Whether a frame, or part of one, can be read now without waiting."""
        return self.whole() or bool(self._poll.poll(0))

    def read_by(self, deadline: float) -> dict[str, Any] | None:
        """The next frame, or None at ``deadline`` (``time.monotonic``); past it, one
        look without waiting. A frame cut short by the deadline stays for the next call."""
        while not self.whole():
            left = max(deadline - time.monotonic(), 0.0)
            if not self._poll.poll(left * 1000.0):
                return None
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise FrameError("peer closed the socket")
            self.buf += chunk
        return self.read()

    def _fill(self, n: int) -> None:
        while len(self.buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buf)))
            if not chunk:
                raise FrameError("peer closed the socket")
            self.buf += chunk

    def read(self) -> dict[str, Any]:
        self._fill(_LEN.size)
        (size,) = _LEN.unpack_from(self.buf)
        if size > MAX_FRAME:
            raise FrameError(f"frame of {size} bytes > {MAX_FRAME}")
        self._fill(_LEN.size + size)
        body = bytes(self.buf[_LEN.size : _LEN.size + size])
        del self.buf[: _LEN.size + size]
        try:
            obj = _decoder.decode(body)
        except (msgspec.DecodeError, ValueError) as exc:
            raise FrameError(f"undecodable frame: {exc}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
            raise FrameError("a frame must be a map with an 'op'")
        return obj
