"""Where a rank idles at averaging points, read off the coordinator's record.

The coordinator's record sees every rank on one clock: each ``Batch`` message (sent when
the rank finished a step, with the step's compute and data time), and each ``SyncNow``
broadcast. Between two consecutive batches of a rank, the time not spent on the second
batch is a gap: the rank was waiting (in a collective, for its next plan, in an eval, on
its bus). A gap that spans a ``SyncNow`` is idle at an averaging point; the others are
counted apart.

``averaging_idle`` sums both per rank over the run, beside each rank's median step time:
issue 19 asks that the fast rank wait no more than about one batch per averaging. The
figures carry each message's ingest delay (about the same for every rank on one host).

A wait at averaging has two parts. What every rank waits there (the shortest of the
ranks' gaps across that SyncNow) is the round itself: the trip to the coordinator and
back, the collective, an epoch's turn. What a rank waits beyond that is the time it
spent waiting for a peer to finish its window: ``peer_s``, the figure item 5 is about.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flodl_bus.record.log import read_records


@dataclass(frozen=True)
class Idle:
    syncs: int
    #: seconds each rank waited across a SyncNow, in all
    at_sync_s: tuple[float, ...]
    #: each rank's median wait across one SyncNow (seconds)
    median_sync_s: tuple[float, ...]
    #: seconds each rank waited between batches elsewhere (plans, evals, the bus)
    other_s: tuple[float, ...]
    #: each rank's median step (compute + data, seconds), the yardstick of the waits
    step_s: tuple[float, ...]
    #: seconds each rank waited at averaging beyond the rank that waited least, in all
    peer_s: tuple[float, ...] = ()
    #: each rank's median of that wait per SyncNow (seconds)
    median_peer_s: tuple[float, ...] = ()
    #: the part of ``peer_s`` at averagings that closed an epoch: there the epoch barrier
    #: (§6 #17) leaves a rank done with its share nothing it may train
    peer_epoch_end_s: tuple[float, ...] = ()


def _type(msg: Any) -> str | None:
    return msg.get("type") if isinstance(msg, Mapping) else None


def averaging_idle(records: Iterable[Mapping[str, Any]], world: int) -> Idle | None:
    """Each rank's gaps between batches, split by whether a SyncNow fell in them."""
    syncs: list[float] = []  # in record order, which is time order
    #: the syncs whose step also aggregated an epoch (the window ended with the epoch)
    epoch_end: set[int] = set()
    batches: list[list[tuple[float, float]]] = [[] for _ in range(world)]
    for rec in records:
        now = rec.get("now")
        if now is None:
            continue
        outs = {_type(o.get("msg")) for o in rec.get("out") or ()}
        if "SyncNow" in outs:
            if "EpochAggregated" in outs:
                epoch_end.add(len(syncs))
            syncs.append(float(now))
        msg = rec.get("msg")
        if _type(msg) != "Batch":
            continue
        assert isinstance(msg, Mapping)
        rank = msg.get("rank")
        if isinstance(rank, int) and 0 <= rank < world:
            step = (float(msg.get("batch_ms") or 0.0) + float(msg.get("data_ms") or 0.0)) / 1e3
            batches[rank].append((float(now), step))
    if not syncs or any(len(b) < 2 for b in batches):
        return None
    at_sync: list[list[float]] = [[] for _ in range(world)]
    other = [0.0] * world
    #: sync index -> each rank's gap across it (the first sync a gap spans)
    across: dict[int, list[float | None]] = {}
    for r, bs in enumerate(batches):
        bs.sort()
        for (prev, _), (cur, step) in itertools.pairwise(bs):
            gap = max(0.0, cur - prev - step)
            first = bisect.bisect_left(syncs, prev)
            if first < len(syncs) and syncs[first] < cur:
                at_sync[r].append(gap)
                across.setdefault(first, [None] * world)[r] = gap
            else:
                other[r] += gap
    peer: list[list[float]] = [[] for _ in range(world)]
    peer_end = [0.0] * world
    for i, gaps in across.items():
        known = [g for g in gaps if g is not None]
        if len(known) < world:
            continue
        least = min(known)
        for r, g in enumerate(known):
            peer[r].append(g - least)
            if i in epoch_end:
                peer_end[r] += g - least
    return Idle(
        syncs=len(syncs),
        at_sync_s=tuple(sum(g) for g in at_sync),
        median_sync_s=tuple(statistics.median(g) if g else 0.0 for g in at_sync),
        other_s=tuple(other),
        step_s=tuple(statistics.median(s for _, s in bs) for bs in batches),
        peer_s=tuple(sum(p) for p in peer),
        median_peer_s=tuple(statistics.median(p) if p else 0.0 for p in peer),
        peer_epoch_end_s=tuple(peer_end),
    )


def idle_of_run(run_dir: Path, world: int) -> Idle | None:
    found = sorted(run_dir.rglob("coordinator.jsonl*"))
    return averaging_idle(read_records(found[0]), world) if found else None


def describe(idle: Idle, train_s: float) -> Sequence[str]:
    lines = [f"idle between batches, {idle.syncs} SyncNow (coordinator's clock):"]
    for r in range(len(idle.step_s)):
        at, med, oth, step = (
            idle.at_sync_s[r],
            idle.median_sync_s[r],
            idle.other_s[r],
            idle.step_s[r],
        )
        per = f"{med / step:.1f} steps" if step > 0 else "-"
        lines.append(
            f"    rank {r}: at averaging {at:6.2f} s ({at / train_s:5.1%} of the run; median "
            f"{med * 1000:.2f} ms = {per}), elsewhere {oth:6.2f} s ({oth / train_s:5.1%}); "
            f"step {step * 1000:.2f} ms"
        )
        if idle.peer_s:
            peer, pmed = idle.peer_s[r], idle.median_peer_s[r]
            psteps = f"{pmed / step:.1f} steps" if step > 0 else "-"
            end = idle.peer_epoch_end_s[r] if idle.peer_epoch_end_s else 0.0
            lines.append(
                f"        of which waiting for a peer {peer:6.2f} s ({peer / train_s:5.1%}; "
                f"median {pmed * 1000:.2f} ms = {psteps}; {end:.2f} s at an epoch's end)"
            )
    return lines
