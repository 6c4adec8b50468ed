"""The join stream: signed membership entries, read back in order; bad ones dead-lettered."""

from __future__ import annotations

import redis

from flodl_bus.bus.join import JoinStream
from flodl_bus.bus.keys import RunKeys
from flodl_bus.protocol.messages import Assign, Hello, Reject
from flodl_bus.protocol.signing import CoordinatorIdentity, new_secret


def test_entries_read_back_in_post_order_from_any_cursor(any_redis: redis.Redis) -> None:
    js = JoinStream(any_redis, "run-j", new_secret(), signer=CoordinatorIdentity.generate().signing)
    first = js.post(Hello("w1", "host", "sig", requested_rank=2))
    js.post(Assign("w1", 2, 4))
    js.post(Reject("w9", "dataset signature x does not match y"))
    got, cursor = js.read("0", None)
    assert [m for _, m in got] == [
        Hello("w1", "host", "sig", requested_rank=2),
        Assign("w1", 2, 4),
        Reject("w9", "dataset signature x does not match y"),
    ]
    after_first, _ = js.read(first, None)
    assert [m for _, m in after_first] == [m for _, m in got[1:]]
    assert js.read(cursor, 10) == ([], cursor)


def test_a_hello_signed_with_another_runs_secret_is_dead_lettered(any_redis: redis.Redis) -> None:
    keys = RunKeys("run-j2")
    stranger = JoinStream(any_redis, keys, new_secret())
    stranger.post(Hello("intruder", "h", "sig"))
    ours = JoinStream(any_redis, keys, new_secret())
    got, _ = ours.read("0", None)
    assert got == []
    (entry,) = any_redis.xrange(keys.dlq)
    assert b"authentication failed" in entry[1][b"reason"]


def test_an_answer_made_with_the_run_secret_is_not_the_coordinators(
    any_redis: redis.Redis,
) -> None:
    """A worker holds the run secret; it must not be able to Assign or Reject."""
    keys = RunKeys("run-j3")
    secret = new_secret()
    coordinator = CoordinatorIdentity.generate()
    worker = JoinStream(any_redis, keys, secret, answers=coordinator.signing.public)
    forger = JoinStream(any_redis, keys, secret, signer=CoordinatorIdentity.generate().signing)
    forger.post(Assign("w1", 0, 1))  # signed, but not by this run's coordinator
    # MACed with the run secret, as a worker could: an answer must carry a signature
    forger.signer = forger.member  # type: ignore[assignment]
    forger.post(Reject("w1", "go away"))
    real = JoinStream(any_redis, keys, secret, signer=coordinator.signing)
    real.post(Assign("w1", 3, 4))
    got, _ = worker.read("0", None)
    assert [m for _, m in got] == [Assign("w1", 3, 4)]
    reasons = [f[b"reason"].decode() for _, f in any_redis.xrange(keys.dlq)]
    assert len(reasons) == 2 and all(r.startswith("authentication failed") for r in reasons)


def test_a_flood_of_giant_hellos_signed_with_the_run_secret_is_refused_unread(
    any_redis: redis.Redis,
) -> None:
    """A worker credential and the run secret can post Hellos of any size: each is
    refused by its size, before its MAC or body is looked at, and the reader moves on
    to the real ones (issue 28: 300 of 1 MiB stalled the coordinator for 40 s)."""
    from flodl_bus.bus import entries

    keys = RunKeys("run-j4")
    secret = new_secret()
    flooder = JoinStream(any_redis, keys, secret)
    big = "x" * (entries.MAX_JOIN_BODY_BYTES + 1)
    for i in range(40):
        flooder.post(Hello(f"w{i}", big, "sig"))
    flooder.post(Hello("real", "host", "sig"))
    coordinator = JoinStream(any_redis, keys, secret, signer=CoordinatorIdentity.generate().signing)
    got, _ = coordinator.read("0", None)
    assert [m for _, m in got] == [Hello("real", "host", "sig")]
    reasons = [f[b"reason"].decode() for _, f in any_redis.xrange(keys.dlq)]
    assert len(reasons) == 40 and all(r.startswith("oversized: body") for r in reasons)
    # the dead letters keep a trimmed copy only
    assert all(len(v) <= 512 for _, f in any_redis.xrange(keys.dlq) for v in f.values())
