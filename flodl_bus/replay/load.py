"""Loading a run's records: one ``Recording`` per process, verified before it is trusted.

A ``Recording`` read from disk keeps only its header in memory: ``stream()`` walks its
core events straight from the file (verifying the digest chain as it goes, a rank's
events put back in ``i`` order through a bounded window), so a replay's memory does not
grow with the record. ``events`` loads the whole record on first use, for tools that
change it (surgery) or inspect it (tests); a replay of a changed recording walks that
list instead of the file.

``verify_run`` is the check before any comparison: every line's digest, the end record,
the headers against the file names and each other (``record.chain`` for the format).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flodl_bus.record import chain, states
from flodl_bus.record.chain import DamagedRecord, IncompleteRecord, UnchainedRecord
from flodl_bus.record.log import dumps

RANK_CORE = frozenset({"dispatch", "take", "plan", "step", "closed"})
COORD_CORE = frozenset({"start", "dispatch", "tick", "send_failed", "declare_dead", "interrupt"})
#: How far a rank's events may stand out of ``i`` order in its file (its reader and
#: training threads race to the file by a line or two); a hole wider than this is a
#: missing event.
REORDER_WINDOW = 4096
#: events read before a rank's first ``i`` is taken as the smallest
_START_WINDOW = 64

__all__ = [
    "COORD_CORE",
    "RANK_CORE",
    "DamagedRecord",
    "IncompleteRecord",
    "Recording",
    "UnchainedRecord",
    "load_run",
    "recording_from_records",
    "save_run",
    "verify_run",
]


def _is_event(key: str, rec: Mapping[str, Any]) -> bool:
    return "i" in rec or (key == "coordinator" and rec.get("event") in COORD_CORE)


def _ordered(
    key: str, records: Iterable[Mapping[str, Any]], where: str, *, tolerate_end_gap: bool
) -> Iterator[dict[str, Any]]:
    """The records that are events, in replay order: the coordinator's in file order (one
    thread; core calls it logged without ``i`` keep their place) with whole states
    (``record.states.expand``), a rank's by ``i``."""
    if key == "coordinator":
        try:
            yield from states.expand(_numbered(key, records, where))
        except states.BadDelta as exc:
            raise DamagedRecord(where, 0, f"the record of {key}: {exc}") from None
        return
    heap: list[tuple[int, int, dict[str, Any]]] = []
    order = itertools.count()
    expected: int | None = None
    for rec in records:
        if "i" not in rec:
            continue
        heapq.heappush(heap, (int(rec["i"]), next(order), dict(rec)))
        if expected is None:
            if len(heap) < _START_WINDOW:
                continue
            expected = heap[0][0]
        while heap and heap[0][0] <= expected:
            yield heapq.heappop(heap)[2]
            expected += 1
        if len(heap) > REORDER_WINDOW:
            raise _missing(key, where, [expected])
    if expected is None and heap:
        expected = heap[0][0]
    while heap:
        i, _, rec = heapq.heappop(heap)
        if expected is not None and i != expected:
            if tolerate_end_gap:
                return  # the process died between numbering an event and writing it
            raise _missing(key, where, list(range(expected, i)))
        yield rec
        expected = i + 1


def _numbered(
    key: str, records: Iterable[Mapping[str, Any]], where: str
) -> Iterator[dict[str, Any]]:
    """The coordinator's events in file order (one thread; core calls it logged without
    ``i`` keep their place), every ``i`` one above the last."""
    last: int | None = None
    for rec in records:
        if not _is_event(key, rec):
            continue
        i = rec.get("i")
        if isinstance(i, int):
            if last is not None and i != last + 1:
                raise _missing(key, where, list(range(last + 1, i)))
            last = i
        yield dict(rec)


def _missing(key: str, where: str, missing: list[int]) -> DamagedRecord:
    more = "..." if len(missing) > 5 else ""
    return DamagedRecord(
        where,
        0,
        f"the record of {key} misses core events i={missing[:5]}{more}: it "
        "cannot be replayed as a whole",
    )


