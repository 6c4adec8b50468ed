"""What the coordinator core asks its runtime to do. Plain frozen values, no behaviour."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from flodl_bus.protocol.messages import ControlWire, SaveReason


@dataclass(frozen=True, slots=True)
class Send:
    """Unicast ``msg`` on ``ctl:<rank>``."""

    rank: int
    msg: ControlWire


@dataclass(frozen=True, slots=True)
class Broadcast:
    """``msg`` to every rank (``ctl:all``), in the same order as the unicasts around it."""

    msg: ControlWire


@dataclass(frozen=True, slots=True)
class WriteMeta:
    """Write ``meta`` as JSON to ``<save_path>.meta.json`` (before any save broadcast)."""

    meta: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Alert:
    level: str
    event: str
    detail: str


@dataclass(frozen=True, slots=True)
class Finished:
    """The run is over: ``Shutdown`` (reason None) or ``ShutdownWithSave`` was broadcast."""

    reason: SaveReason | None


Out: TypeAlias = Send | Broadcast | WriteMeta | Alert | Finished
