"""``LocalParams``: the ``ParamPort`` of a world of one rank.

Not a mock: with one rank the work-weighted average of the parameters *is* the rank's own
parameters, so every operation is the real one for ``world_size == 1``. ``sync_now``
changes nothing and reports divergence 0; ``snapshot`` copies the parameters out (as the
cpu backend does into its staging buffers), "reduces" them over the one rank, and hands
the result back as ``Update(AveragedParams)`` followed by the plane's ``SyncAck`` — the
same order the real plane promises. A round with zero mass is not realized.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from flodl_bus.params.averaging import sq_sum
from flodl_bus.params.port import SyncResult
from flodl_bus.protocol.messages import AveragedParams, ControlMsg, SyncAck, Update, UpstreamMsg


def params_norm(model: nn.Module) -> float:
    with torch.no_grad():
        return math.sqrt(sq_sum(p.detach() for p in model.parameters()))


class LocalParams:
    def __init__(
        self,
        model: nn.Module,
        *,
        rank: int = 0,
        inject: Callable[[ControlMsg], None] | None = None,
        publish: Callable[[UpstreamMsg], None] | None = None,
    ) -> None:
        self.model = model
        self.rank = rank
        self.inject = inject
        self.publish = publish
        self.version = 0
        self.aborted = False

    def sync_now(self, steps_since_avg: int) -> SyncResult:
        norm = params_norm(self.model)
        return SyncResult(divergence=0.0, post_norm=norm, pre_norm=norm)

    def snapshot(self, steps_since_avg: int) -> None:
        if self.inject is None:
            raise RuntimeError("LocalParams.snapshot needs an inject callable (the control queue)")
        with torch.no_grad():
            params = tuple(p.detach().clone() for p in self.model.parameters())
            buffers = tuple(b.detach().clone() for b in self.model.buffers())
        self.version += 1
        avg = AveragedParams(
            params=params, buffers=buffers, version=self.version, realized=steps_since_avg > 0
        )
        # Update first, then the ack: the coordinator's wire Update (sent after every
        # ack) must find the tensors already queued.
        self.inject(Update(avg))
        if self.publish is not None:
            norm = params_norm(self.model)
            self.publish(
                SyncAck(rank=self.rank, step_count=0, divergence=0.0, post_norm=norm, pre_norm=norm)
            )

    def load_averaged(self, avg: AveragedParams) -> None:
        params = list(self.model.parameters())
        buffers = list(self.model.buffers())
        if len(avg.params) != len(params) or len(avg.buffers) != len(buffers):
            raise ValueError(
                f"averaged state has {len(avg.params)} params / {len(avg.buffers)} buffers, "
                f"model has {len(params)} / {len(buffers)}"
            )
        if not avg.realized:
            return
        with torch.no_grad():
            for p, src in zip(params, avg.params, strict=True):
                p.copy_(src)
            for b, src in zip(buffers, avg.buffers, strict=True):
                b.copy_(src)

    def param_norm(self) -> float:
        return params_norm(self.model)

    def abort(self) -> None:
        # No collective can be in flight in a world of one; remember it for callers.
        self.aborted = True

    def new_session(self, uid: bytes, new_rank: int, new_world_size: int) -> None:
        if new_world_size != 1 or new_rank != 0:
            raise ValueError(
                f"LocalParams is a world of one; cannot join rank {new_rank} of {new_world_size}"
            )
