"""Static configuration of a coordinator (reference §4.1, Appendix A)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from flodl_bus.partition import SHUFFLE_BASE_SEED, split_bounds
from flodl_bus.settings import GUARDS


class Policy(enum.Enum):
    SYNC = "sync"
    CADENCE = "cadence"
    ASYNC = "async"


class Backend(enum.Enum):
    NCCL = "nccl"
    CPU = "cpu"


#: what a run recorded before these settings existed did (replay of older records)
LEGACY_DEFAULTS: dict[str, object] = {
    "meta_controller": False,
    "callback_slack": False,
    "stage_advisories": False,
    "scheduler_meta": False,
    "bridge_idle": False,
    "solo_without_rounds": False,
    "solo_whole_epochs": False,
    "window_wait": False,
    "dead_zone_keeps_five_percent": False,
    "elche_flodl_election": False,
    "meta_then_guard": False,
    "plans_with_request": False,
    "epoch_overlap": False,
    "cpu_bridges": False,
    "partition_tail_holds_gate": False,
    "final_round_saves_graceful": False,
    "solo_plans_ahead": False,
    "plans_ahead": False,
    "chunks_cross_windows": False,
}
MODES: tuple[str, ...] = ("nccl-sync", "nccl-cadence", "cpu-sync", "cpu-cadence", "cpu-async")


def parse_mode(mode: str) -> tuple[Backend, Policy]:
    """``"cpu-cadence"`` -> (CPU, CADENCE); ``nccl-async`` is refused with the fix named."""
    if mode == "nccl-async":
        raise ValueError(
            "mode nccl-async is not supported (a fast rank cannot overshoot a blocking "
            "collective); use cpu-async, or nccl-cadence for NCCL"
        )
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    backend, _, policy = mode.partition("-")
    return Backend(backend), Policy(policy)


@dataclass(frozen=True, slots=True)
class MaxFailure:
    """``absolute`` dead ranks, or ``percent`` of the world (rounded up); §2.6."""

    absolute: int | None = None
    percent: float | None = None

    def __post_init__(self) -> None:
        if (self.absolute is None) == (self.percent is None):
            raise ValueError("MaxFailure takes exactly one of absolute= or percent=")

    def limit(self, world_size: int) -> int:
        if self.absolute is not None:
            return self.absolute
        assert self.percent is not None
        p = min(max(self.percent, 0.0), 1.0)
        # The epsilon keeps 0.2 * 10 from rounding up to 3 through float noise.
        return math.ceil(p * world_size - 1e-9) if world_size > 0 else 0

    def breached(self, dead_count: int, world_size: int) -> bool:
        return dead_count >= self.limit(world_size)


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    mode: str
    world_size: int
    total_samples: int
    batch_size: int
    num_epochs: int
    epoch_splits: int = 1
    augment: int = 1
    seed: int = SHUFFLE_BASE_SEED
    #: None = the mode's default (on for cadence/async, off for sync)
    progressive: bool | None = None
    heartbeat_timeout: float = 30.0
    #: rendezvous retry timeout (seconds) before the next generator candidate
    rendezvous_timeout: float = 5.0
    #: None = the mode's default (1 for sync, 10 otherwise)
    anchor: int | None = None
    overhead_target: float = 0.05
    max_anchor: int = 1000
    min_anchor: int | None = None
    max_batch_diff: int | None = None
    #: None = auto-tuned (async only): 3, +1 per stable reduce up to 15
    max_overshoot: int | None = None
    #: cpu-async: every Stable reduce also grows the anchor by one (flodl: opt-in)
    relax_up: bool = False
    #: None = 0.05, or 0.3 when EASGD blending is on (cpu-async)
    trend_threshold: float | None = None
    partition_ratios: tuple[float, ...] | None = None
    eval_every: int | None = None
    #: dispatch the final canonical eval before Shutdown (the job has an eval_fn)
    final_eval: bool = False
    checkpoint_every: int | None = None
    #: epochs at whose start a checkpoint is taken, once each (flodl's
    #: ``checkpoint_at_epoch``, one epoch there): beside ``checkpoint_every``
    checkpoint_at_epoch: tuple[int, ...] = ()
    save_path: str | None = None
    max_failure: MaxFailure | None = None
    #: None = "fastest" (0 until calibrated, then the fastest live rank); an int pins it
    epoch_callback_rank: int | None = None
    #: staleness sweep on (elastic death handling)
    elastic: bool = True
    coord_heartbeat_every: float = 1.0
    #: the LR-aware meta-controller (reference §4.9.6): shrinks the anchor on an LR drop
    meta_controller: bool = True
    #: divergence guard: "trend" (vetoes growth), "msf" (growth rate; may shrink), "none"
    guard: str = "trend"
    #: stage the epoch callback's expected time into its rank's last window of an epoch
    callback_slack: bool = True
    #: relative per-rank speeds (higher = faster) used before ElChe has measured any
    speed_hints: tuple[float, ...] | None = None
    #: each rank's device spec score from its Hello (lower = slower by spec), when
    #: every rank told one: the lowest-scoring rank anchors ElChe before any timing
    #: (flodl's ``with_device_indices``) unless speed hints or partition ratios name the
    #: slow rank. None (CPU ranks, an unknown device, records made before it): no prior
    device_scores: tuple[float, ...] | None = None
    #: progressive dispatch tells each rank what it will train next (prefetch hints).
    #: Off by default, unlike flodl: no rank here has a stager to use them, and each
    #: reduce would pay one message per rank of O(world size) ranges (10x the reduce's
    #: cost at 256 ranks, `bench coordinator`)
    stage_advisories: bool = False
    #: checkpoint meta carries the controllers' state, so a resume continues them
    scheduler_meta: bool = True
    #: nccl-cadence: a rank the reduce would hold idle (its window done, a slower rank's
    #: not) trains a bridge chunk until its SyncNow; a round is then acked by SyncAcks
    #: only (issue 19). Not a setting: off only to replay records made before it
    bridge_idle: bool = True
    #: a world of one closes its windows without a round (no SyncNow, no RequestParams)
    solo_without_rounds: bool = True
    #: that world of one gets what is left of an epoch in one plan, not chunk by chunk
    #: (issue 27). Not a setting: off only to replay records made before it
    solo_whole_epochs: bool = True
    #: nccl progressive cadence: an open gate waits for a mover still short of a
    #: delivered sample while its chunk is out (reference §4.6.1)
    window_wait: bool = True
    #: ElChe keeps a count whose change is exactly 5 % (flodl); records made before this
    #: existed moved it
    dead_zone_keeps_five_percent: bool = True
    #: ElChe as flodl (issue 29): a slow-cohort rank slower than the anchor by more than
    #: the dominance margin takes it over, an empty timing ring is cleared after five
    #: empty reports, speed hints pin the slowest rank through warm-up, the window cap's
    #: remainder goes to the last largest count. Not a setting: off only to replay
    #: records made before it
    elche_flodl_election: bool = True
    #: after a reduce the meta-controller's nudge applies first, then the guard's own
    #: verdict (flodl's order, issue 29): a Stable still counts toward re-arming growth,
    #: grows async overshoot and relaxes the anchor up; two nudges apply one after the
    #: other. Off: the two merged into one verdict (records made before this)
    meta_then_guard: bool = True
    #: cpu-cadence: each rank's next chunk goes out right behind the round's
    #: RequestParams (the rank holds it until it has adopted the round's Update), not
    #: on the round's Update after every SyncAck, and the epoch a round closes is
    #: aggregated first, so the next epoch's chunks go out with it (issue 27). Not a
    #: setting: off only to replay records made before it
    plans_with_request: bool = True
    #: a rank with nothing left for it in its epoch starts the next one while its peers
    #: finish (an epoch's end stops nobody), on the CPU plane and in a world of one; an
    #: NCCL group keeps flodl's epoch barrier (a collective cannot mix epochs, §6 #17).
    #: Not a setting: off only to replay records made before it (issue 27)
    epoch_overlap: bool = True
    #: cpu-cadence: a rank whose window is full trains a bridge chunk (``bridge.py``)
    #: while a slower rank finishes its window; the steps it takes after its snapshot
    #: stay on top of the round's consensus, so its ranks must keep round steps
    #: (``--overlap-rounds``; ``--bridges false`` or ``--overlap-rounds false`` turn it
    #: off). Off for records made before it (issue 27)
    cpu_bridges: bool = True
    #: a fixed partition (sync modes) spares a rank done with its share at the gate
    #: only where the tail cannot go on without a round (lockstep, a throttled rank):
    #: the tail then trains without rounds of a few steps each, as flodl's (issue 27).
    #: Not a setting: off only to replay records made before it
    partition_tail_holds_gate: bool = True
    #: the end of a run's last round is saved as the graceful shutdown's save (its
    #: meta's reason), not as a mid-run checkpoint. Off for records made before it
    final_round_saves_graceful: bool = True
    #: a world of one holds its next epoch's plan while it trains the current one, and
    #: the eval that epoch's start owes is armed to run before its first step
    #: (``ArmEpochEval``): an epoch's end is no trip through Redis (issue 27). An epoch
    #: whose start takes a checkpoint is planned when it starts, as before. Not a
    #: setting: off only to replay records made before it
    solo_plans_ahead: bool = True
    #: several ranks on the CPU plane (cadence, async): a rank whose chunk ends its
    #: share of an epoch holds its first chunk of the next while it trains that one,
    #: so it goes on without waiting a trip through Redis for it (issue 27). Not a
    #: setting: off only to replay records made before it
    plans_ahead: bool = True
    #: cpu-cadence with bridges: a chunk that would end at the rank's window count
    #: carries its next window too, so the rank trains on through the round (it takes
    #: the RequestParams between two batches, as a bridging rank does) instead of
    #: stopping at the count until the round's RequestParams brings its next chunk: on
    #: two digits ranks that stop was most of each rank's control waits (issue 27).
    #: Not a setting: off only to replay records made before it
    chunks_cross_windows: bool = True
    #: a deterministic schedule (sync modes): one batch per rank per window, the next
    #: plan only after the window's average, and epoch-boundary checkpoints taken at
    #: the boundary (``PartitionDispatch``); timing then decides nothing a model sees
    lockstep: bool = False

    def __post_init__(self) -> None:
        parse_mode(self.mode)
        if self.world_size < 1:
            raise ValueError("world_size must be at least 1")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if self.num_epochs < 0:
            raise ValueError("num_epochs must be >= 0")
        if self.epoch_splits < 1:
            raise ValueError("epoch_splits must be at least 1")
        if self.augment < 1:
            raise ValueError("augment must be at least 1")
        if self.total_samples <= 0:
            raise ValueError("total_samples must be positive (an empty dataset cannot train)")
        if self.epoch_batches(0) == 0:
            raise ValueError(
                f"an epoch of {self.total_samples * self.augment // self.epoch_splits} "
                f"samples is smaller than batch_size {self.batch_size}"
            )
        if self.partition_ratios is not None and len(self.partition_ratios) != self.world_size:
            raise ValueError("partition_ratios needs one entry per rank")
        if self.guard not in GUARDS:
            raise ValueError(f"guard {self.guard!r} is not one of {', '.join(GUARDS)}")
        if self.lockstep and (self.policy is not Policy.SYNC or self.is_progressive):
            raise ValueError(
                f"lockstep needs the fixed partition of a sync mode, not {self.mode}"
                f"{' with progressive dispatch' if self.policy is Policy.SYNC else ''}: "
                "use --mode nccl-sync or cpu-sync, or drop lockstep"
            )
        if self.epoch_callback_rank is not None and not (
            0 <= self.epoch_callback_rank < self.world_size
        ):
            raise ValueError(
                f"callback_rank {self.epoch_callback_rank} is not a rank of this world of "
                f"{self.world_size}: use 0..{self.world_size - 1}, or leave it unset"
            )
        late = [e for e in self.checkpoint_at_epoch if not 1 <= e < self.num_epochs]
        if late:
            raise ValueError(
                f"checkpoint_at_epoch {late[0]} is not an epoch this run of "
                f"{self.num_epochs} enters: use 1..{self.num_epochs - 1} (the end of the "
                "run is saved anyway)"
            )
        if self.speed_hints is not None and (
            len(self.speed_hints) != self.world_size or min(self.speed_hints) <= 0
        ):
            raise ValueError("speed_hints needs one positive entry per rank")
        if self.device_scores is not None and (
            len(self.device_scores) != self.world_size
            or not all(math.isfinite(s) for s in self.device_scores)
        ):
            raise ValueError("device_scores needs one finite entry per rank")

    # ------------------------------------------------------------------ derived
    @property
    def backend(self) -> Backend:
        return parse_mode(self.mode)[0]

    @property
    def policy(self) -> Policy:
        return parse_mode(self.mode)[1]

    @property
    def is_progressive(self) -> bool:
        if self.progressive is not None:
            return self.progressive
        return self.policy is not Policy.SYNC

    @property
    def barrier_paced(self) -> bool:
        return self.policy is not Policy.ASYNC

    @property
    def initial_anchor(self) -> int:
        if self.anchor is not None:
            return self.anchor
        return 1 if self.policy is Policy.SYNC else 10

    @property
    def pick_space(self) -> int:
        return self.total_samples * self.augment

    @property
    def easgd(self) -> bool:
        return self.mode == "cpu-async"

    @property
    def guard_threshold(self) -> float:
        if self.trend_threshold is not None:
            return self.trend_threshold
        return 0.3 if self.easgd else 0.05

    @property
    def stall_ceiling(self) -> float:
        return max(10 * self.heartbeat_timeout, 300.0)

    def epoch_samples(self, epoch: int) -> int:
        start, end = split_bounds(self.pick_space, self.epoch_splits, epoch % self.epoch_splits)
        return end - start

    def epoch_batches(self, epoch: int) -> int:
        """Batches of an epoch; the sub-batch tail of the span is never dispatched."""
        return self.epoch_samples(epoch) // self.batch_size
