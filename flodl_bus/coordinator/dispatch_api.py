"""The dispatch interface (reference §4.10): what the core asks of a dispatch strategy,
and the narrow view of the core a strategy reads (``DispatchCore``). The strategies are
``dispatch.PoolDispatch`` (progressive chunk pools) and ``partition.PartitionDispatch``
(fixed shares).

Sans-IO like the core: effects are appended to ``out``, time comes in as ``now``.
"""

from __future__ import annotations

from typing import Protocol

from flodl_bus.coordinator import bridge
from flodl_bus.coordinator.chunk_pool import Range
from flodl_bus.coordinator.config import CoordinatorConfig, Policy
from flodl_bus.coordinator.effects import Out
from flodl_bus.coordinator.liveness import Liveness
from flodl_bus.protocol.messages import EpochPlan, MetricsMsg


class DispatchCore(bridge.BridgeCore, Protocol):
    """The core as a dispatch strategy sees it: what it reads, and the two epoch hooks it
    calls (the part imports no core back; the core and its parts form a tree)."""

    @property
    def bs(self) -> int: ...
    @property
    def config(self) -> CoordinatorConfig: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def live(self) -> Liveness: ...
    @property
    def solo(self) -> bool: ...
    @property
    def start_epoch(self) -> int: ...
    @property
    def last_aggregated(self) -> int: ...
    @property
    def max_overshoot(self) -> int: ...
    @property
    def training(self) -> bool: ...
    @property
    def resume_holes(self) -> dict[int, list[tuple[int, int]]]: ...
    def alive_mask(self) -> list[bool]: ...
    def epoch_hooks(self, epoch: int, out: list[Out], *, armed: bool = False) -> None: ...
    def hooks_armable(self, epoch: int) -> bool: ...
    def publish_epoch(self, epoch: int, epoch_ms: float | None, out: list[Out]) -> None: ...


class Dispatch:
    """What the core asks of a dispatch strategy."""

    #: the cpu reduce throttles every rank before RequestParams (a hard barrier)
    barrier_on_reduce = False

    def __init__(self, core: DispatchCore) -> None:
        self.core = core

    def start(self, now: float, out: list[Out]) -> None:
        raise NotImplementedError

    def resume_at(self, epoch: int) -> None:
        """A resumed run starts in ``epoch``."""

    def has_in_flight(self, r: int) -> bool:
        raise NotImplementedError

    def in_flight(self, r: int) -> int:
        """Samples sent to ``r`` and not yet reported."""
        raise NotImplementedError

    def in_flight_all(self) -> list[int]:
        """``in_flight`` of every rank in one pass (the state summary's, per dispatch)."""
        return [self.in_flight(r) for r in range(self.core.ws)]

    def quiesced(self, r: int) -> bool:
        """Nothing in flight and nothing this rank could be given in its epoch (§4.5)."""
        raise NotImplementedError

    def spares_gate(self, r: int) -> bool:
        """Rank ``r``, short of its window's steps, does not hold the gate shut: it is
        quiesced (an idle tail rank cannot block, §4.5)."""
        return self.quiesced(r)

    def current_epoch(self) -> int:
        raise NotImplementedError

    def rank_epochs(self) -> list[int]:
        raise NotImplementedError

    def rank_epochs_view(self) -> list[int]:
        """What ``rank_epochs`` copies, itself where it is kept (a ``Tracked`` list the
        state summary reads, never writes), else a fresh list."""
        return self.rank_epochs()

    def in_flight_view(self) -> list[int]:
        """``in_flight_all``, as ``rank_epochs_view`` is ``rank_epochs``."""
        return self.in_flight_all()

    def remaining(self) -> dict[int, int]:
        """Epoch -> samples not yet handed out, for the state summary."""
        return {}

    def epoch_remaining(self) -> int | None:
        """Batches the oldest open epoch has still to hand out (None: not tracked)."""
        return None

    def oldest_open_epoch(self) -> int | None:
        """The epoch ``epoch_remaining`` counts (None: not tracked)."""
        return None

    def on_batch(self, r: int, now: float, out: list[Out]) -> None:
        pass

    def on_metrics(self, r: int, msg: MetricsMsg, now: float, out: list[Out]) -> None:
        raise NotImplementedError

    def rollback(self, r: int, plan: EpochPlan) -> None:
        """The send of ``plan`` to ``r`` failed: take its chunk back."""
        raise NotImplementedError

    def retry(self, now: float, out: list[Out]) -> None:
        pass

    def aggregate_ready(self, now: float, out: list[Out]) -> bool:
        raise NotImplementedError

    def advance(self, now: float, out: list[Out], aggregated: bool) -> None:
        raise NotImplementedError

    def take_back(self, r: int) -> list[Range]:
        """``r`` died: what it was given and did not train."""
        return []

    def reassign(self, r: int, remainder: list[Range], now: float, out: list[Out]) -> None:
        """Hand a dead rank's work to the survivors (training phase only)."""
        raise NotImplementedError

    def plans_for_update(self, now: float, out: list[Out]) -> dict[int, EpochPlan]:
        """Plans that ride each rank's Update (none unless atomic dispatch)."""
        return {}

    def after_reduce(self, now: float, out: list[Out]) -> None:
        pass

    def prefetch(self, now: float, out: list[Out]) -> None:
        """A round was triggered: hand each idle rank its next plan now (cpu-cadence)."""

    def coverage(self) -> tuple[int, list[tuple[int, list[Range]]]]:
        """(first epoch never started, [(epoch, samples not trained)])."""
        raise NotImplementedError
