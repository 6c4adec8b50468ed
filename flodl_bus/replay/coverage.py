"""Whether a run trained every sample of every epoch exactly once, read off what it left.

Two witnesses that do not share code: ``metrics.csv`` (the ranks' own counts, from
their ``MetricsMsg``) and the coordinator's record (every range it sent a rank: a plan,
a plan riding an ``Update``, an ``ExtendPartition``). An epoch is covered once when the
ranks' counts add up to the epoch, and, where no dead rank was sent part of it, the
ranges sent tile the epoch (each position once) and each rank trained exactly what it
was sent. An epoch a rank died in cannot tile: what the dead rank had not trained was
sent again to the survivors. There the survivors' ranges must not overlap, each
survivor must have trained what it was sent, and everything they were not sent must be
what the dead rank trained before it died, by the coordinator's own count: the ``Batch``
messages it heard from that rank, plan by plan (flodl's rule: without progressive
dispatch, a dead rank's processed batches stay its own and the remainder goes to the
survivors; with it, the chunk it was in is forfeited whole and served again). The dead
rank never reported that epoch, so its part is not in ``metrics.csv``.

``tests/e2e`` assert with these; ``bench kill`` prints them.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from flodl_bus.record.log import read_records
from flodl_bus.replay.coordinator import config_from_header

Range = tuple[int, int]


def metrics_rows(run_dir: Path) -> list[dict[str, str]]:
    """``metrics.csv``'s rows, one an epoch (none when the file is not there yet)."""
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def epoch_samples(row: Mapping[str, str], world_size: int) -> list[int]:
    """Samples each rank reported for the epoch of ``row``."""
    return [int(row.get(f"samples_r{r}") or 0) for r in range(world_size)]


def coordinator_records(run_dir: Path) -> list[dict[str, Any]]:
    return read_records(run_dir / "coordinator.jsonl")


#: the record events whose ``out`` holds what the coordinator's core returned
_EMITTING = frozenset({"dispatch", "tick", "start", "send_failed"})


