"""NCCL re-rendezvous bookkeeping after a death (reference §4.15.3)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Rendezvous:
    """The generator asked for a fresh NCCL id, and who was already tried."""

    generator: int | None = None
    started_at: float = 0.0
    tried: list[int] = field(default_factory=list)

    @property
    def pending(self) -> bool:
        return self.generator is not None

    def reset(self) -> None:
        self.generator = None
        self.tried.clear()
