"""Replay: re-feed a recorded run to fresh cores and compare (the read side of ``record``).

Sits above the cores: imports ``record``, ``bus``, ``protocol``, ``worker`` and
``coordinator``; nothing below imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from flodl_bus.replay.coordinator import CoordinatorReplay, config_from_header
from flodl_bus.replay.engine import Divergence, ReplayResult, brief, norm
from flodl_bus.replay.load import Recording, load_run, recording_from_records, save_run
from flodl_bus.replay.rank import RankReplay

__all__ = [
    "CoordinatorReplay",
    "Divergence",
    "RankReplay",
    "Recording",
    "ReplayResult",
    "brief",
    "config_from_header",
    "load_run",
    "norm",
    "recording_from_records",
    "replay",
    "replay_run",
    "save_run",
]


def replay(rec: Recording, *, explore: bool = False, until: float | None = None) -> ReplayResult:
    if rec.role == "coordinator":
        return CoordinatorReplay(rec, explore=explore, until=until).run()
    return RankReplay(rec, explore=explore).run()


def replay_run(
    run: str | Path | Mapping[str, Recording], *, role: str | None = None, explore: bool = False
) -> dict[str, ReplayResult]:
    recs = load_run(run) if isinstance(run, (str, Path)) else run
    keys = [role] if role is not None else list(recs)
    return {k: replay(recs[k], explore=explore) for k in keys}
