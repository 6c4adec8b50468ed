"""The ``nccl`` backend's ``SyncNow``: an in-place work-weighted all-reduce (reference §5.2).

Per call: copy params and f32 buffers into a pre-sync scratch (one flat buffer per dtype),
all-reduce the counts ``[n_eff, mover]``, then all-reduce ``scratch * own/Σ`` in a work
buffer, and only after the collective succeeded write the result into the model. Because
nothing reaches the model before success, a retry on a re-formed group of survivors
starts again from the scratch (reference §3.14).

Zero total mass: nothing is adopted and the triple is ``(None, None, None)``: no consensus
was formed, so there is nothing to measure a divergence against (the coordinator's guard
reads a missing divergence as 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flodl_bus.params.averaging import (
    OuterOptimizer,
    divergence_triple,
    gamma_mass,
    is_realized,
    mover_mass,
    weight,
)
from flodl_bus.params.flat import FlatBuffers, FlatLayout
from flodl_bus.params.groups import Group, SessionManager
from flodl_bus.params.port import SyncResult

UNREALIZED = SyncResult(divergence=None, post_norm=None, pre_norm=None)


def averaged_buffers(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Buffers that take part in averaging: f32 only; integer counters and the like stay
    local (a mean of ``num_batches_tracked`` is meaningless)."""
    return [b for b in buffers if b.dtype == torch.float32]


def scale_into_(dst: FlatBuffers, src: FlatBuffers, factor: float) -> None:
    """``dst = src * factor``; a zero factor writes zeros so a NaN on an idle rank cannot
    reach the sum (NaN * 0 is NaN)."""
    for d, s in zip(dst.flats, src.flats, strict=True):
        if factor == 0.0:
            d.zero_()
        else:
            torch.mul(s, factor, out=d)


class Averager:
    """What both averaging rounds (the blocking SyncNow one and the CPU background one)
    work on: the model's tensors as two flat layouts, the sessions, the weighting."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        sessions: SessionManager,
        *,
        gamma: float = 1.0,
        outer: OuterOptimizer | None = None,
        timeout: float = 30.0,
    ) -> None:
        if not params:
            raise ValueError("a model without parameters has nothing to average")
        self.params = list(params)
        self.buffers = averaged_buffers(buffers)
        self.sessions = sessions
        self.gamma = gamma
        self.outer = outer
        self.timeout = timeout
        self.device = self.params[0].device
        self._p_layout = FlatLayout(self.params)
        self._b_layout = FlatLayout(self.buffers)
        self._allocate()

    def _allocate(self) -> None:
        """Room for a round, sized by the layouts (a subclass's hook)."""

    def _weighted_all_reduce(
        self,
        group: Group,
        masses: tuple[float, float],
        src: tuple[FlatBuffers, FlatBuffers],
        dst: tuple[FlatBuffers, FlatBuffers],
    ) -> bool:
        """One round's collectives: the masses summed first, then each rank's weighted
        (params, buffers) from ``src`` summed into ``dst``. False when nobody trained
        (the round is unrealized and ``dst`` holds nothing)."""
        n_eff, mover = masses
        # The masses travel with the tensors: on the device for NCCL, on the host for gloo.
        counts = torch.tensor([n_eff, mover], dtype=torch.float64, device=dst[0].device)
        group.all_reduce_sum_([counts], self.timeout)
        total, movers = (float(x) for x in counts.tolist())
        if not is_realized(total):
            return False
        scale_into_(dst[0], src[0], weight(n_eff, total))
        scale_into_(dst[1], src[1], weight(mover, movers))
        group.all_reduce_sum_([*dst[0].flats, *dst[1].flats], self.timeout)
        return True


class CollectiveSync(Averager):
    """SyncNow: every rank blocks in one weighted all-reduce on the training device."""

    def _allocate(self) -> None:
        self.scratch = FlatBuffers(self._p_layout, self.device)
        self.scratch_b = FlatBuffers(self._b_layout, self.device)
        self.work = FlatBuffers(self._p_layout, self.device)
        self.work_b = FlatBuffers(self._b_layout, self.device)

    @torch.no_grad()
    def sync_now(self, steps_since_avg: int) -> SyncResult:
        n_eff = gamma_mass(steps_since_avg, self.gamma)
        mover = mover_mass(steps_since_avg)
        self.scratch.load_from(self.params)
        self.scratch_b.load_from(self.buffers)
        attempts = 0

        def attempt(group: Group) -> bool:
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                # An abandoned op of the failed attempt may still write the old buffers.
                self.work = FlatBuffers(self._p_layout, self.device)
                self.work_b = FlatBuffers(self._b_layout, self.device)
            return self._weighted_all_reduce(
                group, (n_eff, mover), (self.scratch, self.scratch_b), (self.work, self.work_b)
            )

        if not self.sessions.run(attempt):
            return UNREALIZED
        triple = divergence_triple(self.scratch.flats, self.work.flats)
        if self.outer is not None:
            self.outer.step_(self.work.flats)
        self.work.store_into(self.params)
        self.work_b.store_into(self.buffers)
        return triple
