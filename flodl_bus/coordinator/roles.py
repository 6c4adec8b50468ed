"""Who runs eval, checkpoint and the epoch callback, with failover (reference §4.13)."""

from __future__ import annotations

from collections.abc import Sequence

EWMA_ALPHA = 0.3


def ewma(prev: float | None, sample: float, alpha: float = EWMA_ALPHA) -> float:
    """First sample seeds the average (100 then 50 -> 85)."""
    return sample if prev is None else alpha * sample + (1 - alpha) * prev


def lowest_live(alive: Sequence[bool], exclude: Sequence[int] = ()) -> int | None:
    for r, ok in enumerate(alive):
        if ok and r not in exclude:
            return r
    return None


class Roles:
    """``pinned=None`` is the "fastest" policy: rank 0 until ElChe calibrates, then the
    live rank with the lowest smoothed ms per batch. A pinned rank keeps every role except
    the checkpoint role, which must fail over when its rank dies."""

    def __init__(self, world_size: int, pinned: int | None = None) -> None:
        self.world_size = world_size
        self.pinned = None if pinned is None else min(max(pinned, 0), world_size - 1)
        first = self.pinned if self.pinned is not None else 0
        self.checkpoint = first
        self.eval = first
        self.epoch_callback = first
        #: the next epoch dispatch must broadcast SetEpochCallbackRole
        self.dirty = True
        self.checkpoint_tried: list[int] = []
        self.ewma_ms: dict[str, float | None] = {"checkpoint": None, "eval": None, "epoch_fn": None}
        self.pending_eval_intent = False
        self.pending_checkpoint_intent = False

    def _set_all(self, rank: int) -> None:
        if rank != self.epoch_callback:
            self.dirty = True
        self.checkpoint = self.eval = self.epoch_callback = rank

    def elect_fastest(self, fastest: int | None, alive: Sequence[bool]) -> None:
        if self.pinned is not None:
            return
        pick = fastest if fastest is not None else lowest_live(alive)
        if pick is not None:
            self._set_all(pick)

    def on_death(self, rank: int, alive: Sequence[bool], fastest: int | None) -> None:
        if self.pinned is None:
            if rank in (self.checkpoint, self.eval, self.epoch_callback):
                pick = fastest if fastest is not None and alive[fastest] else lowest_live(alive)
                if pick is not None:
                    self._set_all(pick)
        elif rank == self.checkpoint:
            pick = lowest_live(alive)
            if pick is not None:
                self.checkpoint = pick

    def observe(self, kind: str, elapsed_ms: float) -> float:
        value = ewma(self.ewma_ms[kind], elapsed_ms)
        self.ewma_ms[kind] = value
        return value

    def checkpoint_succeeded(self, rank: int) -> None:
        self.checkpoint = rank
        self.checkpoint_tried.clear()

    def checkpoint_failed(self, rank: int, alive: Sequence[bool]) -> int | None:
        """Mark ``rank`` tried; the lowest live untried rank, or None (give up)."""
        if rank not in self.checkpoint_tried:
            self.checkpoint_tried.append(rank)
        nxt = lowest_live(alive, self.checkpoint_tried)
        if nxt is None:
            self.checkpoint_tried.clear()
            return None
        self.checkpoint = nxt
        return nxt
