"""``TorchParamPort``: the real ``ParamPort`` a rank runtime hands to its control core.

It owns the rank's session manager (group, mailbox, re-session) and one averaging path:
``nccl`` (``SyncNow``: in-place collective; NCCL on CUDA, gloo on CPU) or ``cpu``
(``RequestParams``: host staging + background gloo reduce).

Wiring in the rank runtime (the core never sees these three):

- ``DeclareDead`` -> ``port.abort()`` (releases a rank parked in a collective);
- ``RequestNewNcclId`` -> publish ``NewNcclIdGenerated(rank, <fresh random uid>)``;
- ``NewNcclSession`` -> ``port.new_session(uid, new_rank, new_world_size)``.

Both paths re-session: gloo also breaks when a peer dies (its sockets close), so the
coordinator must run the re-rendezvous for the ``cpu`` modes too, not only for ``nccl``.
A rank whose group broke waits ``mailbox_cap`` seconds for the new session, then gives
up (``sync_now`` raises; the ``cpu`` path injects ``Shutdown``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import redis
import torch

from flodl_bus.params.averaging import OuterOptimizer, easgd_blend_, make_outer, sq_sum
from flodl_bus.params.collective import UNREALIZED, CollectiveSync, averaged_buffers
from flodl_bus.params.cpu_avg import CpuAverager, Inject, Publish
from flodl_bus.params.forming import backend_for, store_base
from flodl_bus.params.groups import SessionManager, SessionSpec
from flodl_bus.params.port import SyncResult
from flodl_bus.protocol.messages import AveragedParams

#: EASGD's alpha when cpu-async blends instead of overwriting (reference §5.4).
DEFAULT_EASGD_ALPHA = 0.5


@dataclass(frozen=True, slots=True)
class ParamConfig:
    backend: Literal["nccl", "cpu"] = "nccl"
    gamma: float = 1.0
    #: ``None`` = overwrite; a value = EASGD blend (the default for cpu-async only).
    easgd_alpha: float | None = None
    outer: str | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    #: cpu backend: the params round ships each rank's change in bf16 (``cpu_avg``)
    bf16_wire: bool = False
    #: cpu backend, overwrite adoption: the steps a rank took between its snapshot and
    #: the round's Update stay on top of the consensus (``p <- cons + (p - snap)``), so
    #: the rank trains through a round instead of waiting for it (cpu-cadence, issue 27)
    keep_round_steps: bool = False
    #: Bound on store waits, group formation and each collective, in seconds.
    timeout: float = 30.0
    #: How long a rank whose group broke waits for ``NewNcclSession``.
    mailbox_cap: float = 60.0

    @classmethod
    def for_mode(cls, mode: str, **overrides: Any) -> ParamConfig:
        """``nccl-sync`` … ``cpu-async``: the backend, and EASGD on for cpu-async."""
        backend, _, policy = mode.partition("-")
        if backend not in ("nccl", "cpu") or policy not in ("sync", "cadence", "async"):
            raise ValueError(f"unknown mode {mode!r}")
        if mode == "nccl-async":
            raise ValueError("nccl-async is not a mode: use nccl-cadence or cpu-async")
        fields: dict[str, Any] = {"backend": backend}
        if mode == "cpu-async":
            fields["easgd_alpha"] = DEFAULT_EASGD_ALPHA
        fields.update(overrides)
        return cls(**fields)

    def make_outer(self) -> OuterOptimizer | None:
        kwargs = {}
        if self.outer_lr is not None:
            kwargs["lr"] = self.outer_lr
        if self.outer_momentum is not None:
            kwargs["momentum"] = self.outer_momentum
        return make_outer(self.outer, **kwargs)


class TorchParamPort:
    """``ParamPort`` over a model's parameters and buffers."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        *,
        redis_client: redis.Redis | str,
        run_id: str,
        rank: int,
        world_size: int,
        config: ParamConfig,
        inject: Inject,
        publish: Publish,
    ) -> None:
        self.params = list(params)
        self.buffers = averaged_buffers(buffers)
        if not self.params:
            raise ValueError("a model without parameters has nothing to average")
        self.config = config
        #: ``None`` = overwrite on ``Update``; a value = EASGD blend with this alpha.
        self.easgd_alpha = config.easgd_alpha
        self.rank = rank
        self.outer = config.make_outer()
        device = self.params[0].device
        backend = "gloo" if config.backend == "cpu" else backend_for(device)
        self.sessions = SessionManager(
            redis_client,
            store_base(run_id),
            rank,
            world_size,
            backend=backend,
            timeout=config.timeout,
            mailbox_cap=config.mailbox_cap,
        )
        self._sync: CollectiveSync | None = None
        self._cpu: CpuAverager | None = None
        if config.backend == "nccl":
            self._sync = CollectiveSync(
                self.params,
                buffers,
                self.sessions,
                gamma=config.gamma,
                outer=self.outer,
                timeout=config.timeout,
            )
        else:
            self._cpu = CpuAverager(
                self.params,
                buffers,
                self.sessions,
                rank=rank,
                inject=inject,
                publish=publish,
                gamma=config.gamma,
                outer=self.outer,
                timeout=config.timeout,
                bf16_wire=config.bf16_wire,
            )
        #: resets the rank's inner optimizer (set by the rank, which owns it): called
        #: after each adopted consensus when the outer optimizer ``resets_inner``
        self.reset_inner: Callable[[], None] | None = None
        self._device_cons: list[torch.Tensor] | None = None
        #: flodl's ``last_consensus``: the last realized average (params, averaged
        #: buffers), beside the params; None before the first round
        self._consensus: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    @property
    def cpu(self) -> CpuAverager | None:
        return self._cpu

    @property
    def failure(self) -> str | None:
        """Why this rank's averaging failed for good (an ``Exiting`` reason), if it did:
        the background round has no caller to raise to."""
        return None if self._cpu is None else self._cpu.failure

    # -- ParamPort ------------------------------------------------------------------------

    def sync_now(self, steps_since_avg: int) -> SyncResult:
        if self._sync is None:
            raise RuntimeError("SyncNow on a rank whose param backend is 'cpu'")
        result = self._sync.sync_now(steps_since_avg)
        # The collective left the consensus in the params; the rank trains on from it.
        self._keep_consensus(self.params, self.buffers)
        if result is not UNREALIZED:
            self._adopted()
        return result

    def _adopted(self) -> None:
        """A realized consensus is now the rank's model: DiLoCo's inner reset."""
        if self.outer is not None and self.outer.resets_inner and self.reset_inner is not None:
            self.reset_inner()

    def snapshot(self, steps_since_avg: int) -> None:
        if self._cpu is None:
            raise RuntimeError("RequestParams on a rank whose param backend is 'nccl'")
        self._cpu.snapshot(steps_since_avg)

    @torch.no_grad()
    def load_averaged(self, avg: AveragedParams) -> None:
        if len(avg.params) != len(self.params) or len(avg.buffers) != len(self.buffers):
            raise ValueError(
                f"averaged tensors do not match the model: {len(avg.params)} params / "
                f"{len(avg.buffers)} buffers for {len(self.params)} / {len(self.buffers)}"
            )
        if not avg.realized:
            return
        self._keep_consensus(avg.params, avg.buffers)
        alpha = self.easgd_alpha
        if alpha is None and self.config.keep_round_steps and self._cpu is not None:
            # p - snap is exactly 0 for a rank that took no step since its snapshot, so
            # it adopts the consensus bit for bit, like every other rank that idled.
            for p, c, snap in zip(self.params, avg.params, self._cpu.snap.views, strict=True):
                p.sub_(snap.to(p.device, non_blocking=True))
                p.add_(c.to(p.device, non_blocking=True))
        elif alpha is None:
            for p, c in zip(self.params, avg.params):
                p.copy_(c, non_blocking=True)
        else:
            easgd_blend_(self.params, self._on_device(avg.params), alpha)
        for b, c in zip(self.buffers, avg.buffers):
            b.copy_(c, non_blocking=True)
        self._adopted()

    def consensus(self) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None:
        """The last realized consensus: (params, averaged buffers) in model order."""
        return self._consensus

    @torch.no_grad()
    def _keep_consensus(self, params: Sequence[Any], buffers: Sequence[Any]) -> None:
        if self._consensus is None:
            self._consensus = (
                [torch.empty_like(p) for p in self.params],
                [torch.empty_like(b) for b in self.buffers],
            )
        # One multi-tensor copy per list, not one launch per tensor: this runs after every
        # SyncNow, on the rank's critical path (torch falls back to per-tensor copies
        # itself when the lists mix devices).
        for dst, src in zip(self._consensus, (params, buffers), strict=True):
            if dst:
                torch._foreach_copy_(dst, [t.detach() for t in src], non_blocking=True)

    def param_norm(self) -> float:
        return math.sqrt(sq_sum(p.detach() for p in self.params))

    def abort(self) -> None:
        self.sessions.abort()

    def new_session(self, uid: bytes, new_rank: int, new_world_size: int) -> None:
        # The cpu backend forms the survivors' group as soon as it is offered (on the
        # control thread; the averaging thread waits for it). NCCL's stays with the
        # training thread, which owns the device, at its next collective.
        self.sessions.offer(SessionSpec(uid, new_rank, new_world_size), form=self._cpu is not None)

    def session_offered(self, uid: bytes, new_rank: int, new_world_size: int) -> None:
        """A session was offered (on the reader thread, before ``new_session`` gets it on
        the session thread): a formation of an older one stops waiting for its members."""
        self.sessions.heard_of(SessionSpec(uid, new_rank, new_world_size))

    # -- lifecycle and checkpoints --------------------------------------------------------

    def connect(self) -> None:
        """Form the first group now instead of at the first collective."""
        self.sessions.connect()

    def outer_state_dict(self) -> dict[str, Any] | None:
        return None if self.outer is None else self.outer.state_dict()

    def load_outer_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.outer is None:
            raise ValueError("this rank has no outer optimizer to restore")
        self.outer.load_state_dict(state)
        to_ = getattr(self.outer, "to_", None)
        if to_ is not None:
            # The outer state lives beside the flat buffers it steps: device for the
            # in-place path, host staging for the cpu path.
            to_(self.params[0].device if self._cpu is None else torch.device("cpu"))

    def close(self) -> None:
        if self._cpu is not None:
            self._cpu.close()
        self.sessions.close()

    def _on_device(self, tensors: Sequence[Any]) -> Sequence[torch.Tensor]:
        """The consensus next to the params: host staging is copied once into device
        buffers allocated on first use (a lerp cannot read across devices)."""
        if all(t.device == p.device for t, p in zip(tensors, self.params)):
            return tensors
        if self._device_cons is None:
            self._device_cons = [torch.empty_like(p) for p in self.params]
        for d, t in zip(self._device_cons, tensors):
            d.copy_(t, non_blocking=True)
        return self._device_cons
