"""``wire.decode_validated``: for a body another process already decoded and validated
(the coordinator's ingest readers), it builds exactly the message ``decode`` builds."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_bus.protocol import wire
from tests.protocol.strategies import STRATEGIES, same

UPSTREAM = sorted(n for n in STRATEGIES if wire.channel_of(n) == wire.UPSTREAM)


def test_every_upstream_type_is_covered_and_the_hot_ones_skip_the_check() -> None:
    assert {"Batch", "LrUpdate", "Heartbeat", "Metrics", "Exiting"} <= set(UPSTREAM)
    assert {"Batch", "LrUpdate", "Heartbeat"} <= set(wire._FAST)


@pytest.mark.parametrize("name", UPSTREAM)
@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_validated_body_builds_the_message_decode_builds(name: str, data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[name])
    body = wire.encode(msg)
    full = wire.decode(body, wire.UPSTREAM, name)
    got = wire.decode_validated(body, wire.UPSTREAM, name)
    assert type(got) is type(full) and same(got, msg) and same(full, msg)
