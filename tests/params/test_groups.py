"""Re-session after a death: real rank processes, one killed or frozen mid-run.

The test plays the coordinator: it sends the survivors ``NewNcclSession`` (and, for a
frozen peer, the ``DeclareDead`` abort) through the control list each rank listens on.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from flodl_bus.params.groups import new_session_uid
from tests.params.conftest import Launch
from tests.params.procs import Ranks

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ROUNDS = 6
COLLECTIVE_TIMEOUT = 10.0
MAILBOX_CAP = 20.0


def wait_for_progress(ranks: Ranks, rounds: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while min(ranks.progress(r) for r in range(len(ranks.procs))) < rounds:
        assert time.monotonic() < deadline, "ranks made no progress"
        time.sleep(0.05)


def resession_survivors(ranks: Ranks, survivors: list[int]) -> str:
    uid = new_session_uid().hex()
    for new_rank, rank in enumerate(survivors):
        ranks.control(rank, {"op": "session", "uid": uid, "rank": new_rank, "world": 2})
    return uid


def check_survivors_finished(results: list[Any], uid: str) -> None:
    r0, r2 = results
    for new_rank, r in enumerate((r0, r2)):
        assert r["error"] is None
        assert len(r["durations"]) == ROUNDS
        assert r["worlds"][0][1] == 3
        # new prefix (the uid), new dense ranks, a world of two
        assert r["worlds"][-1][:2] == [new_rank, 2]
        assert r["worlds"][-1][2].endswith(f":store:{uid}/")
        assert uid not in r["worlds"][0][2]
        # no wait longer than its bound: a stalled round ends within the mailbox cap
        assert max(r["durations"]) < MAILBOX_CAP
    # last round: rank 0 had 1*ROUNDS, rank 2 had 3*ROUNDS; the dead rank has no say
    assert r0["final"]["w"] == r2["final"]["w"] == [2.0 * ROUNDS] * 3


@pytest.mark.parametrize("backend", ["nccl", "cpu"])
def test_survivors_of_a_killed_rank_reform_with_new_ranks_and_finish(
    launch: Launch, backend: str
) -> None:
    ranks = launch(
        "rounds",
        3,
        {
            "rounds": ROUNDS,
            "pause": 0.3,
            "backend": backend,
            "timeout": COLLECTIVE_TIMEOUT,
            "mailbox_cap": MAILBOX_CAP,
        },
    )
    wait_for_progress(ranks, 2)
    ranks.procs[1].kill()
    time.sleep(0.5)  # the survivors find the group broken and wait for a session
    uid = resession_survivors(ranks, [0, 2])
    check_survivors_finished([ranks.result(0), ranks.result(2)], uid)


def test_abort_releases_survivors_parked_on_a_frozen_peer_before_the_group_timeout(
    launch: Launch,
) -> None:
    ranks = launch(
        "rounds",
        3,
        {
            "rounds": ROUNDS,
            "pause": 0.3,
            "timeout": COLLECTIVE_TIMEOUT,
            "mailbox_cap": MAILBOX_CAP,
            "fast_exit": True,
        },
    )
    wait_for_progress(ranks, 2)
    os.kill(ranks.procs[1].pid, signal.SIGSTOP)  # alive, sockets open, never answers
    try:
        time.sleep(1.0)  # survivors enter the next collective and park there
        for rank in (0, 2):
            ranks.control(rank, {"op": "abort"})
        uid = resession_survivors(ranks, [0, 2])
        results = [ranks.result(0), ranks.result(2)]
    finally:
        ranks.procs[1].kill()
    check_survivors_finished(results, uid)
    for r in results:
        # gloo alone would have held them for the whole collective timeout
        assert max(r["durations"]) < COLLECTIVE_TIMEOUT - 2.0


@pytest.mark.parametrize("backend", ["nccl", "cpu"])
def test_without_a_new_session_a_survivor_gives_up_within_the_mailbox_cap(
    launch: Launch, backend: str
) -> None:
    cap = 1.5
    ranks = launch(
        "rounds",
        2,
        {"rounds": 50, "pause": 0.2, "backend": backend, "timeout": 5.0, "mailbox_cap": cap},
    )
    wait_for_progress(ranks, 1)
    ranks.procs[1].kill()
    r0 = ranks.result(0)
    assert r0["error"] is not None
    # nccl: sync_now raises; cpu: the plane injects Shutdown instead of an Update
    expected = "SessionTimeout" if backend == "nccl" else "RuntimeError"
    assert r0["error"]["type"] == expected
    assert cap <= r0["error"]["after_s"] < cap + 5.0
