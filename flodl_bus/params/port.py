"""The narrow port through which a rank's control core reaches its parameters.

``WorkerControl`` never touches torch: it calls these methods, and replay substitutes an
implementation that answers from the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from flodl_bus.protocol.messages import AveragedParams


@dataclass(frozen=True, slots=True)
class SyncResult:
    """flodl's divergence triple (reference §5.5); all None when there is no group."""

    divergence: float | None
    post_norm: float | None
    pre_norm: float | None


class ParamPort(Protocol):
    def sync_now(self, steps_since_avg: int) -> SyncResult:
        """In-place work-weighted all-reduce (the ``nccl`` backend; gloo on CPU).

        Blocks until the collective is done; weights by ``steps_since_avg`` (gamma mass),
        an idle rank contributes weight 0, a zero-mass round changes nothing.
        """
        ...

    def snapshot(self, steps_since_avg: int) -> None:
        """The ``cpu`` backend's ``RequestParams``: copy params into the pinned staging
        buffers now and run the reduce in the background. When it completes the plane
        injects ``Update(AveragedParams)`` into the rank's control queue, *then* publishes
        ``SyncAck(rank, 0, divergence, post_norm, pre_norm)`` upstream (that order is
        what lets the coordinator's wire ``Update`` arrive after the tensors).
        """
        ...

    def load_averaged(self, avg: AveragedParams) -> None:
        """Adopt a consensus: overwrite, or EASGD blend under cpu-async; nothing when
        ``avg.realized`` is False. A tensor-count mismatch raises ``ValueError``."""
        ...

    def param_norm(self) -> float:
        """L2 norm over all parameters (reported on every 10th step)."""
        ...

    def abort(self) -> None:
        """Abort any in-flight collective (dead peer, lost coordinator). Idempotent."""
        ...

    def new_session(self, uid: bytes, new_rank: int, new_world_size: int) -> None:
        """Form a new group of survivors keyed by ``uid`` (after ``NewNcclSession``)."""
        ...
