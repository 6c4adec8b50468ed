"""A ``Lane`` says to Redis what the client would say, and keeps its connection in step."""

from __future__ import annotations

import pytest
import redis

from flodl_bus.bus import lane as lane_mod
from flodl_bus.bus.connection import connect
from flodl_bus.bus.lane import Lane
from flodl_bus.bus.resp import command

#: every byte, CRLF and a RESP header among them, past one read buffer
AWKWARD = bytes(range(256)) * 300 + b"\r\n$5\r\n*1\r\n"


def _redis_py(*args: object) -> bytes:
    return b"".join(redis.Connection().pack_commands([args]))


@pytest.mark.parametrize(
    "args",
    [
        ("PING",),
        ("XADD", "flodl:{r}:ctl:3", "MAXLEN", "~", 100_000, "*", b"body", AWKWARD),
        ("XREAD", "COUNT", 64, "BLOCK", 500, "STREAMS", "Été", "0-0"),
        ("SET", "k", -17),
    ],
)
def test_a_lane_packs_a_command_as_redis_py_packs_it(args: tuple[object, ...]) -> None:
    assert lane_mod.pack(args) == _redis_py(*args)


def test_a_lane_gives_the_raw_reply_the_client_stores_for_any_bytes(redis_url: str) -> None:
    client = connect(redis_url)
    path = Lane(client)
    try:
        client.delete("lane-s")
        eid = path.call("XADD", "lane-s", "MAXLEN", "~", 1000, "*", b"v", AWKWARD, "n", 7)
        assert client.xrange("lane-s") == [(eid, {b"v": AWKWARD, b"n": b"7"})]
        packed = command("XRANGE", "lane-s", "-", "+")
        assert path.call_packed(packed) == [[eid, [b"v", AWKWARD, b"n", b"7"]]]
        assert path.call("PING") == b"PONG"
    finally:
        path.close()
        client.close()


def test_an_error_reply_raises_and_the_next_call_gets_its_own_reply(redis_url: str) -> None:
    client = connect(redis_url)
    path = Lane(client)
    try:
        client.set("lane-str", "x")
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            path.call("XADD", "lane-str", "*", "a", "b")
        assert path.call("GET", "lane-str") == b"x"  # not the error's reply, in step
    finally:
        path.close()
        client.close()


def test_a_killed_connection_raises_once_and_the_next_call_connects_again(
    redis_url: str,
) -> None:
    client = connect(redis_url)
    admin = connect(redis_url)
    path = Lane(client)
    try:
        path.call("CLIENT", "SETNAME", "lane-victim")
        assert path.call("PING") == b"PONG"
        admin.client_kill_filter(_type="normal", skipme=True)
        with pytest.raises(redis.exceptions.ConnectionError):
            path.call("PING")
        assert path.call("ECHO", b"back") == b"back"
    finally:
        path.close()
        client.close()
        admin.close()


def test_many_commands_answer_in_order_and_an_error_among_them_keeps_the_lane_in_step(
    redis_url: str,
) -> None:
    client = connect(redis_url)
    path = Lane(client)
    try:
        client.set("lane-str", "x")
        cmds = [lane_mod.pack(("ECHO", b"a")), lane_mod.pack(("ECHO", b"b"))]
        assert path.call_many(cmds) == [b"a", b"b"]
        wrong = lane_mod.pack(("XADD", "lane-str", "*", "k", "v"))
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            path.call_many([cmds[0], wrong, wrong, cmds[1]])
        # every reply of the failed batch was read: the next one gets its own
        assert path.call_many([lane_mod.pack(("ECHO", b"c"))]) == [b"c"]
        assert client.get("lane-str") == b"x"
    finally:
        path.close()
        client.close()
