"""The coordinator's state summary (the record's ``before``/``after``), built in the
time of what changed rather than of the world size.

The summary is built once per message the coordinator handles, and most of it is
per-rank lists (steps, acks, epochs, ...) of which one message changes an entry or
none: rebuilt and compared whole at 1,024 ranks they were most of a message's cost.
So each list is read from its part's own per-rank list (a ``Tracked`` one, which notes
the entries written), and a summary built from the previous one (``build(reuse)``)
copies a list only when an entry of it was written, and patches just those entries.

Exactness does not rest on the writers: a part that replaces its list instead of
writing into it, or holds a plain list, or a computed one (several pools, a fixed
partition), is read whole and compared, as every list was before. And ``build()`` (no
``reuse``) is that whole reading for every list, with nothing kept: the reference the
tests hold every incremental summary to.

``changes(after, before)`` says, for the recorder's delta (``record.states.delta``),
which entries of which lists differ between two summaries this builder made one from
the other, so the delta need not scan them either.

With ``mirror`` on, a list whose entries were written is not copied at all: its entries
are set in place, so every summary built since shares it, and ``patches(after,
before)`` hands the recorder the entries set (index, value), which its delta writes as
they are. That saves two O(N) copies a ``Batch`` (steps and last step counts: 8.5 us a
message at 4,096 ranks), but a summary no longer keeps its lists as they were: only a
caller that reads nothing of an old summary but its identity may turn it on (the
coordinator loop recording through a record process, whose deltas are made here and
whose whole states are copied as they are sent).

With the mirror, a build that replaced no list also makes the record's delta
(``delta(after, before)``): every list is shared, so only the scalars can differ, and
those are read as one tuple and compared with the last build's in C. The walk of
``record.states.delta`` over every key was a fifth of a ``Batch``'s record cost at 1,024
ranks; the tests hold this delta to that walk over two fresh states, line by line.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import compress
from operator import ne
from typing import Any, Final, Protocol

from flodl_bus.coordinator.tracked import Tracked
from flodl_bus.record.states import delta_shared

__all__ = ["Summarizer", "SummaryCore"]


class _Ledger(Protocol):
    @property
    def steps(self) -> list[int]: ...


class _Reduce(Protocol):
    @property
    def last_step_count(self) -> list[int]: ...
    @property
    def throttled(self) -> list[bool]: ...
    @property
    def in_flight(self) -> bool: ...
    @property
    def wait_since(self) -> float | None: ...
    def acks(self) -> list[bool]: ...
    def ack_flags(self) -> list[bool]: ...


class _Dispatch(Protocol):
    def rank_epochs(self) -> list[int]: ...
    def rank_epochs_view(self) -> list[int]: ...
    def in_flight_all(self) -> list[int]: ...
    def in_flight_view(self) -> list[int]: ...
    def remaining(self) -> dict[int, int]: ...


class _Live(Protocol):
    @property
    def dead(self) -> list[bool]: ...
    @property
    def exited(self) -> list[bool]: ...


class _ElChe(Protocol):
    @property
    def anchor(self) -> int: ...
    @property
    def counts(self) -> list[int]: ...


class SummaryCore(Protocol):
    """The core as its summary reads it (nothing is written)."""

    @property
    def ws(self) -> int: ...
    @property
    def phase(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def global_step(self) -> int: ...
    @property
    def avg_count(self) -> int: ...
    @property
    def last_aggregated(self) -> int: ...
    @property
    def ledger(self) -> _Ledger: ...
    @property
    def reduce(self) -> _Reduce: ...
    @property
    def dispatch(self) -> _Dispatch: ...
    @property
    def live(self) -> _Live: ...
    @property
    def elche(self) -> _ElChe: ...
    def gate(self) -> tuple[bool, str]: ...


#: the per-rank lists, in the summary's key order, and how each reads its source: entry
#: by entry (copied), or as the ranks flagged in it
KEYS: Final = (
    "steps",
    "last_step_count",
    "acks",
    "rank_epoch",
    "in_flight",
    "dead",
    "exited",
    "throttled",
    "counts",
)
COPIED: Final = (True, True, True, True, True, False, False, False, True)
#: every other key, in the summary's key order (the last one, optional, apart)
SCALARS_ALWAYS: Final = (
    "phase",
    "version",
    "global_step",
    "avg_count",
    "cpu_pending",
    "anchor",
    "last_aggregated",
    "pools",
    "gate",
)
OPTIONAL: Final = ("window_wait_since",)
SCALARS: Final = (*SCALARS_ALWAYS, *OPTIONAL)
#: the key of each value ``_incremental`` reads for them (the gate's two: its map's)
_VAL_KEYS: Final = (*SCALARS_ALWAYS, "gate")


class Summarizer:
    """Builds ``Coordinator.state_summary``; remembers the last summary it built from
    another (``reuse``) and what it read, so the next one starts from there."""

    def __init__(self, core: SummaryCore) -> None:
        self.core = core
        #: what a per-rank flag list equals when no rank is flagged (one C comparison)
        self._no_flags = [False] * core.ws
        self._ranks = range(core.ws)
        #: the last summary built from another, the one it was built from, and whether
        #: every list of the two is the same object (the base then stands for the last)
        self._last: dict[str, Any] | None = None
        self._base: Mapping[str, Any] | None = None
        self._base_kept = False
        #: each list's source when ``_last`` was built, in ``KEYS`` order (held, so
        #: ``is`` is meaningful)
        self._sources: tuple[list[Any], ...] = ()
        #: key -> the indexes that changed from ``_base`` to ``_last``, or None: a list
        #: that changed whole (absent: the same object)
        self._changes: dict[str, list[int] | None] = {}
        #: entries written in place, not copied (see the module's doc)
        self.mirror = False
        #: key -> [index, value, index, value...] of the lists of ``_last`` set in place
        #: since ``_base`` (``mirror``)
        self._patches: dict[str, list[Any]] = {}
        #: the record's delta from ``_base`` to ``_last`` where the build knew it
        #: (``mirror``, no list replaced), else None
        self._delta: dict[str, Any] | None = None
        #: the scalars' values ``_last`` was built from (``_incremental``), or None
        self._vals: tuple[Any, ...] | None = None

    def flagged(self, flags: list[bool]) -> list[int]:
        """The ranks whose flag is set, in order; none (the usual answer) at the cost of
        one list comparison."""
        return [] if flags == self._no_flags else list(compress(self._ranks, flags))

    def _read_sources(self) -> tuple[list[Any], ...]:
        """Each list's source in ``KEYS`` order: the part's own list where it keeps one
        (tracked), else a fresh one (compared whole)."""
        core = self.core
        reduce, dispatch, live = core.reduce, core.dispatch, core.live
        return (
            core.ledger.steps,
            reduce.last_step_count,
            reduce.ack_flags(),
            dispatch.rank_epochs_view(),
            dispatch.in_flight_view(),
            live.dead,
            live.exited,
            reduce.throttled,
            core.elche.counts,
        )

    def _whole(self) -> dict[str, list[Any]]:
        """Every list computed afresh, as the summary always was (the reference)."""
        core = self.core
        reduce, dispatch, live = core.reduce, core.dispatch, core.live
        return {
            "steps": core.ledger.steps.copy(),
            "last_step_count": reduce.last_step_count.copy(),
            "acks": reduce.acks(),
            "rank_epoch": dispatch.rank_epochs(),
            "in_flight": dispatch.in_flight_all(),
            "dead": self.flagged(live.dead),
            "exited": self.flagged(live.exited),
            "throttled": self.flagged(reduce.throttled),
            "counts": core.elche.counts.copy(),
        }

    # ------------------------------------------------------------------ building
    def build(self, reuse: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The summary now. ``reuse``: an earlier summary whose lists are handed back
        where they still hold (so the recorder neither copies nor compares them)."""
        if reuse is None:
            return self._assemble(self._whole())
        last = self._last
        if last is not None and (reuse is last or (reuse is self._base and self._base_kept)):
            # (A base whose lists are all the last's objects stands for the last.)
            return self._incremental(reuse, last)
        return self._rebase(reuse)

    def rebuild(self, reuse: Mapping[str, Any]) -> dict[str, Any]:
        """What ``build(reuse)`` cost before the tracking: every list read whole and
        compared with ``reuse``'s (``bench record``'s reference; the result is the same)."""
        return self._rebase(reuse)

    def changes(
        self, after: Mapping[str, Any], before: Mapping[str, Any]
    ) -> dict[str, list[int] | None] | None:
        """Which lists of ``after`` differ from ``before``'s and where (None for a list
        that changed whole; a list absent is the same object), if this builder made
        ``after`` from ``before``; None when it did not (then nothing is known)."""
        if after is self._last and before is self._base:
            return self._changes
        return None

    def patches(
        self, after: Mapping[str, Any], before: Mapping[str, Any]
    ) -> dict[str, list[Any]] | None:
        """The entries of ``after``'s lists set in place since ``before`` (``mirror``),
        each list's as [index, value, ...]; None where ``after`` was not built from
        ``before`` by this builder (then nothing was set in place)."""
        if after is self._last and before is self._base:
            return self._patches
        return None

    def delta(self, after: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any] | None:
        """The record's delta from ``before`` to ``after`` (``record.states.delta`` of
        the two with ``patches``), where this builder made ``after`` from ``before``
        with its lists shared (``mirror``) and none replaced: what a ``Batch`` does.
        None where the delta must walk the states instead."""
        if after is self._last and before is self._base:
            return self._delta
        return None

    def _assemble(self, lists: Mapping[str, list[Any]]) -> dict[str, Any]:
        core = self.core
        reduce = core.reduce
        open_, why = core.gate()
        # The key order is the record's: a record's first line holds the state whole.
        summary = {
            "phase": core.phase,
            "version": core.version,
            "global_step": core.global_step,
            "avg_count": core.avg_count,
            "steps": lists["steps"],
            "last_step_count": lists["last_step_count"],
            "acks": lists["acks"],
            "cpu_pending": reduce.in_flight,
            "rank_epoch": lists["rank_epoch"],
            "in_flight": lists["in_flight"],
            "dead": lists["dead"],
            "exited": lists["exited"],
            "throttled": lists["throttled"],
            "anchor": core.elche.anchor,
            "counts": lists["counts"],
            "last_aggregated": core.last_aggregated,
            "pools": core.dispatch.remaining(),
            "gate": {"open": open_, "why": why},
        }
        if reduce.wait_since is not None:
            # A tick that starts the wait changes nothing else: this makes the recorder
            # keep it, so a replay's ceiling counts from the same instant. Absent when
            # not waiting, as in records made before the wait existed.
            summary["window_wait_since"] = reduce.wait_since
        return summary

    def _rebase(self, reuse: Mapping[str, Any]) -> dict[str, Any]:
        """Every list read whole and compared with ``reuse``'s (an unknown base)."""
        sources = self._read_sources()
        lists: dict[str, list[Any]] = {}
        changes: dict[str, list[int] | None] = {}
        for key, copied, src in zip(KEYS, COPIED, sources, strict=True):
            was = reuse.get(key)
            now = src.copy() if copied else self.flagged(src)
            if was is not None and was == now:
                lists[key] = was
            else:
                lists[key] = now
                changes[key] = None
        for src in sources:
            if type(src) is Tracked:
                src.take()
        summary = self._assemble(lists)
        self._last, self._base, self._base_kept = summary, reuse, not changes
        self._sources, self._changes, self._patches = sources, changes, {}
        self._delta = self._vals = None
        return summary

    def _incremental(self, reuse: Mapping[str, Any], last: dict[str, Any]) -> dict[str, Any]:
        """Only the lists whose source was written since ``last`` (or replaced) read."""
        sources = self._read_sources()
        changed: dict[str, list[Any]] = {}
        changes: dict[str, list[int] | None] = {}
        patches: dict[str, list[Any]] = {}
        mirror = self.mirror
        touched: list[list[Any]] = []
        for key, copied, src, old in zip(KEYS, COPIED, sources, self._sources, strict=True):
            if src is old and type(src) is Tracked:
                marks = src.marks
                if not marks and not src.whole:
                    continue  # nothing written since: the common case
                touched.append(src)
                if copied and not src.whole:
                    # Only the written entries can differ: patch a copy of the last
                    # list there, and keep the last one if none did.
                    was = last[key]
                    if len(marks) == 1:  # a message's usual write: its own rank's entry
                        (i,) = marks
                        v = src[i]
                        if was[i] == v:
                            continue
                        if mirror:  # (as below, for one entry: a Batch's two lists)
                            was[i] = v
                            patches[key] = [i, v]
                        else:
                            now = was.copy()
                            now[i] = v
                            changed[key] = now
                        changes[key] = [i]
                        continue
                    at = sorted(i for i in marks if was[i] != src[i])
                    if at:
                        if mirror:
                            # Set in place: every summary since shares the list; the
                            # recorder takes the entries set, not a diff of two lists.
                            flat: list[Any] = []
                            for i in at:
                                was[i] = v = src[i]
                                flat += (i, v)
                            patches[key] = flat
                        else:
                            now = was.copy()
                            for i in at:
                                now[i] = src[i]
                            changed[key] = now
                        changes[key] = at
                    continue
            else:
                touched.append(src)
            was = last[key]
            # Replaced, not tracked, or changed as a whole: read whole and compare.
            now = src.copy() if copied else self.flagged(src)
            if now != was:
                changed[key] = now
                changes[key] = None
        # Every source was read as of now: what is written next is the next change.
        # (After all of them: one object the source of two lists is read by both.)
        for src in touched:
            if type(src) is Tracked:
                src.take()
        # The last summary (built here, so in the record's key order) with what moved.
        core = self.core
        reduce = core.reduce
        open_, why = core.gate()
        vals = (
            core.phase, core.version, core.global_step, core.avg_count, reduce.in_flight,
            core.elche.anchor, core.last_aggregated, core.dispatch.remaining(), open_, why,
        )  # fmt: skip
        summary = last.copy()
        read = self._vals
        # One C comparison says whether any scalar moved (most messages move none):
        # else the last summary's values, equal, stand.
        moved = read is None or vals != read
        if moved:
            (
                summary["phase"], summary["version"], summary["global_step"],
                summary["avg_count"], summary["cpu_pending"], summary["anchor"],
                summary["last_aggregated"], summary["pools"],
            ) = vals[:8]  # fmt: skip
            summary["gate"] = {"open": open_, "why": why}
        if changed:
            summary.update(changed)
        if reduce.wait_since is not None:
            summary["window_wait_since"] = reduce.wait_since  # the last key (_assemble)
        elif "window_wait_since" in summary:
            del summary["window_wait_since"]
        self._last, self._base, self._base_kept = summary, reuse, not changes
        self._sources, self._changes, self._patches = sources, changes, patches
        # Every list is shared with ``reuse`` (the last summary's, or a base's that stands
        # for it): only the scalars can differ, and the patches say where the lists did.
        self._delta = None
        if mirror and not changed:
            keys: tuple[str, ...] = SCALARS
            if reuse is last and read is not None:
                # The scalars to compare are those that moved since ``last`` (= ``reuse``).
                keys = OPTIONAL
                if moved:
                    keys = (*compress(_VAL_KEYS, map(ne, read, vals)), *OPTIONAL)
            self._delta = delta_shared(reuse, summary, keys, patches)
        self._vals = vals
        return summary
