"""The ``nccl`` backend's ``SyncNow``: an in-place work-weighted all-reduce (reference §5.2).

The model's parameters (and f32 buffers) live in one flat buffer per dtype, ``live``; a
second set of flat buffers, ``work``, takes the round. Per call:

1. all-reduce the masses ``[n_eff, mover]`` (tiny; gives each rank its weight);
2. chunk by chunk (``CHUNK_BYTES``): ``work = live * weight``, then the chunk's sum is
   issued at once, so on a GPU the scaling of the next chunk, the norms of the finished
   ones and the communication overlap (one pass over the model before the collective,
   the divergence norms read behind it);
3. once every chunk succeeded: the divergence triple (on CUDA one fused read of each
   chunk, ``fused``; one device sync), the outer step,
   and the model adopts ``work`` by pointing its tensors at it (no copy); the old
   ``live`` is the next round's ``work``.

The model's tensors are moved into a flat buffer once, at the first round, with their
values (``adopt``); whatever later points them elsewhere is noticed and adopted again.
Because nothing reaches the model before success, a retry on a re-formed group of
survivors starts again from ``live`` (reference §3.14); a retry takes fresh ``work``
buffers, since an abandoned op of the failed attempt may still write the old ones.

Zero total mass: nothing is adopted and the triple is ``(None, None, None)``: no consensus
was formed, so there is nothing to measure a divergence against (the coordinator's guard
reads a missing divergence as 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import structlog
import torch

from flodl_bus.params.averaging import (
    NORM_FLOOR,
    OuterOptimizer,
    gamma_mass,
    is_realized,
    mover_mass,
    weight,
)
from flodl_bus.params.flat import FlatBuffers, FlatLayout
from flodl_bus.params.fused import MIN_NUMEL as FUSED_MIN_NUMEL
from flodl_bus.params.fused import available as fused_stats_available
from flodl_bus.params.fused import stats as fused_stats
from flodl_bus.params.groups import Group, RoundSplit, SessionManager
from flodl_bus.params.port import SyncResult

log = structlog.get_logger("flodl_bus.params")

UNREALIZED = SyncResult(divergence=None, post_norm=None, pre_norm=None)

#: Bytes per chunk of the pipelined round: large enough that a chunk's all-reduce runs
#: near the link's bandwidth, small enough that the first and last chunks (the only parts
#: not overlapped) are a small share of a large model.
CHUNK_BYTES: Final = 64 << 20


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
        #: this rank kept a round local that its peers adopted (``RoundSplit``): their
        #: outer optimizers stepped on it and this one did not, so the states differ
        self.outer_behind = False
        #: the last masses' sum said some rank's outer state is behind: every rank
        #: restarts its outer optimizer at this round, so all hold the same state again
        self._restart_outer = False
        self._allocate()

    def _sum_masses(
        self, group: Group, masses: Sequence[float], device: torch.device
    ) -> list[float]:
        """The round's masses summed over ``group``, with one count more: how many ranks'
        outer optimizer state is behind. An outer optimizer is replicated (each rank
        steps it on the same consensus, no state travels), so a rank that kept a split
        round local stays apart from its peers for good unless every rank restarts it at
        the same round; the count tells them all at once."""
        counts = torch.tensor(
            [*masses, 1.0 if self.outer_behind else 0.0], dtype=torch.float64, device=device
        )
        group.all_reduce_sum_([counts], self.timeout)
        *sums, behind = (float(x) for x in counts.tolist())
        self._restart_outer = behind > 0.0
        return sums

    def _kept_local(self) -> None:
        """This rank keeps a round local that completed on a peer (``RoundSplit``)."""
        if self.outer is not None:
            self.outer_behind = True

    def _step_outer(self, consensus: Sequence[torch.Tensor]) -> None:
        """The outer step of a realized round, after a restart where a rank was behind
        (the round's consensus is then the new global model as is, on every rank)."""
        outer = self.outer
        if outer is None:
            return
        if self._restart_outer:
            outer.reset()
            self.outer_behind = False
            log.warning(
                "outer_optimizer_restarted",
                outer=outer.name,
                why="a rank kept a split round local; every rank restarts from this consensus",
            )
        outer.step_(consensus)

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
        total, movers = self._sum_masses(group, masses, dst[0].device)
        if not is_realized(total):
            return False
        scale_into_(dst[0], src[0], weight(n_eff, total))
        scale_into_(dst[1], src[1], weight(mover, movers))
        group.all_reduce_sum_([*dst[0].flats, *dst[1].flats], self.timeout)
        return True


class CollectiveSync(Averager):
    """SyncNow: every rank blocks in one weighted all-reduce on the training device."""

    def _allocate(self) -> None:
        self._p = (
            FlatBuffers(self._p_layout, self.device),
            FlatBuffers(self._p_layout, self.device),
        )
        self._b = (
            FlatBuffers(self._b_layout, self.device),
            FlatBuffers(self._b_layout, self.device),
        )
        #: which of the two flat sets the model's tensors live in (None: neither yet)
        self._live: int | None = None

    @property
    def live(self) -> tuple[FlatBuffers, FlatBuffers]:
        """The flat buffers the model's parameters and f32 buffers live in."""
        self._adopt()
        assert self._live is not None
        return self._p[self._live], self._b[self._live]

    def _lives_in(self, i: int) -> bool:
        return all(
            t.data_ptr() == v.data_ptr()
            for ts, flats in ((self.params, self._p[i]), (self.buffers, self._b[i]))
            for t, v in zip(ts, flats.views, strict=True)
        )

    @torch.no_grad()
    def _adopt(self) -> None:
        """Point the model's tensors at flat buffers holding their values, unless they
        already live in one of ours (an outside ``p.data = ...`` is noticed here)."""
        if self._live is not None and self._lives_in(self._live):
            return
        self._live = 0
        self._p[0].load_from(self.params)
        self._b[0].load_from(self.buffers)
        _point(self.params, self._p[0].views)
        _point(self.buffers, self._b[0].views)

    @torch.no_grad()
    def sync_now(self, steps_since_avg: int) -> SyncResult:
        n_eff = gamma_mass(steps_since_avg, self.gamma)
        mover = mover_mass(steps_since_avg)
        pre_p, pre_b = self.live
        assert self._live is not None
        other = 1 - self._live
        attempts = 0
        sums: Any = None

        def attempt(group: Group) -> bool:
            nonlocal attempts, sums
            attempts += 1
            if attempts > 1:
                self._fresh(other)
            total, movers = self._sum_masses(group, (n_eff, mover), self.device)
            if not is_realized(total):
                return False
            sums = self._reduce(
                group, weight(n_eff, total), weight(mover, movers), (pre_p, pre_b), other
            )
            return True

        try:
            realized = self.sessions.run(attempt)
        except RoundSplit:
            # Kept local: the model still points at ``pre``.
            self._fresh(other)
            self._kept_local()
            return UNREALIZED
        if not realized:
            return UNREALIZED
        work_p = self._p[other]
        d2, post2, pre2 = (float(x) for x in torch.stack(sums).tolist())  # the one sync
        pre_norm, post_norm = math.sqrt(pre2), math.sqrt(post2)
        # Below the floor a relative divergence is noise; flodl reports 0.
        divergence = math.sqrt(d2) / post_norm if post_norm > NORM_FLOOR else 0.0
        self._step_outer(work_p.flats)
        _point(self.params, work_p.views)
        _point(self.buffers, self._b[other].views)
        self._live = other
        return SyncResult(divergence=divergence, post_norm=post_norm, pre_norm=pre_norm)

    def _fresh(self, other: int) -> None:
        # An abandoned op of a failed attempt may still write the old buffers.
        self._p = _replace(self._p, other, FlatBuffers(self._p_layout, self.device))
        self._b = _replace(self._b, other, FlatBuffers(self._b_layout, self.device))

    def _reduce(
        self,
        group: Group,
        w: float,
        wb: float,
        pre: tuple[FlatBuffers, FlatBuffers],
        other: int,
    ) -> list[torch.Tensor]:
        """Scale and sum ``work`` chunk by chunk; return the device sums of
        ``‖pre - post‖²``, ``‖post‖²`` and ``‖pre‖²`` over the parameters."""
        work_p, work_b = self._p[other], self._b[other]
        pre_chunks = _chunks(pre[0].flats)
        work_chunks = _chunks(work_p.flats)
        works: list[Any] = []
        acc = torch.zeros(3, dtype=torch.float64, device=self.device)
        cuda = self.device.type == "cuda"
        # On CUDA with Triton a large chunk's triple is one read of pre and post behind
        # its sum (fused.stats); other chunks take three eager norms, pre's read while it
        # is summed. Decided once per chunk, so a kernel that fails mid-round still
        # leaves every chunk's pre norm read exactly once.
        can_fuse = cuda and fused_stats_available()
        fuses = [can_fuse and c.numel() >= FUSED_MIN_NUMEL for c in pre_chunks]
        for dst, src, fused in zip(work_chunks, pre_chunks, fuses, strict=True):
            # Each sum is issued as soon as its chunk is scaled: on NCCL chunk k is summed
            # on the communication stream while this stream scales chunk k+1.
            _scale(dst, src, w)
            works += group.start_all_reduce_sum([dst])
            if not fused:
                acc[2] += torch.linalg.vector_norm(src).double().square()
        for dst, src in zip(work_b.flats, pre[1].flats, strict=True):
            _scale(dst, src, wb)
        works += group.start_all_reduce_sum(work_b.flats)
        if not cuda:
            group.wait_all(works, self.timeout)
        for k, (post, before, fused) in enumerate(zip(work_chunks, pre_chunks, fuses, strict=True)):
            if cuda:
                group.order_after(works[k])  # the chunk's norms are read behind its sum
            triple = fused_stats(before, post) if fused else None
            if triple is not None:
                acc += triple
                continue
            if fused:  # the kernel failed on this chunk: pre's norm was not read yet
                acc[2] += torch.linalg.vector_norm(before).double().square()
            acc[0] += torch.linalg.vector_norm(before - post).double().square()
            acc[1] += torch.linalg.vector_norm(post).double().square()
        if cuda:
            group.wait_all(works, self.timeout)  # aborts and the deadline surface here
        return list(acc.unbind())


def _replace(
    pair: tuple[FlatBuffers, FlatBuffers], i: int, new: FlatBuffers
) -> tuple[FlatBuffers, FlatBuffers]:
    return (new, pair[1]) if i == 0 else (pair[0], new)


def _point(tensors: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> None:
    """Make each tensor use its view's memory (its identity, grad and optimizer state
    stay): the write-back of a round without a copy."""
    for t, v in zip(tensors, views, strict=True):
        t.data = v


def _chunks(flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for flat in flats:
        step = max(1, CHUNK_BYTES // flat.element_size())
        out.extend(flat.split(step))  # type: ignore[no-untyped-call]
    return out


def _scale(dst: torch.Tensor, src: torch.Tensor, factor: float) -> None:
    """``dst = src * factor``; a zero factor writes zeros so a NaN on an idle rank cannot
    reach the sum (NaN * 0 is NaN)."""
    if factor == 0.0:
        dst.zero_()
    else:
        torch.mul(src, factor, out=dst)
