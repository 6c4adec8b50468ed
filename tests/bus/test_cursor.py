"""GroupCursor against a model of Redis consumer-group semantics."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_bus.bus.cursor import GroupCursor
from flodl_bus.bus.ids import EntryId, parse_id


class GroupModel:
    """XREADGROUP for one consumer: ``>`` delivers new entries into the pending list,
    an explicit id re-reads the pending list after it; COUNT per stream."""

    def __init__(self, streams: list[str]) -> None:
        self.entries: dict[str, list[EntryId]] = {s: [] for s in streams}
        self.delivered: dict[str, EntryId] = dict.fromkeys(streams, (0, 0))
        self.pel: dict[str, set[EntryId]] = {s: set() for s in streams}
        self.clock = 0

    def add(self, stream: str) -> EntryId:
        self.clock += 1
        eid = (self.clock, 0)
        self.entries[stream].append(eid)
        return eid

    def read(self, request: dict[str, str], count: int) -> dict[str, list[tuple[EntryId, dict]]]:
        reply: dict[str, list[tuple[EntryId, dict]]] = {}
        for s, start in request.items():
            if start == ">":
                new = [e for e in self.entries[s] if e > self.delivered[s]][:count]
                if new:
                    self.delivered[s] = new[-1]
                    self.pel[s].update(new)
            else:
                after = parse_id(start)
                new = sorted(e for e in self.pel[s] if e > after)[:count]
            reply[s] = [(e, {b"v": b"1"}) for e in new]
        return reply

    def ack(self, stream: str, eid: EntryId) -> None:
        self.pel[stream].discard(eid)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.sampled_from(["ctl", "all"])),
        st.tuples(st.just("read"), st.just("")),
        st.tuples(st.just("lost"), st.just("")),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, count=st.integers(min_value=1, max_value=6))
def test_merged_reads_release_every_entry_once_in_global_id_order(
    ops: list[tuple[str, str]], count: int
) -> None:
    model = GroupModel(["ctl", "all"])
    cursor = GroupCursor(["ctl", "all"], count=count, ordered=True)
    sent: list[EntryId] = []
    released: list[EntryId] = []

    def read(lose: bool) -> None:
        reply = model.read(cursor.request(), count)
        if lose:
            cursor.on_lost()
            return
        for r in cursor.on_reply(reply):
            released.append(r.entry_id)
            model.ack(r.stream, r.entry_id)

    for op, stream in ops:
        if op == "send":
            sent.append(model.add(stream))
        else:
            read(lose=op == "lost")
        assert released == sorted(released)
    for _ in range(4 * len(sent) + 4):
        read(lose=False)
    assert released == sent


@settings(max_examples=300, deadline=None)
@given(
    ops=ops,
    count=st.integers(min_value=1, max_value=6),
    ordered=st.booleans(),
)
def test_a_cursor_that_says_it_is_not_behind_has_nothing_waiting_unread(
    ops: list[tuple[str, str]], count: int, ordered: bool
) -> None:
    # The coordinator's liveness rests on it: a rank is judged silent only after a read
    # that says it left nothing waiting (Coordinator.tick(behind=...)).
    model = GroupModel(["ctl", "all"])
    cursor = GroupCursor(["ctl", "all"], count=count, ordered=ordered)
    for op, stream in ops:
        if op == "send":
            model.add(stream)
            continue
        reply = model.read(cursor.request(), count)
        if op == "lost":
            cursor.on_lost()
            continue
        for r in cursor.on_reply(reply):
            model.ack(r.stream, r.entry_id)
        if not cursor.behind:
            unread = [e for s, es in model.entries.items() for e in es if e > model.delivered[s]]
            assert not unread and cursor.can_block


def test_a_pending_drain_releases_nothing_until_a_new_read_proves_order() -> None:
    c = GroupCursor(["a", "b"], count=10, ordered=True)
    assert c.request() == {"a": "0-0", "b": "0-0"}
    assert c.on_reply({"a": [((5, 0), {})], "b": []}) == []
    assert c.request() == {"a": ">", "b": ">"}
    assert not c.can_block  # something is held back
    out = c.on_reply({"a": [], "b": [((3, 0), {}), ((7, 0), {})]})
    assert [r.entry_id for r in out] == [(3, 0), (5, 0), (7, 0)]
    assert c.can_block


def test_redelivered_entries_are_dropped() -> None:
    c = GroupCursor(["up"], count=10, ordered=False)
    first = c.on_reply({"up": [((1, 0), {}), ((2, 0), {})]})
    assert [r.entry_id for r in first] == [(1, 0), (2, 0)]
    c.on_lost()
    assert c.request() == {"up": "2-0"}  # re-read pending only after what was seen
    assert c.on_reply({"up": [((2, 0), {}), ((3, 0), {})]})[0].entry_id == (3, 0)


def _refuse_marked(stream: str, eid: EntryId, fields: object) -> object:
    return "bad mac" if fields == {b"bad": b"1"} else fields


def test_an_entry_that_fails_its_check_moves_nothing() -> None:
    """A foreign entry at the largest id, refused, must not make later real entries
    (which the coordinator writes below it once it removed it) look old."""
    c = GroupCursor(["ctl", "all"], count=10, ordered=True)
    c.on_reply({"ctl": [], "all": []})  # the pending drain: nothing
    top = (2**64 - 1, 2**64 - 1)
    out = c.on_reply({"ctl": [((1, 0), {}), (top, {b"bad": b"1"})], "all": []}, _refuse_marked)
    assert [(r.entry_id, r.rejected) for r in out] == [(top, "bad mac"), ((1, 0), None)]
    assert c.last_id("ctl") == (1, 0)
    later = c.on_reply({"ctl": [((2, 0), {})], "all": [((3, 0), {})]}, _refuse_marked)
    assert [(r.entry_id, r.rejected) for r in later] == [((2, 0), None), ((3, 0), None)]


def test_an_old_id_in_a_new_read_is_a_replay_and_in_a_pending_read_a_redelivery() -> None:
    c = GroupCursor(["up"], count=10, ordered=False)
    c.on_reply({"up": [((1, 0), {}), ((2, 0), {})]})
    # a `>` read never hands out an id twice: an old id is an entry put back (replayed)
    out = c.on_reply({"up": [((2, 0), {}), ((3, 0), {})]})
    assert out[0].entry_id == (2, 0) and (out[0].rejected or "").startswith("replayed")
    assert out[1].entry_id == (3, 0) and out[1].rejected is None
    c.on_lost()
    assert c.on_reply({"up": [((3, 0), {})]}) == []  # pending re-read: silently dropped
