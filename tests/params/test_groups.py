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
    uid = os.urandom(16).hex()
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


# --------------------------------------------------------------- one process, world of one


def _manager(redis_url: str, cap: float = 0.3) -> Any:
    from flodl_bus.params.forming import store_base
    from flodl_bus.params.groups import SessionManager

    run = f"solo-{os.urandom(16).hex()[:8]}"
    return SessionManager(redis_url, store_base(run), 0, 1, timeout=5.0, mailbox_cap=cap)


def test_abort_without_a_group_is_a_no_op_and_idempotent(redis_url: str) -> None:
    manager = _manager(redis_url)
    try:
        manager.abort()
        manager.abort()
        assert manager.group is None
        group = manager.connect()  # the initial session still forms
        assert group.world_size == 1
    finally:
        manager.close()


def test_an_aborted_group_is_not_reused_and_the_wait_for_a_new_one_is_bounded(
    redis_url: str,
) -> None:
    import torch

    from flodl_bus.params.groups import SessionTimeout

    manager = _manager(redis_url, cap=0.3)
    try:
        assert manager.run(lambda g: g.world_size) == 1
        manager.abort()
        manager.abort()
        started = time.monotonic()
        with pytest.raises(SessionTimeout):
            manager.run(lambda g: g.all_reduce_sum_([torch.ones(1)], 5.0))
        assert 0.3 <= time.monotonic() - started < 15.0  # bounded, not fast
    finally:
        manager.close()


def test_an_offered_session_replaces_the_group_under_its_uid_prefix(redis_url: str) -> None:
    import torch

    from flodl_bus.params.groups import SessionSpec

    manager = _manager(redis_url)
    try:
        first = manager.connect()
        uid = os.urandom(16)
        manager.offer(SessionSpec(uid, 0, 1))
        assert first.aborted  # the old group is given up at once

        def reduce(group: Any) -> Any:
            t = torch.full((2,), 3.0)
            group.all_reduce_sum_([t], 5.0)
            return group.prefix, t.tolist()

        prefix, values = manager.run(reduce)
        assert prefix.endswith(f":store:{uid.hex()}/")
        assert values == [3.0, 3.0]
        assert manager.sessions_formed == 2
    finally:
        manager.close()
    with pytest.raises(RuntimeError):
        manager.connect()


def _pair(redis_url: str, *, timeout: float, cap: float) -> list[Any]:
    from flodl_bus.params.forming import store_base
    from flodl_bus.params.groups import SessionManager

    base = store_base(f"pair-{os.urandom(16).hex()[:8]}")
    return [SessionManager(redis_url, base, r, 2, timeout=timeout, mailbox_cap=cap) for r in (0, 1)]


def _both(*calls: Any, wait: float = 60.0) -> list[Any]:
    """Run each call on a thread of its own (a rank each); their results or errors."""
    import threading

    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as exc:  # the failing case is a result here
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait)
    return out


@pytest.mark.parametrize("eager", [True, False])
def test_a_survivor_not_in_a_collective_forms_the_new_session_when_offered(
    redis_url: str, eager: bool
) -> None:
    """The interleaving behind a survivor lost to another rank's death: survivor A's
    collective broke and it forms the offered session at once; survivor B was between
    rounds and reaches its next collective only after the group timeout. B must form the
    session when it is offered (the cpu plane's ``offer(form=True)``), or A gives the
    session up after the timeout and waits for one the coordinator never sends."""
    import time as _time

    import torch

    from flodl_bus.params.groups import SessionSpec, SessionTimeout

    formation = 2.0
    a, b = _pair(redis_url, timeout=formation, cap=2.0)
    try:

        def reduce(m: Any) -> Any:
            return m.run(lambda g: g.all_reduce_sum_([t := torch.ones(2)], 10.0) or t.tolist())

        assert _both(lambda: reduce(a), lambda: reduce(b)) == [[2.0, 2.0]] * 2
        uid = os.urandom(16)

        def survivor_a() -> Any:  # its collective broke: it needs the group now
            a.offer(SessionSpec(uid, 0, 2), form=eager)
            return a.run(lambda g: g.world_size)

        def survivor_b() -> Any:  # between rounds: nothing asks for its group yet
            b.offer(SessionSpec(uid, 1, 2), form=eager)  # the control thread's delivery
            _time.sleep(formation + 1.0)
            return "trained on"

        got_a, got_b = _both(survivor_a, survivor_b)
        if eager:
            assert (got_a, got_b) == (2, "trained on")
            assert a.spec.uid == b.spec.uid == uid
            # and the new group averages: B's next round finds it formed
            assert _both(lambda: reduce(a), lambda: reduce(b)) == [[2.0, 2.0]] * 2
        else:  # what lost a survivor before: A gave the session up, then timed out
            assert isinstance(got_a, SessionTimeout), got_a
    finally:
        a.close()
        b.close()


