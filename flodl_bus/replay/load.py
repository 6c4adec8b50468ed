"""Loading a run's records: one ``Recording`` per process, verified line by line.

Imports ``record`` (the format) only; everything else in ``replay`` builds on this.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flodl_bus.record.log import DamagedRecord, dumps, read_records

RANK_CORE = frozenset({"dispatch", "take", "plan", "step", "closed"})
COORD_CORE = frozenset({"start", "dispatch", "tick", "send_failed", "declare_dead", "interrupt"})


@dataclass
class Recording:
    """One process's record: ``key`` is ``coordinator`` or ``rank:R``."""

    key: str
    header: dict[str, Any]
    #: every record with an ``i`` (core calls, and a rank's reads), in ``i`` order
    events: list[dict[str, Any]]
    #: free-form records (no ``i``), kept for tools that want them
    other: list[dict[str, Any]] = field(default_factory=list)

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
        """Everything, header first: what ``save`` writes."""
        return [self.header, *self.other, *self.events]


def recording_from_records(key: str, records: Iterable[dict[str, Any]]) -> Recording:
    """Split a process's records into header, core events and the rest.

    A rank's events are ordered by ``i`` (its reader and training threads share the
    counter but race to the file). The coordinator is one thread, so its file order is
    the order of events, and core calls it logged as free-form events (a ``start`` or
    ``send_failed`` without ``i``) keep their place.
    """
    header: dict[str, Any] = {}
    events: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    coordinator = key == "coordinator"
    for r in records:
        if r.get("event") == "run" and not header:
            header = r
        elif "i" in r or (coordinator and r.get("event") in COORD_CORE):
            events.append(r)
        else:
            other.append(r)
    if not coordinator:
        events.sort(key=lambda e: e["i"])
    numbered = sorted(e["i"] for e in events if "i" in e)
    if numbered and numbered != list(range(numbered[0], numbered[0] + len(numbered))):
        missing = sorted(set(range(numbered[0], numbered[-1] + 1)) - set(numbered))
        raise DamagedRecord(
            f"record of {key} misses core events i={missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}: it cannot be replayed as a whole"
        )
    return Recording(key=key, header=header, events=events, other=other)


def _key_of(path: Path) -> str | None:
    name = path.name
    for suffix in (".jsonl.gz", ".jsonl"):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            if stem == "coordinator":
                return "coordinator"
            if stem.startswith("rank") and stem[4:].isdigit():
                return f"rank:{int(stem[4:])}"
    return None


def load_run(run_dir: str | Path) -> dict[str, Recording]:
    """Every process record of ``run_dir`` (``coordinator.jsonl``, ``rank<r>.jsonl``,
    gzipped or not), keyed ``coordinator`` / ``rank:R`` in that order."""
    found: dict[str, Recording] = {}
    for path in sorted(Path(run_dir).iterdir()):
        key = _key_of(path)
        if key is not None and key not in found:
            found[key] = recording_from_records(key, read_records(path))

    def order(k: str) -> tuple[bool, int]:
        return (k != "coordinator", int(k[5:]) if k != "coordinator" else 0)

    return {k: found[k] for k in sorted(found, key=order)}


def save_run(run: Mapping[str, Recording], run_dir: str | Path, *, gzip: bool = False) -> Path:
    """Write ``run`` as a run directory (e.g. a surgically changed copy)."""
    import gzip as gz

    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    for key, rec in run.items():
        name = "coordinator" if key == "coordinator" else f"rank{key.split(':')[1]}"
        data = b"".join(dumps(r) + b"\n" for r in rec.records())
        if gzip:
            (out / f"{name}.jsonl.gz").write_bytes(gz.compress(data, mtime=0))
        else:
            (out / f"{name}.jsonl").write_bytes(data)
    return out