class Recording:
    """One process's record: ``key`` is ``coordinator`` or ``rank:R``."""

    def __init__(
        self,
        key: str,
        header: dict[str, Any],
        events: list[dict[str, Any]] | None = None,
        other: list[dict[str, Any]] | None = None,
        *,
        path: Path | None = None,
    ) -> None:
        if events is None and path is None:
            raise ValueError("a Recording needs its events or the path of its record")
        self.key = key
        self.header = header
        self.path = path
        self._events = events
        self._other = other if other is not None or path is not None else []

    # -- whole record in memory (surgery, inspection)

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every record with an ``i`` (core calls, a rank's reads), in replay order."""
        if self._events is None:
            self._load()
        assert self._events is not None
        return self._events

    @events.setter
    def events(self, value: list[dict[str, Any]]) -> None:
        self._events = value

    @property
    def other(self) -> list[dict[str, Any]]:
        """Free-form records (no ``i``), the end record among them."""
        if self._other is None:
            self._load()
        assert self._other is not None
        return self._other

    @other.setter
    def other(self, value: list[dict[str, Any]]) -> None:
        self._other = value

    def _load(self) -> None:
        assert self.path is not None
        records = [r for _, r in chain.verified_lines(self.path) if r is not None]
        rest = records[1:]
        other = [r for r in rest if not _is_event(self.key, r)]
        events = list(_ordered(self.key, rest, str(self.path), tolerate_end_gap=True))
        if self._events is None:
            self._events = events
        if self._other is None:
            self._other = other

    @property
    def loaded(self) -> bool:
        return self._events is not None

    # -- streaming (replay)

    def stream(self, *, allow_incomplete: bool = True) -> Iterator[dict[str, Any]]:
        """The events in replay order: the in-memory list once loaded (or changed), else
        straight from the file, verified as read."""
        if self._events is not None:
            yield from self._events
            return
        assert self.path is not None
        lines = (r for _, r in chain.verified_lines(self.path) if r is not None)
        next(lines, None)  # the header
        yield from _ordered(self.key, lines, str(self.path), tolerate_end_gap=allow_incomplete)

    @property
    def role(self) -> str:
        return "coordinator" if self.key == "coordinator" else "rank"

    @property
    def rank(self) -> int | None:
        return None if self.key == "coordinator" else int(self.key.split(":")[1])

    def core_events(self) -> list[dict[str, Any]]:
        kinds = COORD_CORE if self.role == "coordinator" else RANK_CORE
        return [e for e in self.events if e.get("event") in kinds]

    def records(self) -> list[dict[str, Any]]:
        """Everything, header first and the end record last: what ``save_run`` writes."""
        ends = [r for r in self.other if r.get("event") == "end"]
        rest = [r for r in self.other if r.get("event") != "end"]
        return [self.header, *rest, *self.events, *ends]

    def __deepcopy__(self, memo: dict[int, Any]) -> Recording:
        import copy

        return Recording(
            self.key,
            copy.deepcopy(self.header, memo),
            copy.deepcopy(self.events, memo),
            copy.deepcopy(self.other, memo),
            path=self.path,
        )


def recording_from_records(key: str, records: Iterable[dict[str, Any]]) -> Recording:
    """A ``Recording`` from a process's records in file order (header first)."""
    listed = list(records)
    header = listed[0] if listed and listed[0].get("event") == "run" else {}
    rest = listed[1:] if header else listed
    other = [r for r in rest if not _is_event(key, r)]
    events = list(_ordered(key, rest, key, tolerate_end_gap=False))
    return Recording(key, header, events, other)


def _key_of(path: Path) -> str | None:
    name = path.name
    for suffix in chain.SUFFIXES:
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            if stem == "coordinator":
                return "coordinator"
            if stem.startswith("rank") and stem[4:].isdigit():
                return f"rank:{int(stem[4:])}"
    return None


def _files(run_dir: str | Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(Path(run_dir).iterdir()):
        key = _key_of(path)
        if key is None:
            continue
        if key in found:
            raise DamagedRecord(
                path, 0, f"a second record of {key} beside {found[key].name}: keep one"
            )
        found[key] = path

    def order(k: str) -> tuple[bool, int]:
        return (k != "coordinator", int(k[5:]) if k != "coordinator" else 0)

    return {k: found[k] for k in sorted(found, key=order)}


def _header(key: str, path: Path) -> dict[str, Any]:
    for number, rec in chain.verified_lines(path):
        if rec is None or rec.get("event") != "run":
            raise DamagedRecord(path, number, "the first line is not the run header")
        role = rec.get("role")
        want_role = "coordinator" if key == "coordinator" else "rank"
        if role is not None and role != want_role:
            raise DamagedRecord(path, 1, f"the header says role {role!r}; the file is {key}'s")
        rank = rec.get("rank")
        if key != "coordinator" and rank is not None and f"rank:{rank}" != key:
            raise DamagedRecord(path, 1, f"the header says rank {rank}; the file is {key}'s")
        return rec
    return {}


def load_run(run_dir: str | Path) -> dict[str, Recording]:
    """Every process record of ``run_dir`` (``coordinator.jsonl[.zst|.gz]``,
    ``rank<r>.jsonl[.zst|.gz]``), keyed ``coordinator`` / ``rank:R`` in that order. Only
    headers are read here; see ``Recording``."""
    return {k: Recording(k, _header(k, p), path=p) for k, p in _files(run_dir).items()}


@dataclass(frozen=True)
class Verified:
    """What ``verify_run`` found of one record."""

    key: str
    path: Path
    lines: int
    complete: bool


class MissingRecords(ValueError):
    """A run directory without a record its other records name (a deleted coordinator
    record beside its ranks', a rank of its world): what is there cannot stand for the
    run, however well it verifies."""

    def __init__(self, run_dir: str | Path, missing: Iterable[str], why: str) -> None:
        names = ", ".join(missing)
        super().__init__(f"{run_dir}: no record of {names} ({why}): the run is not whole")
        self.missing = tuple(missing)


def missing_roles(run: Mapping[str, Recording]) -> tuple[list[str], str]:
    """The processes ``run``'s own records name but that have no record in it, and what
    named them: the coordinator's world size (or a rank's, without the coordinator's
    record), and ``up.jsonl``'s worker count beside them."""
    expected: set[str] = set()
    why: list[str] = []
    coord = run.get("coordinator")
    config = coord.header.get("config") if coord is not None else None
    ws = config.get("world_size") if isinstance(config, Mapping) else None
    if isinstance(ws, int):
        why.append(f"the coordinator's world of {ws}")
    else:
        sizes = {r.header.get("world_size") for k, r in run.items() if k != "coordinator"}
        sizes.discard(None)
        if len(sizes) == 1 and isinstance(next(iter(sizes)), int):
            ws = next(iter(sizes))
            why.append(f"the ranks' world of {ws}")
    if coord is None and any(
        r.header.get("coordinated") or "settings" in r.header for r in run.values()
    ):
        # a rank started by ``flodl-bus worker`` says a coordinator drove it (records made
        # before it said so carry the run's settings, which only that command records);
        # a rank driven by hand (a test's script) does neither
        expected.add("coordinator")
        why.append("rank records of a coordinated run beside it")
    paths = [r.path for r in run.values() if r.path is not None]
    if paths:
        up = Path(paths[0]).parent / "up.jsonl"
        if up.exists():
            try:
                first = next((rec for _, rec in chain.verified_lines(up)), None)
            except DamagedRecord:
                first = None
            workers = first.get("workers") if isinstance(first, dict) else None
            if isinstance(workers, int) and (ws is None or workers > ws):
                ws = workers
                why.append(f"up.jsonl's {workers} workers")
            expected.add("coordinator")
    if isinstance(ws, int):
        expected.update(f"rank:{r}" for r in range(ws))
    order = sorted(expected - set(run), key=lambda k: (k != "coordinator", len(k), k))
    return order, ", ".join(why)


def verify_run(
    run: Mapping[str, Recording], *, allow_incomplete: bool = False, whole: bool = True
) -> dict[str, Verified]:
    """Check every record of ``run`` before it is replayed: ``DamagedRecord`` (a line
    edited, removed, moved, not JSON; headers that disagree with the files or with each
    other), ``UnchainedRecord``, ``IncompleteRecord`` (no end record, unless
    ``allow_incomplete``); ``whole``: ``run`` stands for its directory, which must hold
    every record its records name (``MissingRecords``, unless ``allow_incomplete``)."""
    out: dict[str, Verified] = {}
    for key, rec in run.items():
        if rec.path is None:
            continue
        st = chain.check(rec.path, allow_incomplete=allow_incomplete)
        out[key] = Verified(key, chain.resolve(rec.path), st.lines, st.ended)
    _check_headers(run)
    # After the damage checks: a record that lies is named before one that is absent.
    if whole and not allow_incomplete:
        missing, why = missing_roles(run)
        if missing:
            first = next((r.path for r in run.values() if r.path is not None), "")
            raise MissingRecords(Path(first).parent if first else "the run", missing, why)
    return out


def _check_headers(run: Mapping[str, Recording]) -> None:
    runs = {k: r.header.get("run") for k, r in run.items() if r.header.get("run") is not None}
    if len(set(runs.values())) > 1:
        named = ", ".join(f"{k}: {v}" for k, v in runs.items())
        first = next(iter(run.values()))
        raise DamagedRecord(first.path or "", 1, f"the records are of different runs ({named})")
    coord = run.get("coordinator")
    config = coord.header.get("config") if coord is not None else None
    ws = config.get("world_size") if isinstance(config, Mapping) else None
    if ws is None:
        return
    for key, rec in run.items():
        if key == "coordinator":
            continue
        rank_ws = rec.header.get("world_size")
        if rank_ws is not None and rank_ws != ws and rec.header.get("join") is None:
            raise DamagedRecord(
                rec.path or key,
                1,
                f"the header says world_size {rank_ws}; the coordinator's says {ws}",
            )
        if rec.rank is not None and not 0 <= rec.rank < ws:
            raise DamagedRecord(rec.path or key, 1, f"rank {rec.rank} of a world of {ws}")


def save_run(run: Mapping[str, Recording], run_dir: str | Path, *, compress: bool = False) -> Path:
    """Write ``run`` as a run directory (e.g. a surgically changed copy), each record in
    a fresh digest chain: the copy verifies, and replay compares what was changed."""
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Re-chained under the record key when one is set: its holder may rewrite on purpose.
    record_key = chain.record_key()
    for key, rec in run.items():
        name = "coordinator" if key == "coordinator" else f"rank{key.split(':')[1]}"
        path = out / f"{name}.jsonl{'.zst' if compress else ''}"
        path.unlink(missing_ok=True)
        # The sink seals each line into the new chain, in order.
        sink = chain.open_sink(path, key=record_key)
        for r in rec.records():
            sink.write(dumps({k: v for k, v in r.items() if k != "d"}))
        sink.close()
    return out
