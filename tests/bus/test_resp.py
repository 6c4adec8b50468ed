"""Hand-packed RESP (``bus.resp``) says to Redis exactly what redis-py's packing says."""

from __future__ import annotations

import pytest
import redis

from flodl_bus.bus.resp import XaddPacker, command

FIELDS = (b"type", b"rank", b"seq", b"body", b"mac")


def _redis_py(*args: object) -> bytes:
    return b"".join(redis.Connection().pack_commands([args]))


def test_a_command_packs_as_redis_py_packs_it() -> None:
    assert command("WATCH", "flodl:{run}:up:0") == _redis_py("WATCH", "flodl:{run}:up:0")
    assert command("MULTI") == _redis_py("MULTI")


def test_an_xadd_packs_any_bytes_as_redis_py_does_in_the_fields_order() -> None:
    values = {
        b"mac": bytes(range(256)) * 3,  # every byte, \r\n included, past one buffer
        b"body": b"\r\n$5\r\n*1\r\n",
        b"seq": b"17",
        b"rank": b"0",
        b"type": "Été".encode(),
    }
    packer = XaddPacker("flodl:{r}:up:0", 100_000, FIELDS)
    flat: list[object] = ["XADD", "flodl:{r}:up:0", "MAXLEN", "~", "100000", "5-1"]
    for k in FIELDS:
        flat += (k, values[k])
    assert packer.pack("5-1", values) == _redis_py(*flat)


def test_an_entry_with_a_field_missing_or_extra_is_refused_not_packed_short() -> None:
    packer = XaddPacker("s", 10, FIELDS)
    values = dict.fromkeys(FIELDS, b"x")
    with pytest.raises(ValueError):
        packer.pack("1-1", {**values, b"junk": b"y"})
    with pytest.raises(KeyError):
        packer.pack("1-1", {**{k: v for k, v in values.items() if k != b"mac"}, b"junk": b"y"})


def test_what_is_packed_by_hand_runs_on_a_real_server(redis_url: str) -> None:
    from flodl_bus.bus.connection import connect

    client = connect(redis_url)
    try:
        client.delete("resp-s")
        conn = client.connection_pool.make_connection()
        packer = XaddPacker("resp-s", 1000, FIELDS)
        values = dict.fromkeys(FIELDS, b"\r\n\x00")
        conn.send_packed_command([command("MULTI") + packer.pack("7-1", values) + command("EXEC")])
        assert conn.read_response() == b"OK"
        assert conn.read_response() == b"QUEUED"
        assert conn.read_response() == [b"7-1"]
        conn.disconnect()
        assert client.xrange("resp-s") == [(b"7-1", values)]
    finally:
        client.close()
