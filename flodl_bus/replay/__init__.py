"""Replay: re-feed a recorded run to fresh cores and compare (the read side of ``record``).

Sits above the cores: imports ``record``, ``bus``, ``protocol``, ``worker`` and
``coordinator``; nothing below imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flodl_bus.replay.coordinator import CoordinatorReplay, config_from_header
from flodl_bus.replay.engine import Divergence, ReplayResult, brief, norm
from flodl_bus.replay.load import (
    Recording,
    load_run,
    recording_from_records,
    save_run,
    verify_run,
)
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
    "verify_run",
]


def replay(
    rec: Recording,
    *,
    explore: bool = False,
    until: float | None = None,
    keep_actual: bool = True,
    allow_incomplete: bool = True,
    transport: str = "direct",
) -> ReplayResult:
    """Replay one process's record (see ``replay.engine``). ``until``: the coordinator's
    seconds since launch, a rank's own clock. ``keep_actual=False`` keeps only the
    verdict (bounded memory). ``transport``: ``direct`` (default; the bus's entry code
    alone, see ``replay.engine``) or ``fakeredis`` (the bus classes over fakeredis
    streams)."""
    kw: dict[str, Any] = {
        "explore": explore,
        "until": until,
        "keep_actual": keep_actual,
        "allow_incomplete": allow_incomplete,
        "transport": transport,
    }
    if rec.role == "coordinator":
        return CoordinatorReplay(rec, **kw).run()
    return RankReplay(rec, **kw).run()


def replay_run(
    run: str | Path | Mapping[str, Recording],
    *,
    role: str | None = None,
    explore: bool = False,
    verify: bool = True,
    keep_actual: bool = True,
) -> dict[str, ReplayResult]:
    """Replay every process of ``run`` (or one ``role``). A run read from disk is verified
    first (``verify_run``): a damaged, unchained or incomplete record raises."""
    recs = load_run(run) if isinstance(run, (str, Path)) else run
    if verify:
        verify_run(recs if role is None else {role: recs[role]}, whole=role is None)
    keys = [role] if role is not None else list(recs)
    return {k: replay(recs[k], explore=explore, keep_actual=keep_actual) for k in keys}