def emitted(recs: Sequence[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every output the coordinator's core returned, in order."""
    for rec in recs:
        if rec.get("event") in _EMITTING:
            yield from rec.get("out", ())


def sent_plans(recs: Sequence[Mapping[str, Any]]) -> dict[int, dict[int, list[Range]]]:
    """epoch -> rank -> every range the coordinator sent that rank to train."""
    out: dict[int, dict[int, list[Range]]] = defaultdict(lambda: defaultdict(list))
    current: dict[int, int] = {}
    for o in emitted(recs):
        if o.get("kind") != "Send":
            continue
        rank, msg = int(o["rank"]), o["msg"]
        plan = None
        if msg["type"] == "StartEpoch":
            plan = msg["plan"]
        elif msg["type"] == "Update" and msg.get("next_plan"):
            plan = msg["next_plan"]
        elif msg["type"] == "ExtendPartition":
            out[current[rank]][rank].append((msg["partition_offset"], msg["partition_size"]))
        if plan is not None:
            current[rank] = plan["epoch"]
            out[plan["epoch"]][rank].append((plan["partition_offset"], plan["partition_size"]))
    return out


def tiles(ranges: Sequence[Range], space: Sequence[Range]) -> bool:
    """True when ``ranges`` cover exactly the positions of ``space``, each once."""
    got = _positions(ranges)
    return sorted(got) == sorted(_positions(space)) and len(set(got)) == len(got)


def problems(
    run_dir: Path, world_size: int, epochs: int, *, dead: Collection[int] = ()
) -> list[str]:
    """What breaks "every sample of every epoch trained exactly once" (empty: nothing).

    ``dead``: ranks that died during the run (an epoch one of them was sent part of is
    checked as the module says: by what the coordinator heard it train)."""
    recs = coordinator_records(run_dir)
    if not recs or recs[0].get("event") != "run":
        return [f"{run_dir / 'coordinator.jsonl'}: no record with a run header"]
    cfg = config_from_header(recs[0])
    rows = metrics_rows(run_dir)
    found = [int(r["epoch"]) for r in rows]
    if found != list(range(epochs)):
        return [f"metrics.csv holds epochs {found}, not 0..{epochs - 1}"]
    plans = sent_plans(recs)
    credited = {r: dead_credit(recs, r, cfg.batch_size, cfg.is_progressive) for r in dead}
    out: list[str] = []
    for row in rows:
        e = int(row["epoch"])
        size = cfg.epoch_batches(e) * cfg.batch_size
        trained = epoch_samples(row, world_size)
        per_rank = plans.get(e, {})
        if any(r in per_rank for r in dead):
            out += _death_epoch(e, size, per_rank, trained, dead, credited)
            continue
        if sum(trained) != size:
            out.append(f"epoch {e}: the ranks trained {sum(trained)} samples of {size} {trained}")
        sent = [sum(s for _, s in per_rank.get(r, [])) for r in range(world_size)]
        if not tiles([rng for r in per_rank for rng in per_rank[r]], [(0, size)]):
            out.append(f"epoch {e}: the ranges sent do not cover the epoch exactly once")
        if trained != sent:
            out.append(f"epoch {e}: trained {trained}, sent {sent}")
    return out


def _positions(ranges: Sequence[Range]) -> list[int]:
    out: list[int] = []
    for off, size in ranges:
        out += range(off, off + size)
    return out


def _death_epoch(
    e: int,
    size: int,
    per_rank: Mapping[int, Sequence[Range]],
    trained: Sequence[int],
    dead: Collection[int],
    credited: Mapping[int, Mapping[int, int]],
) -> list[str]:
    """The checks of an epoch a rank of ``dead`` was sent part of (``problems``)."""
    out: list[str] = []
    survivors = [r for r in per_rank if r not in dead]
    theirs = _positions([rng for r in survivors for rng in per_rank[r]])
    if len(set(theirs)) != len(theirs):
        out.append(f"epoch {e}: the survivors were sent some samples twice")
    dead_ranges = [rng for r in dead for rng in per_rank.get(r, ())]
    if set(theirs) | set(_positions(dead_ranges)) != set(range(size)):
        out.append(f"epoch {e}: the ranges sent do not cover the epoch")
    for r in survivors:
        if trained[r] != sum(n for _, n in per_rank[r]):
            out.append(f"epoch {e}: survivor {r} trained {trained[r]} of what it was sent")
    kept = size - len(set(theirs))
    heard = sum(credited[r].get(e, 0) for r in dead)
    for r in dead:
        if trained[r] > credited[r].get(e, 0):
            out.append(f"epoch {e}: dead rank {r} reported {trained[r]}, more than it trained")
    if kept != heard:
        out.append(
            f"epoch {e}: the survivors were not sent {kept} samples, but the dead rank(s) "
            f"{sorted(dead)} trained {heard} of them"
        )
    return out


def dead_credit(
    recs: Sequence[Mapping[str, Any]], rank: int, batch_size: int, progressive: bool
) -> dict[int, int]:
    """epoch -> samples a rank that died keeps as trained, by the coordinator's count
    of its ``Batch`` messages, filled into the plans it was sent in order: every batch
    of a plan it finished; of the plan it died in, every batch processed unless the
    dispatch is progressive (then that chunk is forfeited and served again)."""
    plans: list[list[int]] = []  # [epoch, batches planned, batches heard]
    at = 0
    for rec in recs:
        if rec.get("event") == "dispatch":
            msg = rec.get("msg") or {}
            if msg.get("type") == "Batch" and msg.get("rank") == rank:
                while at < len(plans) and plans[at][2] >= plans[at][1]:
                    at += 1
                if at < len(plans):
                    plans[at][2] += 1
        for o in rec.get("out", ()) if rec.get("event") in _EMITTING else ():
            if o.get("kind") != "Send" or int(o.get("rank", -1)) != rank:
                continue
            msg = o["msg"]
            plan = msg.get("plan") if msg["type"] == "StartEpoch" else None
            if msg["type"] == "Update" and msg.get("next_plan"):
                plan = msg["next_plan"]
            if plan is not None:
                plans.append([plan["epoch"], plan["partition_size"] // batch_size, 0])
            elif msg["type"] == "ExtendPartition" and plans:
                plans[-1][1] += msg["partition_size"] // batch_size
    out: dict[int, int] = defaultdict(int)
    for epoch, planned, heard in plans:
        if heard >= planned or not progressive:
            out[epoch] += min(heard, planned) * batch_size
    return dict(out)


def shares(row: Mapping[str, str], world_size: int) -> list[float]:
    """Each rank's share of the samples of ``row``'s epoch."""
    trained = epoch_samples(row, world_size)
    total = sum(trained)
    return [n / total if total else 0.0 for n in trained]
