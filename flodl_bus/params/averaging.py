"""Averaging math (reference §5): masses, the divergence triple, EASGD, outer optimizers.

Nothing here talks to a group: the collective paths call these on tensors they already
hold, so every rule can be checked against hand-computed values in one process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

import torch

from flodl_bus.params.port import SyncResult

#: Below this consensus norm the relative divergence is meaningless (reference §5.5).
NORM_FLOOR: Final = 1e-10
#: Elements per chunk when a difference must be materialized (bounds the temporary).
_CHUNK: Final = 1 << 22


def gamma_mass(n: int, gamma: float = 1.0) -> float:
    """Params mass of a rank that took ``n`` steps since the last average.

    ``n <= 0`` weighs 0 whatever ``gamma`` is: ``0**0 == 1`` would let an idle rank vote
    and ``0**-x`` is infinite.
    """
    if n <= 0:
        return 0.0
    if gamma == 1.0:
        return float(n)
    return float(float(n) ** gamma)


def mover_mass(n: int) -> float:
    """Buffers mass: running statistics are averaged equally over the ranks that moved."""
    return 1.0 if n > 0 else 0.0


def is_realized(total_mass: float) -> bool:
    """A round is adopted only if some rank carried positive mass."""
    return total_mass > 0.0


def weight(own_mass: float, total_mass: float) -> float:
    """This rank's pre-multiply factor in a summing all-reduce."""
    return own_mass / total_mass if total_mass > 0.0 else 0.0


def sq_sum(tensors: Iterable[torch.Tensor]) -> float:
    # One device sync for the whole list (a per-tensor .item() would stall a GPU
    # training thread once per parameter tensor).
    ts = [t for t in tensors if t.numel()]
    if not ts:
        return 0.0
    norms = torch._foreach_norm([t.float() if not t.is_floating_point() else t for t in ts])
    # One stack and one copy out, then double arithmetic in Python: each torch op is
    # some 10 µs of dispatch on a rank's training thread (its every 10th step), and
    # squaring and summing a handful of norms there took as long as the norms. A norm
    # widens to a Python float exactly, half precision included.
    return math.fsum(n * n for n in torch.stack(norms).tolist())


