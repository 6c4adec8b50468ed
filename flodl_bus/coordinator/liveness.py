"""Liveness (reference §4.15): who is alive, who left, who died, and the re-rendezvous.

``Liveness`` holds the per-rank facts and answers the questions the core's death rules
ask (who went silent, can the survivors go on, who generates the next group id). The
rules themselves, which also touch dispatch and the reduce, are the core's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress

from flodl_bus.coordinator.config import MaxFailure
from flodl_bus.coordinator.tracked import Tracked
from flodl_bus.protocol.messages import SaveReason


@dataclass(slots=True)
class Rendezvous:
    """The generator asked for a fresh NCCL id, and who was already tried."""

    generator: int | None = None
    started_at: float = 0.0
    tried: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.generator = None
        self.tried.clear()


class Liveness:
    def __init__(self, world_size: int) -> None:
        ws = world_size
        self.last_heartbeat = [0.0] * ws
        #: said Exiting (a clean leave)
        self.exited = Tracked([False] * ws)
        #: declared dead (silent, reported, or left mid-run): never resurrected
        self.dead = Tracked([False] * ws)
        self.active_count = ws
        #: neither exited nor dead
        self.alive = [True] * ws
        #: bumped on every change of ``alive`` (caches keyed on it)
        self.generation = 0
        self.rendezvous = Rendezvous()
        self._alive_ranks: tuple[int, list[int]] | None = None

    def alive_ranks(self) -> list[int]:
        """The live ranks in order (not to be mutated): kept until ``alive`` changes, so a
        walk over the ranks that could owe work skips the dead at no cost per call."""
        cached = self._alive_ranks
        if cached is None or cached[0] != self.generation:
            cached = self._alive_ranks = (
                self.generation,
                list(compress(range(len(self.alive)), self.alive)),
            )
        return cached[1]

    def heard_from(self, r: int, now: float) -> None:
        # Any frame is proof of life (§2.3).
        self.last_heartbeat[r] = now

    def heard_ago(self, now: float) -> list[float]:
        """Seconds since each rank was last heard (a verified entry), to 0.1 s: what
        ``status`` shows and a stall dump names."""
        return [round(max(0.0, now - t), 1) for t in self.last_heartbeat]

    def mark_exited(self, r: int) -> bool:
        """``r`` left cleanly; False if it already had."""
        if self.exited[r]:
            return False
        self.exited[r] = True
        self._gone(r)
        return True

    def mark_dead(self, r: int) -> None:
        self.dead[r] = True
        self._gone(r)

    def _gone(self, r: int) -> None:
        self.alive[r] = False
        self.generation += 1
        self.active_count = max(self.active_count - 1, 0)

    def silent(self, now: float, timeout: float) -> list[int]:
        """Live ranks not heard from for longer than ``timeout`` seconds."""
        # Every tick asks, over every rank: the oldest live heartbeat (found at C speed)
        # answers "none" for all of them, as ``now - t`` only grows as ``t`` falls.
        oldest = min(compress(self.last_heartbeat, self.alive), default=None)
        if oldest is None or not now - oldest > timeout:
            return []
        return [r for r, a in enumerate(self.alive) if a and now - self.last_heartbeat[r] > timeout]

    def unrecoverable(
        self, max_failure: MaxFailure | None, min_survivors: int
    ) -> SaveReason | None:
        """Why the survivors cannot go on, or None if they can."""
        dead = sum(self.dead)
        survivors = sum(self.alive)
        if max_failure is not None and max_failure.breached(dead, len(self.alive)):
            return SaveReason.MAX_FAILURE_EXCEEDED
        if survivors < min_survivors:
            return SaveReason.SINGLE_SURVIVOR if min_survivors > 1 else SaveReason.ALL_RANKS_LOST
        return None

    def next_generator(self, now: float, smoothed_ms: Callable[[int], float | None]) -> int | None:
        """Pick the fastest live rank not yet tried to generate the group's new id."""
        rz = self.rendezvous
        candidates = [r for r, a in enumerate(self.alive) if a and r not in rz.tried]
        if not candidates:
            rz.generator = None
            return None

        def speed(r: int) -> tuple[float, int]:
            ms = smoothed_ms(r)
            return (ms if ms is not None else math.inf, r)

        gen = min(candidates, key=speed)
        rz.tried.append(gen)
        rz.generator = gen
        rz.started_at = now
        return gen

    def rendezvous_expired(self, now: float, timeout: float) -> bool:
        gen = self.rendezvous.generator
        if gen is None:
            return False
        return not self.alive[gen] or now - self.rendezvous.started_at > timeout
