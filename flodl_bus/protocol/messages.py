"""The message catalogue: every control, timing, metrics and membership message.

Messages are small frozen, slotted dataclasses. Sequences are tuples so a decoded
message compares equal to the one that was encoded. Nothing here knows about the wire:
``flodl_bus.protocol.wire`` is the only place that maps these classes to bytes.

Two control messages have no in-process form (seed 004): the coordinator's liveness
beacon ``CoordHeartbeat`` and ``WireUpdate`` (the "averaging round complete" notice that
may carry the next plan). The in-process ``Update`` carries tensors built by the param
plane and never travels.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias, TypeGuard, get_args

#: Reserved by flodl for a future "the controller itself acts" mode; v1 ranks reject it.
RESERVED_TARGET: Final = 2**64 - 1
#: ``schedule_id`` of the final canonical eval at the end of a run.
FINAL_EVAL_SCHEDULE: Final = 2**64 - 1


class SaveReason(enum.IntEnum):
    """Why a rank writes its checkpoint bundle. The byte values are a fixed contract."""

    GRACEFUL_SHUTDOWN = 0
    MAX_FAILURE_EXCEEDED = 1
    SINGLE_SURVIVOR = 2
    ALL_RANKS_LOST = 3
    REDUCE_STALL = 4
    CHECKPOINT = 5
    #: the job's own code failed on a rank (a builder, loss_fn or eval_fn raised, or a
    #: non-finite loss): the same code runs on every rank, so the run stops
    JOB_FAILED = 6

    @classmethod
    def from_byte(cls, value: int) -> SaveReason:
        # Forward compatibility: a newer coordinator's reason must not crash an older
        # rank; the save still happens, only the recorded reason loses fidelity.
        try:
            return cls(value)
        except ValueError:
            return cls.GRACEFUL_SHUTDOWN

    @property
    def snake(self) -> str:
        return self.name.lower()


class IntentKind(enum.Enum):
    EVAL_NOW = "EvalNow"
    CHECKPOINT_NOW = "CheckpointNow"


@dataclass(frozen=True, slots=True)
class EpochPlan:
    """A slice ``[offset, offset+size)`` of an epoch's shuffled pick permutation."""

    epoch: int
    partition_offset: int
    partition_size: int


@dataclass(frozen=True, slots=True)
class ResourceSample:
    """What a rank's process holds when it reports a plan's metrics (flodl's
    ``ResourceSampleWire``): every field is None where it cannot be read, and the GPU
    ones are None on a CPU rank."""

    #: resident set size of the rank's own process (not the host's used RAM: a host
    #: runs several ranks, and one rank's growth is what a leak looks like)
    rss_bytes: int | None = None
    #: the CUDA device the rank trains on
    device_index: int | None = None
    #: the device's compute utilisation over the driver's last sample period (needs NVML)
    gpu_util_percent: float | None = None
    #: tensors live on the device now (``torch.cuda.memory_allocated``)
    vram_allocated_bytes: int | None = None
    #: the most the caching allocator has held since the rank started
    #: (``torch.cuda.max_memory_reserved``): what the rank needs of the device
    vram_reserved_peak_bytes: int | None = None
    vram_total_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class EpochMetrics:
    """The coordinator's cross-rank aggregate of one epoch (reference §2.4, §4.11)."""

    epoch: int
    avg_loss: float
    epoch_ms: float
    scalars: Mapping[str, float] = field(default_factory=dict)
    per_rank: tuple[Mapping[str, float], ...] = ()
    per_rank_throughput: tuple[float, ...] = ()
    per_rank_batch_share: tuple[float, ...] = ()
    per_rank_share_complete_ms: tuple[float, ...] = ()
    per_rank_compute_only_ms: tuple[float, ...] = ()
    per_rank_data_starve_ms: tuple[float, ...] = ()
    device_indices: tuple[int, ...] = ()
    per_rank_loss: tuple[float | None, ...] = ()
    per_rank_samples: tuple[int, ...] = ()
    #: each rank's newest resource sample of the epoch (None: it sent none); empty when
    #: no rank sent one, which keeps the message as it was before resources existed
    per_rank_resources: tuple[ResourceSample | None, ...] = ()
    #: batches each rank skipped for a non-finite loss in the epoch
    #: (``Job.on_nonfinite_loss="skip"``); empty when none did, which keeps the message
    #: as it was before the count existed
    per_rank_skipped: tuple[int, ...] = ()


#: The ``record_scalar`` tag a rank counts a skipped non-finite batch under; the
#: coordinator turns its count into ``EpochMetrics.per_rank_skipped``.
NONFINITE_SKIPPED_TAG = "nonfinite_skipped"


