"""Checkpoint meta with coverage (reference §4.14.3) and its validation on resume."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flodl_bus.coordinator.chunk_pool import Range, coalesce
from flodl_bus.coordinator.config import CoordinatorConfig

SCHEMA = 5


def coverage_block(
    config: CoordinatorConfig, next_epoch: int, epochs: Sequence[tuple[int, Sequence[Range]]]
) -> dict[str, Any]:
    return {
        "seed": config.seed,
        "epoch_splits": config.epoch_splits,
        "batch_size": config.batch_size,
        "total_samples": config.total_samples,
        "augment": config.augment,
        #: epochs >= next_epoch were never started (fully uncovered)
        "next_epoch": next_epoch,
        "epochs": [
            {"epoch": e, "uncovered": [[o, s] for o, s in coalesce(holes)]} for e, holes in epochs
        ],
    }


@dataclass(frozen=True, slots=True)
class Resume:
    start_epoch: int
    #: epoch -> ranges still to train; epochs absent and >= next_epoch train in full
    holes: dict[int, list[Range]]
    global_step: int
    sync_round: int
    version: int
    elche_state: Mapping[str, Any] | None
    trend_history: list[float]


def read_meta(config: CoordinatorConfig, meta: Mapping[str, Any]) -> Resume:
    """Validate a meta dict against ``config``; a mismatch is a loud ``ValueError``."""
    schema = meta.get("schema")
    if schema != SCHEMA:
        raise ValueError(f"checkpoint meta schema {schema!r} is not {SCHEMA}; cannot resume")
    cov = meta.get("coverage")
    if not isinstance(cov, Mapping):
        raise ValueError("checkpoint meta has no coverage block; cannot resume")
    for key in ("seed", "epoch_splits", "batch_size", "total_samples", "augment"):
        if cov.get(key) != getattr(config, key):
            raise ValueError(
                f"checkpoint coverage {key}={cov.get(key)!r} does not match this run's "
                f"{key}={getattr(config, key)!r}; resume with the same {key}"
            )
    holes: dict[int, list[Range]] = {}
    for entry in cov.get("epochs", []):
        holes[int(entry["epoch"])] = [(int(o), int(s)) for o, s in entry["uncovered"]]
    next_epoch = int(cov.get("next_epoch", 0))
    start = next_epoch
    for e in sorted(holes):
        if holes[e]:
            start = e
            break
    # Epochs below ``next_epoch`` that are not listed were fully trained and aggregated.
    for e in range(start, next_epoch):
        holes.setdefault(e, [])
    elche = meta.get("elche_state")
    return Resume(
        start_epoch=start,
        holes={e: h for e, h in holes.items() if e >= start},
        global_step=int(meta.get("global_step", 0)),
        sync_round=int(meta.get("sync_round", 0)),
        version=int(meta.get("version", meta.get("sync_round", 0))),
        elche_state=elche if isinstance(elche, Mapping) else None,
        trend_history=[float(x) for x in (elche or {}).get("trend_history", [])],
    )
