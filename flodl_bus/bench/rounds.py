"""How long an averaging round takes and where, read off the coordinator's record.

The coordinator's record dates every message it read and every one it sent on its one
clock. A round opens with its ``RequestParams`` (the CPU plane) or ``SyncNow`` (NCCL). The
CPU plane's closes with the first ``Update`` the coordinator sends after the ``SyncAck``s;
NCCL's with the last rank's ``SyncAck`` (its ranks adopted the average in place, and no
``Update`` follows). In between:

* ``snapshots``: to the last rank's ``SnapshotReady`` (CPU plane only): the trip to the
  ranks, the step each finishes before it snapshots, the averaging thread's report;
* ``reduce``: from there (NCCL: from the open) to the last ``SyncAck``: the collectives,
  the divergence pass and the ack's trip back; on the CPU plane the slowest rank sets it;
* ``close``: from the last ack to the ``Update``: the coordinator's own turn (CPU plane).

A rank that trains through the round (cpu-cadence's ``--overlap-rounds``) waits for a
round only when its window is full before the round closes: a round longer than a window
is what the breakdown's epoch and plan waits then show (BENCHMARKS.md, issue 27).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flodl_bus.record.log import read_records

#: what opens a round, by plane
OPENS = frozenset({"RequestParams", "SyncNow"})


@dataclass(frozen=True)
class RoundPhases:
    """Medians over a run's rounds, in seconds (``snapshots``, ``close``: None on NCCL)."""

    rounds: int
    round_s: float
    snapshots_s: float | None
    reduce_s: float
    close_s: float | None


def _type(msg: Any) -> str | None:
    return msg.get("type") if isinstance(msg, Mapping) else None


class _Rounds:
    """The round in flight and the phases of those closed."""

    def __init__(self) -> None:
        self.opened: float | None = None
        self.nccl = False
        self.snap: float | None = None
        self.acked: dict[int, float] = {}
        self.rows: list[tuple[float, float | None, float, float | None]] = []

    def open(self, now: float, nccl: bool) -> None:
        # A round still open here lost a rank to a death: it is dropped.
        self.opened, self.nccl, self.snap, self.acked = now, nccl, None, {}

    def close(self, now: float, at_ack: bool) -> None:
        if self.opened is None:
            return
        last_ack = max(self.acked.values(), default=now)
        start = self.opened if self.snap is None else self.snap
        self.rows.append(
            (
                now - self.opened,
                None if self.snap is None else self.snap - self.opened,
                last_ack - start,
                None if at_ack else now - last_ack,
            )
        )
        self.opened = None


def round_phases(records: Iterable[Mapping[str, Any]]) -> RoundPhases | None:
    """The phases of every round a coordinator's record holds (None: no round closed)."""
    world = 0
    dead: set[int] = set()
    r = _Rounds()
    for rec in records:
        if rec.get("event") == "run":
            world = int((rec.get("config") or {}).get("world_size") or 0)
            continue
        now = rec.get("now")
        if now is None or rec.get("event") not in ("dispatch", "tick", "start"):
            continue
        now = float(now)
        changed = rec.get("changed")
        if isinstance(changed, Mapping) and isinstance(changed.get("dead"), list):
            dead = {int(d) for d in changed["dead"]}
        msg = rec.get("msg")
        kind = _type(msg)
        if r.opened is not None and kind == "SnapshotReady":
            r.snap = now
        elif r.opened is not None and kind == "SyncAck" and isinstance(msg, Mapping):
            r.acked[int(msg.get("rank", -1))] = now
            if r.nccl and world and len(r.acked.keys() - dead) >= world - len(dead):
                r.close(now, at_ack=True)
        sent = {_type(o.get("msg")) for o in rec.get("out") or () if isinstance(o, Mapping)}
        if r.opened is not None and not r.nccl and "Update" in sent:
            r.close(now, at_ack=False)
        if sent & OPENS:
            r.open(now, nccl="SyncNow" in sent)
    rows = r.rows
    if not rows:
        return None
    snaps = [row[1] for row in rows if row[1] is not None]
    closes = [row[3] for row in rows if row[3] is not None]
    return RoundPhases(
        rounds=len(rows),
        round_s=statistics.median(row[0] for row in rows),
        snapshots_s=statistics.median(snaps) if snaps else None,
        reduce_s=statistics.median(row[2] for row in rows),
        close_s=statistics.median(closes) if closes else None,
    )


def rounds_of_run(run_dir: Path) -> RoundPhases | None:
    """The phases of a run's rounds from its coordinator's record (None without one)."""
    found = sorted(run_dir.rglob("coordinator.jsonl*"))
    return round_phases(read_records(found[0])) if found else None


def describe(name: str, phases: RoundPhases) -> str:
    ms = 1000.0
    snap = (
        ""
        if phases.snapshots_s is None
        else f"to every SnapshotReady {phases.snapshots_s * ms:.1f}, "
    )
    close = "" if phases.close_s is None else f", to the Update {phases.close_s * ms:.1f}"
    return (
        f"{name:<24} {phases.rounds} rounds of {phases.round_s * ms:.1f} ms: {snap}"
        f"collectives to every SyncAck {phases.reduce_s * ms:.1f}{close} "
        "(medians, coordinator's clock)"
    )