def diff_sq_sum(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """Σ‖a_i - b_i‖² without materializing a whole difference at once."""
    total = 0.0
    for x, y in zip(a, b, strict=True):
        xf, yf = x.reshape(-1), y.reshape(-1)
        for start in range(0, xf.numel(), _CHUNK):
            d = xf[start : start + _CHUNK] - yf[start : start + _CHUNK]
            total += float(torch.linalg.vector_norm(d).item()) ** 2
    return total


def divergence_triple(pre: Sequence[torch.Tensor], post: Sequence[torch.Tensor]) -> SyncResult:
    """(‖pre - post‖ / ‖post‖, ‖post‖, ‖pre‖) over all parameters (reference §5.5)."""
    pre_norm = math.sqrt(sq_sum(pre))
    post_norm = math.sqrt(sq_sum(post))
    # Below the floor a relative divergence is noise; flodl reports 0.
    diverged = math.sqrt(diff_sq_sum(pre, post)) if post_norm > NORM_FLOOR else 0.0
    divergence = diverged / post_norm if post_norm > NORM_FLOOR else 0.0
    return SyncResult(divergence=divergence, post_norm=post_norm, pre_norm=pre_norm)


@torch.no_grad()
def easgd_blend_(
    local: Sequence[torch.Tensor], consensus: Sequence[torch.Tensor], alpha: float
) -> None:
    """``local ← local + alpha (consensus - local)``, in place."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"EASGD alpha must lie in [0, 1], got {alpha}")
    for p, c in zip(local, consensus, strict=True):
        p.lerp_(c.to(device=p.device, dtype=p.dtype, non_blocking=True), alpha)


# ----------------------------------------------------------------------- outer optimizers


class OuterOptimizer(Protocol):
    """Steps the global model on the pseudo-gradient ``g = prev_global - consensus``.

    ``step_`` rewrites ``consensus`` in place into the new global model. It is only called
    on a realized round, and it is deterministic, so replicas that all see the same
    consensus stay bit-identical.
    """

    name: str
    resets_inner: bool

    def step_(self, consensus: Sequence[torch.Tensor]) -> None: ...

    def reset(self) -> None:
        """Forget the previous global model and the momentum: the next ``step_`` takes
        its consensus as is and starts from it, as the first window does."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class OuterAvg:
    """Identity: the new global model is the consensus."""

    name = "avg"
    resets_inner = False

    def step_(self, consensus: Sequence[torch.Tensor]) -> None:
        return None

    def reset(self) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_name(state, self.name)


class _MomentumOuter:
    name = "momentum"
    resets_inner = False

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr = lr
        self.momentum = momentum
        self.prev: list[torch.Tensor] | None = None
        self.velocity: list[torch.Tensor] | None = None

    def _update(self, g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Return the step direction; ``v`` already holds ``mu v + g``."""
        raise NotImplementedError

    @torch.no_grad()
    def step_(self, consensus: Sequence[torch.Tensor]) -> None:
        if self.prev is None or self.velocity is None:
            # First window: there is no previous global model to take a step from.
            self.prev = [c.detach().clone() for c in consensus]
            self.velocity = [torch.zeros_like(c) for c in consensus]
            return
        if len(self.prev) != len(consensus) or any(
            p.shape != c.shape for p, c in zip(self.prev, consensus)
        ):
            raise ValueError("outer optimizer: consensus layout differs from its state")
        for prev, v, c in zip(self.prev, self.velocity, consensus):
            g = prev - c
            v.mul_(self.momentum).add_(g)
            prev.sub_(self._update(g, v), alpha=self.lr)
            c.copy_(prev)

    def reset(self) -> None:
        self.prev = None
        self.velocity = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "lr": self.lr,
            "momentum": self.momentum,
            "prev": None if self.prev is None else [t.detach().cpu().clone() for t in self.prev],
            "velocity": None
            if self.velocity is None
            else [t.detach().cpu().clone() for t in self.velocity],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_name(state, self.name)
        self.lr = float(state["lr"])
        self.momentum = float(state["momentum"])
        prev, velocity = state["prev"], state["velocity"]
        self.prev = None if prev is None else [t.clone() for t in prev]
        self.velocity = None if velocity is None else [t.clone() for t in velocity]

    def to_(self, device: torch.device) -> None:
        """Move the state next to the tensors it steps (after a restore on CPU)."""
        if self.prev is not None and self.velocity is not None:
            self.prev = [t.to(device) for t in self.prev]
            self.velocity = [t.to(device) for t in self.velocity]


class SlowMomentum(_MomentumOuter):
    """``v ← mu v + g``; ``new = prev - lr · v``."""

    name = "slow-momentum"

    def __init__(self, lr: float = 1.0, momentum: float = 0.9) -> None:
        super().__init__(lr, momentum)

    def _update(self, g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return v


class Nesterov(_MomentumOuter):
    """DiLoCo's outer step: ``v ← mu v + g``; ``new = prev - lr · (mu v + g)``.

    DiLoCo also starts each inner phase with a fresh inner optimizer: after a realized
    round the rank's optimizer state is reset (flodl's ``resets_inner``; its
    ``load_averaged`` calls ``reset_state``). Slow momentum keeps it."""

    name = "nesterov"
    resets_inner = True

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        super().__init__(lr, momentum)

    def _update(self, g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return g.add(v, alpha=self.momentum)


def make_outer(name: str | None, **kwargs: float) -> OuterOptimizer | None:
    """``None``/``"none"`` → no outer optimizer; ``avg``, ``slow-momentum``, ``nesterov``."""
    if name is None or name == "none":
        return None
    if name == OuterAvg.name:
        return OuterAvg()
    if name == SlowMomentum.name:
        return SlowMomentum(**kwargs)
    if name == Nesterov.name:
        return Nesterov(**kwargs)
    raise ValueError(f"unknown outer optimizer {name!r} (avg, slow-momentum, nesterov)")


def _check_name(state: Mapping[str, Any], name: str) -> None:
    if state.get("name") != name:
        raise ValueError(f"outer optimizer state is for {state.get('name')!r}, not {name!r}")