@dataclass(frozen=True, slots=True)
class AveragedParams:
    """The consensus a rank adopts on ``Update``. Tensors are opaque to the protocol."""

    params: tuple[Any, ...]
    buffers: tuple[Any, ...]
    version: int
    realized: bool = True


# --------------------------------------------------------------------------- control


@dataclass(frozen=True, slots=True)
class RequestParams:
    pass


@dataclass(frozen=True, slots=True)
class Update:
    """In-process only: the averaged parameters, injected by the param plane."""

    avg: AveragedParams


@dataclass(frozen=True, slots=True)
class WireUpdate:
    """Wire only: the CPU round is complete; ``next_plan`` is the atomic next chunk."""

    version: int
    next_plan: EpochPlan | None = None


@dataclass(frozen=True, slots=True)
class StageAdvisory:
    counts: tuple[int, ...]
    segments: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]


@dataclass(frozen=True, slots=True)
class SyncNow:
    pass


@dataclass(frozen=True, slots=True)
class StartEpoch:
    plan: EpochPlan


@dataclass(frozen=True, slots=True)
class DeclareDead:
    rank: int


@dataclass(frozen=True, slots=True)
class NewNcclSession:
    uid_bytes: bytes
    new_rank: int
    new_world_size: int


@dataclass(frozen=True, slots=True)
class RequestNewNcclId:
    pass


@dataclass(frozen=True, slots=True)
class ShutdownWithSave:
    reason: SaveReason


@dataclass(frozen=True, slots=True)
class ExtendPartition:
    partition_offset: int
    partition_size: int


@dataclass(frozen=True, slots=True)
class Throttle:
    pass


@dataclass(frozen=True, slots=True)
class SetGlobalStep:
    global_step: int


@dataclass(frozen=True, slots=True)
class Checkpoint:
    version: int
    target_rank: int


@dataclass(frozen=True, slots=True)
class ExecuteEvalCallback:
    schedule_id: int
    epoch: int
    target_rank: int
    adopt_consensus: bool = False


@dataclass(frozen=True, slots=True)
class ArmConsensusEval:
    schedule_id: int
    epoch: int
    target_rank: int


@dataclass(frozen=True, slots=True)
class ArmEpochEval:
    """Score the model before the first step of ``epoch``'s first plan: the eval an
    epoch's start owes, sent with a plan that arrives before that start (a world of one
    holds its next epoch's plan while it trains the current one)."""

    schedule_id: int
    epoch: int
    target_rank: int


@dataclass(frozen=True, slots=True)
class SetEpochCallbackRole:
    rank: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class EpochAggregated:
    metrics: EpochMetrics


@dataclass(frozen=True, slots=True)
class EvalBroadcast:
    epoch: int
    metric: float


@dataclass(frozen=True, slots=True)
class SaveConsensusModel:
    target_rank: int


@dataclass(frozen=True, slots=True)
class CoordHeartbeat:
    """Wire only: the coordinator is alive. Absorbed by the rank's reader."""


# ---------------------------------------------------------------------------- timing


@dataclass(frozen=True, slots=True)
class Batch:
    rank: int
    batch_ms: float
    data_ms: float
    step_count: int
    batch_loss: float
    param_norm: float | None = None
    sync_divergence: float | None = None


@dataclass(frozen=True, slots=True)
class SyncAck:
    rank: int
    step_count: int
    divergence: float | None = None
    post_norm: float | None = None
    pre_norm: float | None = None


@dataclass(frozen=True, slots=True)
class Exiting:
    rank: int
    #: None: a clean completion after Shutdown (flodl's only Exiting). Otherwise the rank
    #: is leaving mid-run and says why (e.g. ``"SIGTERM"``), so the coordinator treats it
    #: as a death at once rather than after the heartbeat timeout.
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class LrUpdate:
    rank: int
    lr: float


@dataclass(frozen=True, slots=True)
class Heartbeat:
    rank: int
    step_count: int
    #: the newest entry id of ``ctl:<rank>`` and of its broadcast stream the rank took
    #: over (None: none yet, or a bus without ids): the coordinator trims each control
    #: stream no further than every rank has read it (``bus.trim``)
    ctl_read: str | None = None
    all_read: str | None = None


@dataclass(frozen=True, slots=True)
class Intent:
    rank: int
    kind: IntentKind


@dataclass(frozen=True, slots=True)
class SnapshotReady:
    rank: int


@dataclass(frozen=True, slots=True)
class NewNcclIdGenerated:
    rank: int
    uid_bytes: bytes


