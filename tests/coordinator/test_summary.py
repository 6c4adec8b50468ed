"""The state summary built from the previous one (``coordinator.summary``) is the summary
computed afresh, after every core call of whole simulated runs: every mode, a rank
killed, throttling, several epochs, evals; and so is the record's delta the summarizer's
changes make, against the delta of two fresh summaries.

The core is driven as the coordinator loop drives it (``CoordinatorLoop``): each call's
"after" built from the last one, a tick that changed nothing left unrecorded (the base
kept), and now and then a summary handed in that the summarizer did not make."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from flodl_bus.coordinator.config import MODES, CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Out
from flodl_bus.coordinator.reduce import NcclReduce
from flodl_bus.coordinator.summary import KEYS, SCALARS
from flodl_bus.coordinator.tracked import Tracked
from flodl_bus.protocol.messages import UpstreamMsg
from flodl_bus.record import states
from flodl_bus.record.dispatch import DispatchRecorder
from tests.coordinator.sim import Cluster

#: above ``states.PATCH_MIN``: the deltas patch per-rank lists
RANKS = 20


class Checked(Coordinator):
    """A core that checks its incremental summary against a fresh one after each call."""

    def __init__(self, config: CoordinatorConfig, recorders: int = 0) -> None:
        super().__init__(config)
        self.state = self.state_summary()
        self.fresh = self.state_summary()
        self.calls = 0
        self.patched = 0
        self.rebased = 0
        #: (the loop's way: built from the last, with changes; every state fresh)
        self.recs: tuple[DispatchRecorder, DispatchRecorder] | None = None
        self.rec_dir: Path | None = None

    def _check(self, outs: list[Out], hint: int | None, recorded: bool = True) -> list[Out]:
        self.calls += 1
        if isinstance(self.reduce, NcclReduce):
            # the gate's shortcut: a count of missing acks, never a scan
            assert self.reduce.any_blocks() == (False in self.reduce.ack_flags())
        before = self.state
        if self.calls % 97 == 0:
            # a state the summarizer did not make (a replay's, a copy): read whole
            before = copy.deepcopy(before)
            self.rebased += 1
        after = self.state_summary(before)
        fresh = self.state_summary()
        assert after == fresh, f"call {self.calls}: {_diff(after, fresh)}"
        assert list(after) == list(fresh), "the key order is the record's"
        for k in states.CHANGED, states.PATCHED:
            assert k not in after
        known = self.summary_changes(after, before)
        assert known is not None
        ours = states.delta(before, after, hint, known)
        assert ours == states.delta(self.fresh, fresh, hint), f"call {self.calls}"
        self.patched += len(ours.get(states.PATCHED, {}))
        if not recorded and not outs and after == before:
            return outs  # as the loop does: the base stays the recorder's last state
        if self.recs is not None:
            ours_rec, fresh_rec = self.recs
            event, kw = self._event
            if event == "dispatch":
                ours_rec.dispatch(before=before, after=after, out=outs, changes=known, **kw)
                fresh_rec.dispatch(before=self.fresh, after=fresh, out=outs, **kw)
            else:
                for rec, b, a in ((ours_rec, before, after), (fresh_rec, self.fresh, fresh)):
                    rec.core_call(event, before=b, after=a, out=outs, **kw)
        self.state, self.fresh = after, fresh
        return outs

    def record_to(self, run_dir: Path) -> None:
        self.recs = (
            DispatchRecorder(run_dir / "ours", "coordinator", compress=False, process=False),
            DispatchRecorder(run_dir / "fresh", "coordinator", compress=False, process=False),
        )
        for rec in self.recs:
            rec.header(run="summary", config=dataclasses.asdict(self.config))

    def start(self, now: float) -> list[Out]:
        self._event = ("start", {"now": now})
        return self._check(super().start(now), None)

    def handle(self, rank: int, msg: UpstreamMsg, now: float) -> list[Out]:
        self._event = ("dispatch", {"now": now, "stream": f"up:{rank}", "entry_id": None,
                                    "msg": msg, "sender": rank})  # fmt: skip
        return self._check(super().handle(rank, msg, now), rank)

    def tick(self, now: float) -> list[Out]:
        self._event = ("tick", {"now": now})
        return self._check(super().tick(now), None, recorded=False)


def _diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


def _run(
    cfg: CoordinatorConfig, speeds: list[int], kill: dict[int, int], record: Path | None = None
) -> Checked:
    core = Checked(cfg)
    if record is not None:
        core.record_to(record)
    cluster = Cluster(cfg, speeds=speeds, core=core)
    cluster.heartbeat_every_ms = 10
    cluster.kill_at.update(kill)
    cluster.run()
    assert cluster.finished is not None
    if core.recs is not None:
        for rec in core.recs:
            rec.close()
    return core


@pytest.mark.parametrize("mode", MODES)
def test_the_incremental_summary_equals_a_fresh_one_after_every_call_of_a_run(
    mode: str,
) -> None:
    cfg = CoordinatorConfig(
        mode=mode,
        world_size=RANKS,
        total_samples=RANKS * 60,
        batch_size=2,
        num_epochs=3,
        eval_every=1,
        final_eval=True,
        heartbeat_timeout=0.05,
        max_batch_diff=3,
    )
    speeds = [1 + (r * 7) % 5 for r in range(RANKS)]
    core = _run(cfg, speeds, kill={5: 30, 13: 90})
    assert core.live.dead[5] and core.live.dead[13]
    assert core.calls > 1000
    assert core.patched > 100  # the deltas did patch lists from the summarizer's changes
    assert core.rebased > 5


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-sync"])
def test_a_run_recorded_the_loops_way_is_byte_identical_to_one_of_fresh_states(
    mode: str, tmp_path: Path
) -> None:
    """The record's content is unchanged: each line's delta from the summarizer's
    changes is the one two fresh summaries give, to the byte (key order included)."""
    cfg = CoordinatorConfig(
        mode=mode, world_size=RANKS, total_samples=RANKS * 40, batch_size=2, num_epochs=2,
        heartbeat_timeout=0.05, max_batch_diff=3,
    )  # fmt: skip
    _run(cfg, [1 + (r * 3) % 4 for r in range(RANKS)], kill={7: 40}, record=tmp_path)
    ours = (tmp_path / "ours" / "coordinator.jsonl").read_bytes()
    fresh = (tmp_path / "fresh" / "coordinator.jsonl").read_bytes()
    assert ours.count(b"\n") > 500 and b'"patched"' in ours
    assert ours == fresh


def test_a_throttled_run_is_summarized_exactly() -> None:
    # cpu-sync's barrier throttles every rank each round; a tight max_batch_diff holds
    # the fast ranks of cpu-cadence on their own
    for mode in ("cpu-sync", "cpu-cadence"):
        cfg = CoordinatorConfig(
            mode=mode,
            world_size=RANKS,
            total_samples=RANKS * 40,
            batch_size=1,
            num_epochs=2,
            max_batch_diff=1,
        )
        core = _run(cfg, [1 if r % 4 else 9 for r in range(RANKS)], kill={})
        assert core.calls > 500


def test_the_steady_state_reads_only_the_lists_a_message_wrote() -> None:
    """Every per-rank list the summary shows is tracked in a pool-dispatched run: a
    Batch's summary is patched, never read whole (what makes it O(changed))."""
    cfg = CoordinatorConfig(
        mode="nccl-cadence", world_size=64, total_samples=64 * 400, batch_size=1, num_epochs=1
    )
    core = Coordinator(cfg)
    state = core.state_summary()
    core.start(0.0)
    state = core.state_summary(state)
    sources = core.summarizer._read_sources()
    assert all(type(s) is Tracked for s in sources)
    from flodl_bus.protocol.messages import Batch

    core.handle(3, Batch(3, 5.0, 0.1, 1, 0.5), 0.01)
    after = core.state_summary(state)
    assert core.summary_changes(after, state) == {"steps": [3], "last_step_count": [3]}
    for k, v in after.items():
        if k not in ("steps", "last_step_count") and isinstance(v, list):
            assert v is state[k]  # handed back, not rebuilt
    assert after == core.state_summary()


