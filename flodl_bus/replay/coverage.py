"""Whether a run trained every sample of every epoch exactly once, read off what it left.

Two witnesses that do not share code: ``metrics.csv`` (the ranks' own counts, from
their ``MetricsMsg``) and the coordinator's record (every range it sent a rank: a plan,
a plan riding an ``Update``, an ``ExtendPartition``). An epoch is covered once when the
ranks' counts add up to the epoch, and, where no dead rank was sent part of it, the
ranges sent tile the epoch (each position once) and each rank trained exactly what it
was sent. An epoch a rank died in cannot tile: the dead rank's unfinished range was
sent again to the survivors; its counts must still add up (nothing lost, nothing
counted twice), and the dead rank cannot have trained more than it was sent.

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


def emitted(recs: Sequence[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every output the coordinator's core returned, in order."""
    for rec in recs:
        if rec.get("event") in ("dispatch", "tick", "start", "send_failed"):
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
    got: list[int] = []
    for off, size in ranges:
        got += range(off, off + size)
    want: list[int] = []
    for off, size in space:
        want += range(off, off + size)
    return sorted(got) == sorted(want) and len(set(got)) == len(got)


def problems(
    run_dir: Path, world_size: int, epochs: int, *, dead: Collection[int] = ()
) -> list[str]:
    """What breaks "every sample of every epoch trained exactly once" (empty: nothing).

    ``dead``: ranks that died during the run (their epochs are checked by counts)."""
    recs = coordinator_records(run_dir)
    if not recs or recs[0].get("event") != "run":
        return [f"{run_dir / 'coordinator.jsonl'}: no record with a run header"]
    cfg = config_from_header(recs[0])
    rows = metrics_rows(run_dir)
    found = [int(r["epoch"]) for r in rows]
    if found != list(range(epochs)):
        return [f"metrics.csv holds epochs {found}, not 0..{epochs - 1}"]
    plans = sent_plans(recs)
    out: list[str] = []
    for row in rows:
        e = int(row["epoch"])
        size = cfg.epoch_batches(e) * cfg.batch_size
        trained = epoch_samples(row, world_size)
        if sum(trained) != size:
            out.append(f"epoch {e}: the ranks trained {sum(trained)} samples of {size} {trained}")
        per_rank = plans.get(e, {})
        sent = [sum(s for _, s in per_rank.get(r, [])) for r in range(world_size)]
        if any(r in per_rank for r in dead):
            over = [r for r in dead if trained[r] > sent[r]]
            if over:
                out.append(f"epoch {e}: dead rank(s) {over} trained more than they were sent")
            continue
        if not tiles([rng for r in per_rank for rng in per_rank[r]], [(0, size)]):
            out.append(f"epoch {e}: the ranges sent do not cover the epoch exactly once")
        if trained != sent:
            out.append(f"epoch {e}: trained {trained}, sent {sent}")
    return out


def shares(row: Mapping[str, str], world_size: int) -> list[float]:
    """Each rank's share of the samples of ``row``'s epoch."""
    trained = epoch_samples(row, world_size)
    total = sum(trained)
    return [n / total if total else 0.0 for n in trained]
