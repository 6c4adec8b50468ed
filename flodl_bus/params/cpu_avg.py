"""The ``cpu`` backend: snapshot into host staging, reduce over gloo in the background.

Round (reference §5.3), per ``RequestParams``:

1. training thread: copy params and f32 buffers into the host staging ``snap`` (on CUDA:
   on a side stream that first waits for the compute stream, into pinned memory; the
   compute stream then waits for the copy, so the next optimizer step cannot tear the
   snapshot) and hand the round to the averaging thread; training goes on;
2. averaging thread: wait for the copy, publish ``SnapshotReady``, all-reduce the counts
   ``[n_eff, mover]`` and then ``snap * own/Σ`` into the staging ``cons``;
3. outer optimizer step (replicated: every rank holds the same consensus bits); the
   divergence triple is taken of ``snap`` against this adopted consensus;
4. inject ``Update(AveragedParams)`` into the rank's control queue, then compute the
   divergence triple (reads only) and *then* publish ``SyncAck`` (the coordinator's wire
   ``Update`` follows all acks, so the tensors are always ahead of it in the rank's
   queue).

``bf16_wire`` (flodl's option, off by default) halves the bytes of the params round: each
rank ships its weighted *change since the last consensus* in bf16, and adds the summed
change back onto that consensus in f32. Every rank adopted the same consensus bits, so
they all add onto the same base; only the change is rounded, so an update far below the
bf16 spacing of a parameter still lands (rounding the parameters themselves would drop
it, round after round). The first round of a run, or any round where some rank has no
consensus yet, travels in f32. Buffers and the masses always travel in their own dtype.

The staging buffers are allocated once and reused every round. The ``Update`` carries
views of ``cons``; they stay valid until the next round writes ``cons``, which cannot
happen before the rank dispatched that ``Update``: the next round needs the next
``RequestParams``, which the coordinator sends only after every ``SyncAck``.

Any error in a round (including a group that broke and no new session in time) injects
``Shutdown``: the rank's core would otherwise wait forever for an ``Update``. The round's
failure is kept in ``failure`` (an ``Exiting`` reason of kind ``averaging_failed``): the
rank says it upstream as it leaves, so the coordinator declares it dead (the survivors
re-form, or the run stops with a save) instead of waiting for a rank that exited.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from flodl_bus.params.averaging import (
    OuterOptimizer,
    divergence_triple,
    gamma_mass,
    is_realized,
    mover_mass,
    weight,
)
from flodl_bus.params.collective import Averager, scale_into_
from flodl_bus.params.flat import FlatBuffers
from flodl_bus.params.groups import Group, RoundSplit, SessionManager
from flodl_bus.protocol import leaving
from flodl_bus.protocol.messages import AveragedParams, Shutdown, SnapshotReady, SyncAck, Update

log = structlog.get_logger("flodl_bus.params")

Inject = Callable[[Any], None]
Publish = Callable[[Any], None]


@dataclass(frozen=True, slots=True)
class _Round:
    steps_since_avg: int
    copy_done: Any  # torch.cuda.Event | None
    started: float


@dataclass(frozen=True, slots=True)
class RoundStats:
    """What one finished round cost (bench and tests read it; never the cores)."""

    version: int
    realized: bool
    #: ``snapshot()`` to the ``Update`` injected (the consensus is adoptable).
    update_s: float
    #: ``snapshot()`` to the ``SyncAck`` ready (the triple computed).
    ack_s: float
    #: count + params all-reduces, across any re-session.
    reduce_s: float
    #: bytes of params and buffers this rank put into the round's sums (0: unrealized)
    wire_bytes: int = 0


class CpuAverager(Averager):
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        sessions: SessionManager,
        *,
        rank: int,
        inject: Inject,
        publish: Publish,
        gamma: float = 1.0,
        outer: OuterOptimizer | None = None,
        timeout: float = 30.0,
        bf16_wire: bool = False,
    ) -> None:
        super().__init__(params, buffers, sessions, gamma=gamma, outer=outer, timeout=timeout)
        self.rank = rank
        self.bf16_wire = bf16_wire
        self.inject = inject
        self.publish = publish
        cuda = self.device.type == "cuda"
        host = torch.device("cpu")
        # Pinned memory only helps (and only exists) for copies to and from a GPU.
        self.snap = FlatBuffers(self._p_layout, host, pin=cuda)
        self.snap_b = FlatBuffers(self._b_layout, host, pin=cuda)
        self.cons = FlatBuffers(self._p_layout, host, pin=cuda)
        self.cons_b = FlatBuffers(self._b_layout, host, pin=cuda)
        self._copy_stream: Any = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]
        #: bf16_wire: the last adopted consensus (what every rank's change is taken
        #: against) and the bf16 staging of the changes, one per f32 group
        self.base: FlatBuffers | None = None
        self._wire: list[torch.Tensor | None] = self._wire_buffers() if bf16_wire else []
        self._wire_bytes = 0
        self.version = 0
        self.last: RoundStats | None = None
        #: why a round failed for good (an ``Exiting`` reason), once one did
        self.failure: str | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._jobs: queue.Queue[_Round | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._loop, name=f"flodl-param-avg-{rank}", daemon=True
        )
        self._thread.start()

    # -- training thread ------------------------------------------------------------------

    @torch.no_grad()
    def snapshot(self, steps_since_avg: int) -> None:
        if not self._idle.is_set():
            # The coordinator runs one CPU round at a time; a second snapshot would
            # overwrite the staging under the running reduce.
            raise RuntimeError("RequestParams while a CPU averaging round is in flight")
        self._idle.clear()
        started = time.monotonic()
        copy_done = None
        if self._copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            self._copy_stream.wait_stream(compute)
            with torch.cuda.stream(self._copy_stream):
                self.snap.load_from(self.params, non_blocking=True)
                self.snap_b.load_from(self.buffers, non_blocking=True)
                copy_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                copy_done.record(self._copy_stream)
            compute.wait_event(copy_done)
        else:
            self.snap.load_from(self.params)
            self.snap_b.load_from(self.buffers)
        self._jobs.put(_Round(steps_since_avg, copy_done, started))

    def wait_idle(self, timeout: float) -> bool:
        """True once no round is in flight (tests, shutdown)."""
        return self._idle.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- averaging thread -----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                update, reduce_s = self._reduce(job)
                update_s = time.monotonic() - job.started
                # The consensus reaches the training thread first; the triple (a full
                # pass over snap and cons, read-only) is off the path that unblocks it.
                self.inject(update)
                ack = self._ack(update.avg.realized)
            except Exception as exc:
                log.error("cpu_average_round_failed", rank=self.rank, error=repr(exc)[:500])
                # Before the Shutdown: the training thread reads it as it tears down.
                self.failure = leaving.reason(
                    leaving.AVERAGING_FAILED, f"averaging round {self.version + 1}: {exc!r}"
                )
                self._idle.set()
                self.inject(Shutdown())
                continue
            self.last = RoundStats(
                self.version,
                update.avg.realized,
                update_s,
                time.monotonic() - job.started,
                reduce_s,
                self._wire_bytes if update.avg.realized else 0,
            )
            # Idle before the ack leaves: the next RequestParams may follow it at once.
            self._idle.set()
            self.publish(ack)

    @torch.no_grad()
    def _reduce(self, job: _Round) -> tuple[Update, float]:
        if job.copy_done is not None:
            job.copy_done.synchronize()
        self.publish(SnapshotReady(rank=self.rank))
        n_eff = gamma_mass(job.steps_since_avg, self.gamma)
        mover = mover_mass(job.steps_since_avg)
        attempts = 0
        reduce_started = time.monotonic()

        def attempt(group: Group) -> bool:
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                self._fresh_staging()
            if self.bf16_wire:
                return self._bf16_all_reduce(group, n_eff, mover)
            self._wire_bytes = _nbytes([*self.cons.flats, *self.cons_b.flats])
            return self._weighted_all_reduce(
                group, (n_eff, mover), (self.snap, self.snap_b), (self.cons, self.cons_b)
            )

        try:
            realized = self.sessions.run(attempt)
        except RoundSplit as exc:
            log.warning("cpu_round_kept_local", rank=self.rank, why=str(exc)[:300])
            realized = False
            self._fresh_staging()
            self._kept_local()
            # Peers adopted this round's consensus, this rank did not: the next round
            # must not take a change against bases that differ (it travels in f32).
            self.base = None
        reduce_s = time.monotonic() - reduce_started
        self.version += 1
        if not realized:
            # Keep local: the rank's own snapshot, flagged so load_averaged skips it.
            avg = AveragedParams(
                tuple(self.snap.views), tuple(self.snap_b.views), self.version, realized=False
            )
            return Update(avg), reduce_s
        self._step_outer(self.cons.flats)
        if self.bf16_wire:
            # After the outer step: the base is what every rank adopts, bit for bit.
            if self.base is None:
                self.base = FlatBuffers(self._p_layout, self.cons.device)
            for b, c in zip(self.base.flats, self.cons.flats, strict=True):
                b.copy_(c)
        avg = AveragedParams(tuple(self.cons.views), tuple(self.cons_b.views), self.version)
        return Update(avg), reduce_s

    def _fresh_staging(self) -> None:
        # An abandoned gloo op of a failed attempt may still write ``cons``.
        self.cons = FlatBuffers(self._p_layout, self.cons.device, pin=self.cons.pinned)
        self.cons_b = FlatBuffers(self._b_layout, self.cons.device, pin=self.cons.pinned)
        if self.bf16_wire:
            self._wire = self._wire_buffers()

    def _wire_buffers(self) -> list[torch.Tensor | None]:
        return [
            torch.empty(n, dtype=torch.bfloat16) if dtype == torch.float32 else None
            for dtype, n in self._p_layout.groups()
        ]

    @torch.no_grad()
    def _bf16_all_reduce(self, group: Group, n_eff: float, mover: float) -> bool:
        """The round of ``_weighted_all_reduce`` with the params' change in bf16. The
        third count says how many ranks hold a consensus to take a change against."""
        based = 0.0 if self.base is None else 1.0
        total, movers, bases = self._sum_masses(group, (n_eff, mover, based), self.cons.device)
        if not is_realized(total):
            return False
        if self.base is None or bases < group.world_size:
            scale_into_(self.cons, self.snap, weight(n_eff, total))
            scale_into_(self.cons_b, self.snap_b, weight(mover, movers))
            sent = [*self.cons.flats, *self.cons_b.flats]
            self._wire_bytes = _nbytes(sent)
            group.all_reduce_sum_(sent, self.timeout)
            return True
        w = weight(n_eff, total)
        sent = []
        for wire, snap, base, cons in zip(
            self._wire, self.snap.flats, self.base.flats, self.cons.flats, strict=True
        ):
            if wire is None:  # not f32: its own dtype, as without bf16_wire
                if w == 0.0:
                    cons.zero_()
                else:
                    torch.mul(snap, w, out=cons)
                sent.append(cons)
            elif w == 0.0:
                wire.zero_()  # an idle rank's NaN must not reach the sum
                sent.append(wire)
            else:
                torch.sub(snap, base, out=cons)  # cons is scratch until the sum is back
                cons.mul_(w)
                wire.copy_(cons)
                sent.append(wire)
        scale_into_(self.cons_b, self.snap_b, weight(mover, movers))
        sent += self.cons_b.flats
        self._wire_bytes = _nbytes(sent)
        group.all_reduce_sum_(sent, self.timeout)
        for wire, base, cons in zip(self._wire, self.base.flats, self.cons.flats, strict=True):
            if wire is not None:
                torch.add(base, wire, out=cons)  # summed in bf16, folded back in f32
        return True

    @torch.no_grad()
    def _ack(self, realized: bool) -> SyncAck:
        if not realized:
            return SyncAck(rank=self.rank, step_count=0)
        triple = divergence_triple(self.snap.flats, self.cons.flats)
        return SyncAck(
            rank=self.rank,
            step_count=0,
            divergence=triple.divergence,
            post_norm=triple.post_norm,
            pre_norm=triple.pre_norm,
        )


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