def test_a_tracked_list_notes_each_write_and_anything_else_as_whole() -> None:
    t = Tracked([0] * 5)
    t[1] += 1
    t[-1] = 7
    assert t.take() == (False, {1, 4})
    assert t.take() == (False, set())
    t[1:3] = [5, 5]
    assert t.take()[0] is True
    t.sort()
    assert t.take()[0] is True
    assert t == [0, 0, 5, 5, 7] and type(t.copy()) is list


class Mirrored(Coordinator):
    """A core driven as the coordinator loop drives it with a record process: lists set
    in place (``Summarizer.mirror``), each call's delta made from the summarizer's
    patches; beside it, every state built fresh and recorded whole-diffed."""

    def __init__(self, config: CoordinatorConfig, run_dir: Path, fast: bool = False) -> None:
        super().__init__(config)
        self.summarizer.mirror = True
        #: each call's delta as the summarizer made it (``summary_delta``), where it did
        self.fast = fast
        self.known = 0
        self.ours = DispatchRecorder(run_dir / "ours", "coordinator", compress=False, process=True)
        self.fresh_rec = DispatchRecorder(
            run_dir / "fresh", "coordinator", compress=False, process=False, events=False
        )
        for rec in (self.ours, self.fresh_rec):
            rec.header(run="mirror", config=dataclasses.asdict(config))
        self.state: dict[str, Any] | None = None
        self.fresh: dict[str, Any] | None = None
        self.calls = self.in_place = 0

    def _record(self, event: str, outs: list[Out], hint: int | None, **kw: Any) -> list[Out]:
        self.calls += 1
        assert self.state is not None and self.fresh is not None  # built before start
        before, fresh_before = self.state, self.fresh
        after = self.state_summary(before)
        fresh = self.state_summary()
        assert after == fresh, f"call {self.calls}: {_diff(after, fresh)}"
        patches = self.summary_patches(after, before)
        self.in_place += bool(patches)
        if event == "tick" and not outs and after == before and not patches:
            self.state = before  # unrecorded, as the loop leaves it
            return outs
        delta = self.summary_delta(after, before) if self.fast else None
        if delta is not None:
            # the line's delta, as two fresh states diffed whole make it (key order too)
            want = states.delta(fresh_before, fresh, hint)
            assert delta == want, f"call {self.calls}: {delta} != {want}"
            assert [list(d) for d in delta.values()] == [list(d) for d in want.values()]
            self.known += 1
        if event == "dispatch":
            self.ours.dispatch(
                before=before, after=after, out=outs, sender=hint,
                changes=self.summary_changes(after, before), patches=patches, delta=delta,
                **kw,
            )  # fmt: skip
            self.fresh_rec.dispatch(before=fresh_before, after=fresh, out=outs, sender=hint, **kw)
        else:
            self.ours.core_call(
                event, before=before, after=after, out=outs, patches=patches, delta=delta, **kw
            )
            self.fresh_rec.core_call(event, before=fresh_before, after=fresh, out=outs, **kw)
        self.state, self.fresh = after, fresh
        return outs

    def start(self, now: float) -> list[Out]:
        self.state, self.fresh = self.state_summary(), self.state_summary()
        return self._record("start", super().start(now), None, now=now)

    def handle(self, rank: int, msg: UpstreamMsg, now: float) -> list[Out]:
        outs = super().handle(rank, msg, now)
        return self._record(
            "dispatch", outs, rank, now=now, stream=f"up:{rank}", entry_id=None, msg=msg
        )

    def tick(self, now: float) -> list[Out]:
        return self._record("tick", super().tick(now), None, now=now)