def _broken_then(reduce_op: Any) -> Any:
    """An op whose first run breaks (its group lost a peer mid-collective) and whose
    runs after that are ``reduce_op``: the retry in the new session."""
    from flodl_bus.params.groups import CollectiveFailed

    runs = [0]

    def op(group: Any) -> Any:
        runs[0] += 1
        if runs[0] == 1:
            raise CollectiveFailed("peer lost mid-collective")
        return reduce_op(group)

    return op


def _sum_of_ones(group: Any) -> Any:
    import torch

    t = torch.ones(2)
    group.all_reduce_sum_([t], 10.0)
    return t.tolist()


def _round_then_a(a: Any, b: Any, peer_finished: bool, broken: Any) -> Any:
    """One round on both, then survivor A's part in the next: completed before the group
    broke (one op ahead, between rounds), or an op that breaks as B's does (``broken``
    makes it) and is retried."""
    assert _both(lambda: a.run(_sum_of_ones), lambda: b.run(_sum_of_ones)) == [[2.0] * 2] * 2
    if peer_finished:
        assert a.run(lambda g: "done") == "done"
        return lambda: "between rounds"
    op = broken()
    return lambda: a.run(op)


def _assert_told(a: Any, b: Any, got: list[Any], peer_finished: bool, uid: bytes) -> None:
    """B's retry: kept local where A had finished the round (before the fix B waited for
    A, then for a session nobody sends: SessionTimeout), realized over both where it
    broke on both; either way the next round averages over both in the offered session."""
    from flodl_bus.params.groups import RoundSplit

    if peer_finished:
        assert isinstance(got[1], RoundSplit), got
        assert (a.rounds_split, b.rounds_split) == (0, 1)
    else:
        assert got[:2] == [[2.0] * 2] * 2, got
        assert (a.rounds_split, b.rounds_split) == (0, 0)
    assert _both(lambda: a.run(_sum_of_ones), lambda: b.run(_sum_of_ones)) == [[2.0] * 2] * 2
    assert a.spec.uid == b.spec.uid == uid


@pytest.mark.parametrize("eager", [True, False], ids=["formed-at-once", "formed-at-next-op"])
@pytest.mark.parametrize("peer_finished", [True, False])
def test_a_retried_round_that_completed_on_a_peer_is_kept_local_not_waited_for(
    redis_url: str, peer_finished: bool, eager: bool
) -> None:
    """A peer died inside a round's collective: it completed on survivor A and broke on
    survivor B (gloo's ring handed A the dead peer's last chunk). A moved on and never
    runs that round again, so B's retry in the new session waited for A until the group
    timeout, then for a session nobody sends, and B left the run (CI saw it). B must
    see from A's announced count that the round completed there and keep its own state
    for it; where the round broke on both, both retry it and it is realized. The cpu
    planes form an offered session at once; the nccl planes (gloo's too, on a CPU) at
    their next op, so B must not form it alone while A, done with the round, does not."""
    from flodl_bus.params.groups import SessionSpec

    a, b = _pair(redis_url, timeout=3.0, cap=3.0)
    try:
        survivor_a = _round_then_a(a, b, peer_finished, lambda: _broken_then(_sum_of_ones))
        uid = os.urandom(16)
        got = _both(
            survivor_a,
            lambda: b.run(_broken_then(_sum_of_ones)),
            # the control threads' deliveries of NewNcclSession
            lambda: a.offer(SessionSpec(uid, 0, 2), form=eager),
            lambda: b.offer(SessionSpec(uid, 1, 2), form=eager),
        )
        _assert_told(a, b, got, peer_finished, uid)
    finally:
        a.close()
        b.close()


