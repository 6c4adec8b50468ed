"""Key layout: one hash tag per run, validated run ids."""

from __future__ import annotations

import pytest

from flodl_bus.bus.keys import InvalidRunId, RunKeys


def test_every_key_of_a_run_shares_the_run_hash_tag() -> None:
    k = RunKeys("exp-1.a_b")
    all_keys = [k.ctl(3), k.ctl_all, k.up(3), k.join, k.dlq, k.meta, k.store("rdzv/x")]
    assert all_keys == [
        "flodl:{exp-1.a_b}:ctl:3",
        "flodl:{exp-1.a_b}:ctl:all",
        "flodl:{exp-1.a_b}:up:3",
        "flodl:{exp-1.a_b}:join",
        "flodl:{exp-1.a_b}:dlq",
        "flodl:{exp-1.a_b}:meta",
        "flodl:{exp-1.a_b}:store:rdzv/x",
    ]
    # Redis Cluster hashes only the text between the first { and the next }.
    assert {key[key.index("{") + 1 : key.index("}")] for key in all_keys} == {"exp-1.a_b"}


@pytest.mark.parametrize("bad", ["", "a{b", "a}b", "a:b", "a b", "*", "-lead", "x" * 65, "é"])
def test_run_ids_that_would_break_keys_or_patterns_are_refused_clearly(bad: str) -> None:
    with pytest.raises(InvalidRunId, match="invalid run id"):
        RunKeys(bad)


def test_rank_of_a_stream_key_and_short_names() -> None:
    k = RunKeys("r")
    assert k.rank_of(k.ctl(12)) == 12
    assert k.rank_of(k.up(0)) == 0
    assert k.rank_of(k.ctl_all) is None
    assert k.rank_of("flodl:{r}:up:²") is None
    assert k.short(k.up(5)) == "up:5"
    assert k.short("flodl:{other}:up:5") == "flodl:{other}:up:5"
    with pytest.raises(ValueError):
        k.ctl(-1)


def test_a_sharded_run_keeps_each_rank_with_its_shard_broadcast_and_run_wide_keys_home() -> None:
    k = RunKeys("r", shards=(5, 9, 2))
    assert [k.ctl(4), k.up(4), k.ctl_all_of(4), k.dlq_for(k.up(4))] == [
        "flodl:{r:9}:ctl:4",
        "flodl:{r:9}:up:4",
        "flodl:{r:9}:ctl:all",
        "flodl:{r:9}:dlq",
    ]
    assert [k.meta, k.join, k.dlq, k.secret] == [
        "flodl:{r}:meta",
        "flodl:{r}:join",
        "flodl:{r}:dlq",
        "flodl-secret:{r}",
    ]
    assert k.broadcasts == ["flodl:{r:5}:ctl:all", "flodl:{r:9}:ctl:all", "flodl:{r:2}:ctl:all"]
    assert (k.rank_of(k.up(7)), k.short(k.ctl(7)), k.short(k.ctl_all_of(2))) == (
        7,
        "ctl:7",
        "s2/ctl:all",
    )
    # ':' never occurs in a run id, so a shard tag is never another run's tag
    with pytest.raises(InvalidRunId):
        RunKeys("r:9")
    with pytest.raises(ValueError, match="differ"):
        RunKeys("r", shards=(1, 1))


def test_a_run_on_one_redis_keeps_the_single_tag_layout() -> None:
    k = RunKeys("r")
    assert (k.ctl_all_of(3), k.broadcasts, k.dlqs, k.dlq_for(k.up(3))) == (
        k.ctl_all,
        [k.ctl_all],
        [k.dlq],
        k.dlq,
    )
