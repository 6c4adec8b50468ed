"""Shared torch parts for the rank tests: real models, real param math, observable calls."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flodl_bus.examples import digits
from flodl_bus.params.port import SyncResult
from flodl_bus.protocol.messages import AveragedParams, ControlMsg, StageAdvisory, UpstreamMsg
from flodl_bus.worker.control import WorkerControl
from flodl_bus.worker.local_params import LocalParams
from flodl_bus.worker.model_port import TorchModelPort


class ObservedParams(LocalParams):
    """The real world-of-one param plane, with a log of what the core asked of it."""

    def __init__(self, model: nn.Module, **kw: Any) -> None:
        super().__init__(model, **kw)
        self.calls: list[tuple[str, Any]] = []

    def sync_now(self, steps_since_avg: int) -> SyncResult:
        self.calls.append(("sync_now", steps_since_avg))
        return super().sync_now(steps_since_avg)

    def snapshot(self, steps_since_avg: int) -> None:
        self.calls.append(("snapshot", steps_since_avg))
        super().snapshot(steps_since_avg)

    def load_averaged(self, avg: AveragedParams) -> None:
        self.calls.append(("load_averaged", avg.version))
        super().load_averaged(avg)

    def abort(self) -> None:
        self.calls.append(("abort", None))
        super().abort()

    def new_session(self, uid: bytes, new_rank: int, new_world_size: int) -> None:
        self.calls.append(("new_session", (uid, new_rank, new_world_size)))
        super().new_session(uid, new_rank, new_world_size)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class StepClock:
    """A deterministic clock: every reading advances by ``step`` seconds."""

    def __init__(self, step: float = 0.25) -> None:
        self.now = 100.0
        self.step = step

    def __call__(self) -> float:
        t = self.now
        self.now += self.step
        return t


@dataclass
class ListStager:
    advisories: list[StageAdvisory] = field(default_factory=list)

    def advise(self, advisory: StageAdvisory) -> None:
        self.advisories.append(advisory)


class DropoutNet(nn.Module):
    """Small digits net with dropout, so train/eval mode is observable."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


@dataclass
class Core:
    control: WorkerControl
    params: ObservedParams
    model: nn.Module
    port: TorchModelPort
    injected: list[ControlMsg]
    published: list[UpstreamMsg]


def make_core(
    *,
    rank: int = 0,
    model: nn.Module | None = None,
    eval_fn: Callable[[nn.Module, Any], float] | None = None,
    with_eval_data: bool = True,
    checkpoint_fn: Callable[[int, nn.Module], None] | None = None,
    save_path: str | None = None,
    stager: ListStager | None = None,
    clock: Callable[[], float] | None = None,
    batch_size: int = 32,
) -> Core:
    model = model if model is not None else DropoutNet()
    injected: list[ControlMsg] = []
    published: list[UpstreamMsg] = []
    params = ObservedParams(model, rank=rank, inject=injected.append, publish=published.append)
    port = TorchModelPort(
        rank=rank,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        eval_fn=eval_fn,
        eval_data=digits.eval_data() if with_eval_data else None,
        checkpoint_fn=checkpoint_fn,
        save_path=save_path,
    )
    control = WorkerControl(
        rank=rank,
        params=params,
        batch_size=batch_size,
        pick_space=len(digits.train_data()),
        clock=clock if clock is not None else StepClock(),
        model=port,
        stager=stager,
    )
    return Core(control, params, model, port, injected, published)