def test_an_op_that_succeeds_after_a_new_session_was_offered_runs_again_there(
    redis_url: str,
) -> None:
    """The offer announced how many ops this rank completed before the new session; an
    op that returns after that announcement must not count, or a peer reading it would
    take a round the announcement left out for one completed here alone."""
    from flodl_bus.params.groups import SessionSpec

    manager = _manager(redis_url)
    uid = os.urandom(16)
    runs: list[bytes] = []

    def op(group: Any) -> str:
        runs.append(group.spec.uid)
        if len(runs) == 1:
            manager.offer(SessionSpec(uid, 0, 1))  # delivered while the op ran
        return f"run {len(runs)}"

    try:
        assert manager.run(op) == "run 2"
        assert runs[1] == uid  # the second run was in the offered session
        assert manager.rounds_split == 0
    finally:
        manager.close()


@pytest.mark.parametrize("peer_finished", [True, False])
def test_a_retry_on_a_session_the_control_thread_already_formed_still_tells_a_split(
    redis_url: str, peer_finished: bool
) -> None:
    """The other interleaving of a split round: the collective still hangs when the new
    session is offered (a frozen peer, gloo not yet told), so the control thread forms
    the session first and the failing op finds it formed. Its retry is that session's
    first op and must be told the split as well, not run alone on it."""
    import threading

    from flodl_bus.params.groups import CollectiveFailed, SessionSpec

    a, b = _pair(redis_url, timeout=3.0, cap=3.0)
    offered = threading.Event()

    def hangs_then_breaks(group: Any) -> Any:
        assert offered.wait(30)  # released (broken) only once the session is formed
        raise CollectiveFailed("peer lost mid-collective")

    def broken_until_formed() -> Any:
        runs = [0]

        def op(group: Any) -> Any:
            runs[0] += 1
            return hangs_then_breaks(group) if runs[0] == 1 else _sum_of_ones(group)

        return op

    try:
        survivor_a = _round_then_a(a, b, peer_finished, broken_until_formed)
        uid = os.urandom(16)
        op_b = broken_until_formed()

        def deliver() -> str:
            # the control threads: each offer formed at once, as the cpu planes do
            _both(
                lambda: a.offer(SessionSpec(uid, 0, 2), form=True),
                lambda: b.offer(SessionSpec(uid, 1, 2), form=True),
            )
            offered.set()
            return "formed"

        got = _both(survivor_a, lambda: b.run(op_b), deliver)
        assert got[2] == "formed"
        _assert_told(a, b, got, peer_finished, uid)
    finally:
        offered.set()
        a.close()
        b.close()


