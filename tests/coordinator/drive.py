"""Driving the coordinator core by hand in unit tests: build, feed batches, pick
messages out of its effects."""

from __future__ import annotations

from typing import Any

from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Broadcast, Out, Send
from flodl_bus.protocol import messages as m


def make(mode: str, ws: int = 2, total: int = 1000, bs: int = 1, **kw: Any) -> Coordinator:
    kw.setdefault("num_epochs", 1)
    return Coordinator(
        CoordinatorConfig(mode=mode, world_size=ws, total_samples=total, batch_size=bs, **kw)
    )


def started(mode: str, **kw: Any) -> tuple[Coordinator, list[Out]]:
    core = make(mode, **kw)
    return core, core.start(0.0)


def feed(core: Coordinator, rank: int, n: int, now: float = 0.0, ms: float = 10.0) -> list[Out]:
    out: list[Out] = []
    for _ in range(n):
        step = core.reduce.last_step_count[rank] + 1
        out += core.handle(rank, m.Batch(rank, ms, 0.0, step, 0.5), now)
    return out


def msgs(outs: list[Out], kind: type) -> list[Any]:
    found = []
    for o in outs:
        if isinstance(o, (Send, Broadcast)) and isinstance(o.msg, kind):
            found.append(o)
    return found


def types(outs: list[Out]) -> list[str]:
    return [type(o.msg).__name__ for o in outs if isinstance(o, (Send, Broadcast))]


def plans(outs: list[Out]) -> dict[int, m.EpochPlan]:
    return {o.rank: o.msg.plan for o in msgs(outs, m.StartEpoch)}


def beat(core: Coordinator, ranks: list[int], now: float) -> None:
    for r in ranks:
        core.handle(r, m.Heartbeat(r, 0), now)


def metrics(rank: int, epoch: int, samples: int, bs: int = 1) -> m.MetricsMsg:
    return m.MetricsMsg(rank, epoch, 0.5, samples // bs, 10.0, samples, 8.0, 6.0, 2.0)