def _record_both_ways(mode: str, tmp_path: Path, fast: bool) -> tuple[Mirrored, bytes, bytes]:
    """A simulated run of ``RANKS`` (two of them killed) recorded through the mirror
    (``fast``: with the summarizer's own deltas) and from fresh states: the core and
    both records' bytes."""
    cfg = CoordinatorConfig(
        mode=mode, world_size=RANKS, total_samples=RANKS * 60, batch_size=2, num_epochs=3,
        eval_every=1, final_eval=True, heartbeat_timeout=0.05, max_batch_diff=3,
    )  # fmt: skip
    core = Mirrored(cfg, tmp_path, fast=fast)
    cluster = Cluster(cfg, speeds=[1 + (r * 7) % 5 for r in range(RANKS)], core=core)
    cluster.heartbeat_every_ms = 10
    cluster.kill_at.update({5: 30, 13: 90})
    cluster.run()
    assert cluster.finished is not None and core.live.dead[5] and core.live.dead[13]
    core.ours.close()
    core.fresh_rec.close()
    assert core.ours.failure is None
    ours = (tmp_path / "ours" / "coordinator.jsonl").read_bytes()
    fresh = (tmp_path / "fresh" / "coordinator.jsonl").read_bytes()
    return core, ours, fresh


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-sync", "cpu-cadence"])
def test_lists_set_in_place_record_byte_for_byte_what_fresh_states_record(
    mode: str, tmp_path: Path
) -> None:
    """The mirror's deltas, sent to a record process while the lists keep changing under
    them, write the very lines that fresh summaries diffed whole write: a rank killed,
    throttling, evals, a world over ``PATCH_MIN`` and the whole lists a death rewrites."""
    core, ours, fresh = _record_both_ways(mode, tmp_path, fast=False)
    assert core.in_place > 300  # the lists were set in place, not copied
    assert ours.count(b"\n") > 500 and b'"patched"' in ours
    assert ours == fresh


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-sync", "cpu-cadence"])
def test_the_summarizers_own_deltas_record_byte_for_byte_what_fresh_states_record(
    mode: str, tmp_path: Path
) -> None:
    """The deltas the summarizer makes as it builds a state (``summary_delta``: no walk
    over the keys, only its scalars compared) are, call by call, the whole diff of two
    fresh states, and the record they make is the fresh one to the byte: the gate moving
    on a ``Batch``, the pools on a plan, a wait's start and end on ticks, two deaths."""
    core, ours, fresh = _record_both_ways(mode, tmp_path, fast=True)
    assert core.known > 300  # most lines took the summarizer's delta
    assert ours.count(b"\n") > 500 and b'"patched"' in ours
    assert ours == fresh


def test_the_keys_a_summarizers_delta_compares_are_every_key_but_its_lists() -> None:
    """A key missing there would never reach a line built from the summarizer's delta."""
    cfg = CoordinatorConfig(
        mode="cpu-cadence", world_size=RANKS, total_samples=400, batch_size=1, num_epochs=1
    )
    core = Coordinator(cfg)
    core.reduce.wait_since = 1.5  # the optional last key
    summary = core.state_summary()
    assert [k for k in summary if k not in KEYS] == list(SCALARS)