def test_a_retry_waiting_on_announcements_moves_to_a_newer_session_at_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member of the offered session died before it announced (a second death): the
    coordinator offers a newer session, and the survivor waiting on the first one's
    announcements moves to it at once, instead of waiting out the group timeout there
    and then again in forming a session a member of which is dead. (The announcement
    wait is made as long as the group timeout here: the formation that follows it gives
    up for the newer session too, so a shorter wait would hide a wait that never looks.)"""
    import threading

    from flodl_bus.params import groups
    from flodl_bus.params.groups import SessionSpec

    monkeypatch.setattr(groups, "ANNOUNCE_WAIT_S", 30.0)
    a, b = _pair(redis_url, timeout=30.0, cap=30.0)
    try:
        assert _both(lambda: a.run(_sum_of_ones), lambda: b.run(_sum_of_ones)) == [[2.0] * 2] * 2
        got: list[Any] = []
        retry = threading.Thread(
            target=lambda: got.append(b.run(_broken_then(_sum_of_ones))), daemon=True
        )
        retry.start()
        b.offer(SessionSpec(os.urandom(16), 1, 2))  # A never announces into it: dead
        # B took it (its retry reads the announcements now)...
        assert _wait_until(lambda: b._pending is None)
        # ...and the coordinator re-forms without A: B alone.
        newer = os.urandom(16)
        b.offer(SessionSpec(newer, 0, 1))
        retry.join(15.0)  # below the announcement wait (10 s) plus forming the dead one (30 s)
        assert got == [[1.0, 1.0]]
        assert b.spec.uid == newer
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("told", ["offered", "heard-of"])
def test_a_formation_waiting_on_a_dead_member_gives_way_to_a_newer_session_at_once(
    redis_url: str, told: str
) -> None:
    """A second death: a member of the offered session died before it formed, so this
    rank's formation waits for it (the cpu planes form an offer at once, holding the
    formation lock). The coordinator offers a newer session without it: the formation
    of the first gives up within a wait slice and the newer one forms, where the first
    held the lock for the whole group timeout and the newer session's peers, formed at
    once, timed out on this rank in their turn. The newer offer reaches the manager
    while the first forms (``offered``: another thread delivers it), or only once the
    first is done (``heard-of``: the rank's one session thread delivers offers in turn;
    its reader thread tells the manager of the newer one at once)."""
    import threading

    from flodl_bus.params.groups import SessionSpec

    a, b = _pair(redis_url, timeout=60.0, cap=60.0)  # b is the member that died
    try:
        first = threading.Thread(
            target=lambda: a.offer(SessionSpec(os.urandom(16), 0, 2), form=True), daemon=True
        )
        first.start()
        assert _wait_until(a._forming.locked)  # waiting in the first one's rendezvous
        newer = SessionSpec(os.urandom(16), 0, 1)
        if told == "heard-of":
            a.heard_of(newer)
            first.join(20.0)  # a third of the group timeout
            assert not first.is_alive()
        second = threading.Thread(target=lambda: a.offer(newer, form=True), daemon=True)
        second.start()
        second.join(20.0)
        assert not second.is_alive()
        assert a.spec.uid == newer.uid and a.group is not None and not a.group.broken
        first.join(5.0)
        assert not first.is_alive()
    finally:
        a.close()
        b.close()


def test_a_session_heard_of_once_it_is_offered_gives_no_later_formation_up(
    redis_url: str,
) -> None:
    """What was heard of stops counting as newer once it is offered: a later session's
    formation, waiting on its peer, must not give up for it (a stale one would fail
    every re-session after). The reader's word may also come after the session thread
    offered that session already (a race): it is then old news."""
    import threading

    from flodl_bus.bus.store import RedisStore
    from flodl_bus.params.forming import session_prefix
    from flodl_bus.params.groups import ANNOUNCE_KEY, SessionSpec

    pair = _pair(redis_url, timeout=20.0, cap=20.0)
    try:
        for k in range(3):
            specs = [SessionSpec(uid, r, 2) for uid in [os.urandom(16)] for r in range(2)]
            if k == 0:
                for m, spec in zip(pair, specs, strict=True):
                    m.heard_of(spec)
            # Rank 0 first, alone in the rendezvous until its own key is in: it then
            # waits on rank 1's, asking at every slice whether to give up.
            first = threading.Thread(
                target=pair[0].offer, args=(specs[0],), kwargs={"form": True}, daemon=True
            )
            first.start()
            store = RedisStore(redis_url, session_prefix(pair[0].base_prefix, specs[0].uid))
            try:
                assert _wait_until(
                    lambda st=store: any(not n.startswith(ANNOUNCE_KEY) for n in st.list_keys())
                )
            finally:
                store.close()
            pair[1].offer(specs[1], form=True)
            first.join(20.0)
            assert [m.spec.uid for m in pair] == [specs[0].uid] * 2
            assert all(m.group is not None and not m.group.broken for m in pair)
            if k == 1:
                for m, spec in zip(pair, specs, strict=True):
                    m.heard_of(spec)  # late: offered already
        assert [m.sessions_formed for m in pair] == [3, 3]
    finally:
        for m in pair:
            m.close()


def _wait_until(cond: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_helpers_moved_to_forming_are_still_found_in_groups_with_a_warning() -> None:
    from flodl_bus.params import forming, groups

    for name in ("store_base", "backend_for", "routable_host", "serve_tcp_store"):
        with pytest.warns(DeprecationWarning, match=f"moved to flodl_bus.params.forming.{name}"):
            assert getattr(groups, name) is getattr(forming, name)
    with pytest.raises(AttributeError):
        groups.no_such_name  # noqa: B018
