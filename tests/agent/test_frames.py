"""Frames on a local stream socket (``flodl_bus.agent.frames``): a frame arrives whole
however the socket cuts it, a wait for one ends at its deadline keeping what came, and
a closed peer is an error, never a frame."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from flodl_bus.agent import frames


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, frames.FrameReader]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        yield a, frames.FrameReader(b)
    finally:
        a.close()
        b.close()


def test_a_frame_cut_by_a_deadline_is_kept_and_read_whole_later(
    pair: tuple[socket.socket, frames.FrameReader],
) -> None:
    writer, reader = pair
    data = frames.pack({"op": "m", "b": b"x" * 1000})
    assert reader.read_by(time.monotonic()) is None and not reader.waiting()
    writer.sendall(data[:7])
    assert reader.waiting()
    assert reader.read_by(time.monotonic()) is None  # part of it: the deadline wins
    assert not reader.whole() and len(reader.buf) == 7
    writer.sendall(data[7:] + frames.pack({"op": "c"}))
    assert reader.read_by(time.monotonic() + 10) == {"op": "m", "b": b"x" * 1000}
    assert reader.whole()  # the next one came in the same read
    assert reader.read_by(time.monotonic()) == {"op": "c"}
    assert not reader.waiting()


def test_a_closed_peer_is_an_error_not_a_frame(
    pair: tuple[socket.socket, frames.FrameReader],
) -> None:
    writer, reader = pair
    writer.sendall(frames.pack({"op": "m"})[:3])
    writer.close()
    with pytest.raises(frames.FrameError, match="peer closed"):
        reader.read_by(time.monotonic() + 10)
