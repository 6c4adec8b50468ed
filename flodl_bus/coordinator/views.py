"""What several parts of the coordinator see of its core: the run's counters and its
controllers. Each part extends this with the rest of its own narrow view (a ``Protocol``
in its own module), so no part imports the core back (ARCHITECTURE.md).
"""

from __future__ import annotations

from typing import Protocol

from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.elche import ElChe
from flodl_bus.coordinator.guard import Guard
from flodl_bus.coordinator.meta import MetaController
from flodl_bus.coordinator.roles import Roles


class Controllers(Protocol):
    """The counters a round advances and a resume restores (written), and the run's
    controllers and settings (read)."""

    avg_count: int
    global_step: int
    version: int
    max_overshoot: int

    @property
    def ws(self) -> int: ...
    @property
    def config(self) -> CoordinatorConfig: ...
    @property
    def elche(self) -> ElChe: ...
    @property
    def guard(self) -> Guard: ...
    @property
    def meta(self) -> MetaController: ...
    @property
    def roles(self) -> Roles: ...
    @property
    def overshoot_auto(self) -> bool: ...
    def alive(self, r: int) -> bool: ...
