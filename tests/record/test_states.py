"""The coordinator record's state deltas (``record.states``): what a line holds adds up,
over the record, to every state the coordinator had; the recorder writes deltas only
where it may."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

from flodl_bus.record import states
from flodl_bus.record.dispatch import DispatchRecorder
from flodl_bus.record.log import read_records


def _state(n: int) -> dict[str, Any]:
    return {
        "phase": "training",
        "version": 0,
        "steps": [0] * n,
        "acks": [True] * n,
        "dead": [],
        "pools": {"0": 100},
        "gate": {"open": False, "why": "rank 0 at 0/10 steps"},
    }


def _mutate(rnd: random.Random, s: dict[str, Any]) -> dict[str, Any]:
    """A fresh state (as ``state_summary`` makes one): some lists handed back as they
    were, others changed at a few places or everywhere, scalars and maps changed."""
    out = dict(s)
    n = len(s["steps"])
    kind = rnd.randrange(6)
    if kind == 0:
        steps = list(s["steps"])
        steps[rnd.randrange(n)] += 1
        out["steps"] = steps
    elif kind == 1:
        out["steps"] = [0] * n  # a reduce resets every rank
    elif kind == 2:
        acks = list(s["acks"])
        for r in rnd.sample(range(n), 3):
            acks[r] = not acks[r]
        out["acks"] = acks
    elif kind == 3:
        out["dead"] = sorted({*s["dead"], rnd.randrange(n)})
        out["version"] = s["version"] + 1
    elif kind == 4:
        out["gate"] = {"open": rnd.random() < 0.5, "why": f"rank {rnd.randrange(n)}"}
        out["pools"] = {"0": rnd.randrange(100), "1": 5}
        if out.pop("window_wait_since", None) is None:  # a key that comes and goes
            out["window_wait_since"] = rnd.random()
    else:
        out["steps"] = list(s["steps"])  # equal, not the same list
    return out


@pytest.mark.parametrize("n", [4, 64])
def test_deltas_over_a_run_add_up_to_every_state_whatever_the_hint(n: int) -> None:
    rnd = random.Random(n)
    seq = [_state(n)]
    for _ in range(400):
        seq.append(_mutate(rnd, seq[-1]))
    events: list[dict[str, Any]] = [{"event": "start", "i": 0, "before": seq[0], "after": seq[0]}]
    for k, (a, b) in enumerate(itertools.pairwise(seq)):
        hint = rnd.choice([None, 0, n - 1, rnd.randrange(n)])  # right, wrong or none
        d = states.delta(a, b, hint)
        events.append({"event": "dispatch", "i": k + 1, **d})
    got = list(states.expand(events))
    assert [e["after"] for e in got] == seq
    assert [e["before"] for e in got[1:]] == seq[:-1]


def test_a_message_that_moves_one_ranks_entry_is_one_index_value_pair() -> None:
    a = _state(1024)
    b = dict(a, steps=[0] * 1023 + [7])
    assert states.delta(a, b, hint=1023) == {"changed": {}, "patched": {"steps": [1023, 7]}}
    assert states.delta(a, b, hint=5) == {"changed": {}, "patched": {"steps": [1023, 7]}}
    assert states.delta(a, dict(a), hint=3) == {"changed": {}}


def test_a_list_changed_in_many_places_or_a_short_one_is_written_whole() -> None:
    a = _state(64)
    many = dict(a, steps=list(range(64)))
    assert states.delta(a, many, None) == {"changed": {"steps": list(range(64))}}
    small = _state(4)
    assert states.delta(small, dict(small, steps=[0, 0, 1, 0]), 2) == {
        "changed": {"steps": [0, 0, 1, 0]}
    }


def test_a_key_the_state_gains_is_changed_and_one_it_loses_removed() -> None:
    a = _state(8)
    gained = {**a, "window_wait_since": 3.5}
    assert states.delta(a, gained, None) == {"changed": {"window_wait_since": 3.5}}
    assert states.delta(gained, a, None) == {"changed": {}, "removed": ["window_wait_since"]}


@pytest.mark.parametrize("n", [4, 64])
def test_a_delta_of_states_sharing_their_lists_is_the_walks_delta(n: int) -> None:
    """``delta_shared`` (the keys that can differ named, the lists set in place given
    as patches) says what ``delta`` says of the same two states, or leaves it to it."""
    rnd = random.Random(n)
    scalars = ("phase", "version", "pools", "gate", "window_wait_since")
    prev = _state(n)
    taken = 0
    for _ in range(400):
        cur = _mutate(rnd, prev)
        for k in ("steps", "acks", "dead"):
            cur[k] = prev[k]  # shared, as the summarizer's mirror keeps them
        patches: dict[str, list[Any]] = {}
        chosen = rnd.sample(["steps", "acks"], rnd.randrange(3))
        for k in (k for k in ("steps", "acks") if k in chosen):  # in the state's order
            flat: list[Any] = []
            for i in sorted(rnd.sample(range(n), rnd.choice([1, 1, 2, n // 2]))):
                cur[k][i] = v = cur[k][i] + 1 if k == "steps" else not cur[k][i]
                flat += (i, v)
            patches[k] = flat
        # the walk compares the lists' entries with themselves: a patch only says where
        want = states.delta(prev, cur, rnd.randrange(n), None, patches)
        got = states.delta_shared(prev, cur, scalars, patches)
        if got is not None:
            taken += 1
            assert got == want
            assert [list(v) for v in got.values()] == [list(v) for v in want.values()]
        else:  # only a patch the line writes whole leaves it to the walk
            assert any(k in want[states.CHANGED] for k in patches)
        prev = cur
    assert taken > (300 if n == 64 else 100)


def test_expanded_events_share_no_list_so_changing_one_changes_no_other() -> None:
    a = _state(32)
    b = dict(a, steps=[1] + [0] * 31)
    d = states.delta(a, b, 0)
    first, second = states.expand([{"i": 0, "before": a, "after": a}, {"i": 1, **d}])
    second["after"]["steps"][5] = 99
    second["before"]["steps"][6] = 99
    assert a["steps"][5] == 0 and a["steps"][6] == 0 and first["after"]["steps"][5] == 0


@pytest.mark.parametrize(
    ("events", "why"),
    [
        ([{"i": 0, "changed": {}}], "no event before it a whole state"),
        (
            [
                {"i": 0, "before": {"s": [0] * 20}, "after": {"s": [0] * 20}},
                {"i": 1, "changed": {}, "patched": {"s": [20, 1]}},
            ],
            "outside the list",
        ),
        (
            [
                {"i": 0, "before": {"s": 1}, "after": {"s": 1}},
                {"i": 1, "changed": {}, "removed": ["t"]},
            ],
            "not a state key",
        ),
    ],
)
def test_a_delta_that_does_not_fit_the_state_before_it_is_refused(
    events: list[dict[str, Any]], why: str
) -> None:
    with pytest.raises(states.BadDelta, match=why):
        list(states.expand(events))


def _summary(steps: list[int]) -> dict[str, Any]:
    return {"steps": steps, "version": 0}


def test_a_coordinator_record_holds_deltas_after_its_first_core_event_a_rank_record_not(
    tmp_path: Path,
) -> None:
    s0, s1, s2 = _summary([0] * 32), _summary([1] + [0] * 31), _summary([1, 1] + [0] * 30)
    for role, rank in (("coordinator", None), ("rank", 0)):
        rec = DispatchRecorder(tmp_path, role, rank, compress=False)
        rec.core_call("start", now=1.0, before=s0, after=s0, out=[])
        rec.dispatch(
            stream="up:0", entry_id="1-0", msg=None, now=2.0, before=s0, after=s1, out=[], sender=0
        )
        rec.dispatch(
            stream="up:1", entry_id="1-1", msg=None, now=3.0, before=s1, after=s2, out=[], sender=1
        )
        rec.close()
        lines = read_records(rec.path)
        if role == "coordinator":
            assert "after" in lines[0] and "changed" not in lines[0]
            assert lines[1]["patched"] == {"steps": [0, 1]} and "before" not in lines[1]
            assert lines[2]["patched"] == {"steps": [1, 1]}
        else:
            assert all("after" in ln and "changed" not in ln for ln in lines)


def test_a_before_other_than_the_last_recorded_after_is_written_whole(tmp_path: Path) -> None:
    s0, s1 = _summary([0] * 32), _summary([5] * 32)
    rec = DispatchRecorder(tmp_path, "coordinator", compress=False)
    rec.core_call("start", now=1.0, before=s0, after=s0, out=[])
    # not the state the record last held: a delta would put the wrong "before" in it
    rec.core_call("tick", now=2.0, before=s1, after=s1, out=[])
    rec.close()
    tick = read_records(rec.path)[1]
    assert tick["before"] == s1 and tick["after"] == s1 and "changed" not in tick