@dataclass(frozen=True, slots=True)
class EvalResult:
    rank: int
    schedule_id: int
    epoch: int
    metric: float
    elapsed_ms: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class CheckpointResult:
    rank: int
    version: int
    elapsed_ms: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class EpochFnElapsed:
    rank: int
    epoch: int
    elapsed_ms: float


# --------------------------------------------------------------------------- metrics


@dataclass(frozen=True, slots=True)
class MetricsMsg:
    """One per completed plan (chunk or epoch share); durations cover that plan only."""

    rank: int
    epoch: int
    avg_loss: float
    batches_processed: int
    epoch_ms: float
    samples_processed: int
    share_complete_ms: float
    compute_only_ms: float
    data_starve_ms: float
    #: user ``record_scalar`` accumulators: tag -> (sum, count)
    scalars: Mapping[str, tuple[float, int]] = field(default_factory=dict)
    #: the rank's process when the plan ended; None in records made before it existed
    resources: ResourceSample | None = None


# ------------------------------------------------------------------------ membership


@dataclass(frozen=True, slots=True)
class Hello:
    """A worker asks to join the run (dial-in membership on the ``join`` stream)."""

    worker_id: str
    host: str
    dataset_sig: str
    device: str = "cpu"
    requested_rank: int | None = None
    #: the worker's fresh X25519 public key (hex): with the coordinator's, it makes the
    #: key only this rank and the coordinator share (``protocol.signing``)
    kx_pub: str = ""
    #: the model the job builds, as names, shapes and dtypes (``job.model_signature``);
    #: None where it could not be told (a worker before it, a build that needs a device)
    model_sig: str | None = None
    #: the spec score of the CUDA device the worker trains on (``worker.device_spec``:
    #: lower is slower), the cold-start anchor's prior; None on CPU, where the device
    #: could not be asked, or from a worker before the field
    device_score: float | None = None


@dataclass(frozen=True, slots=True)
class Assign:
    """The coordinator admits ``worker_id`` as ``rank`` of ``world_size``."""

    worker_id: str
    rank: int
    world_size: int


@dataclass(frozen=True, slots=True)
class Reject:
    worker_id: str
    reason: str


ControlMsg: TypeAlias = (
    RequestParams
    | Update
    | StageAdvisory
    | SyncNow
    | StartEpoch
    | ShutdownWithSave
    | ExtendPartition
    | Throttle
    | SetGlobalStep
    | Checkpoint
    | ExecuteEvalCallback
    | ArmConsensusEval
    | ArmEpochEval
    | SetEpochCallbackRole
    | Shutdown
    | EpochAggregated
    | EvalBroadcast
    | SaveConsensusModel
)
"""What a rank's ``WorkerControl`` dispatches: the control wire less what the rank's
reader consumes itself (``worker.control.route``), plus the param plane's ``Update``."""

ControlWire: TypeAlias = (
    RequestParams
    | WireUpdate
    | StageAdvisory
    | SyncNow
    | StartEpoch
    | DeclareDead
    | NewNcclSession
    | RequestNewNcclId
    | ShutdownWithSave
    | ExtendPartition
    | Throttle
    | SetGlobalStep
    | Checkpoint
    | ExecuteEvalCallback
    | ArmConsensusEval
    | ArmEpochEval
    | SetEpochCallbackRole
    | Shutdown
    | EpochAggregated
    | EvalBroadcast
    | SaveConsensusModel
    | CoordHeartbeat
)
"""What travels on ``ctl:<r>`` and ``ctl:all``."""

TimingMsg: TypeAlias = (
    Batch
    | SyncAck
    | Exiting
    | LrUpdate
    | Heartbeat
    | Intent
    | SnapshotReady
    | NewNcclIdGenerated
    | EvalResult
    | CheckpointResult
    | EpochFnElapsed
)

UpstreamMsg: TypeAlias = TimingMsg | MetricsMsg
"""What travels on ``up:<r>``: timing and metrics share one ordered stream per rank."""

_UPSTREAM_TYPES: Final[frozenset[type]] = frozenset(get_args(UpstreamMsg))


def is_upstream(msg: object) -> TypeGuard[UpstreamMsg]:
    """The typed boundary for a decoded upstream entry (``Delivery.msg`` is ``object``)."""
    return type(msg) in _UPSTREAM_TYPES


_CONTROL_WIRE_TYPES: Final[frozenset[type]] = frozenset(get_args(ControlWire))


def is_control_wire(msg: object) -> TypeGuard[ControlWire]:
    """The typed boundary for a decoded control entry (``Delivery.msg`` is ``object``)."""
    return type(msg) in _CONTROL_WIRE_TYPES


JoinMsg: TypeAlias = Hello | Assign | Reject

WireMsg: TypeAlias = ControlWire | UpstreamMsg | JoinMsg
