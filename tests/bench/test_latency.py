"""Ranks behind a network delay, and a partitioned rank handled like a death.

Real namespaces and veth links made by the test (``bench.netns``; 127.0.x.y addresses
that exist only inside them), the real coordinator and bus, simulated ranks. Skipped,
with the reason, where the machine cannot make namespaces. The RTT sweep and packet
loss are ``flodl-bus bench latency``; this is its smallest case.
"""

from __future__ import annotations

import math
import subprocess

import pytest

from flodl_bus.bench.latency import run_case
from flodl_bus.bench.netns import Topology, netns_problem

_WHY = netns_problem()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"needs network namespaces: {_WHY}")


def test_a_topology_leaves_nothing_behind() -> None:
    with Topology(2, delay_ms=2.0, netem=False) as topo:
        names = [topo.srv, *topo.ranks]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(n in listed for n in names)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)


def test_ranks_behind_2ms_rtt_train_and_a_cut_off_rank_is_declared_dead() -> None:
    hb = 3.0
    r = run_case(
        2.0,
        ranks=3,
        groups=3,
        partition=True,
        step_ms=20.0,
        steps=6,
        epochs=3,
        heartbeat_timeout=hb,
        timeout=120.0,
    )
    # every control entry crossed the link from Redis to a rank once: at least the
    # one-way delay (the delay is in effect)
    assert r["dispatch_p50_ms"] >= 1.0
    # the cut rank (the last, alone in its namespace) is declared dead, from silence
    assert r["declared_dead"] == 1
    dead_after = r["dead_after_cut_s"]
    assert dead_after is not None and math.isfinite(dead_after)
    # only silence declares it: not at the cut (its last word may precede the cut by a
    # heartbeat interval, more on a loaded machine)
    assert dead_after >= hb / 2
    print(f"declared dead {dead_after:.2f} s after the cut (heartbeat timeout {hb} s)")
    # handled like a death: the survivors finish every epoch on the coordinator's word,
    # its forfeited work re-served to them
    assert r["ranks_clean"] == 2
    assert r["steps_done"] >= 3 * 6 * 3
    assert math.isfinite(r["epoch_s"])
