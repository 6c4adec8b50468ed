"""Hypothesis strategies for every wire message, and a NaN-aware structural equality.

Each strategy names every field of its class explicitly (``_build`` checks this at import),
so a field added to a message without a strategy here fails the suite instead of silently
riding on its default.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

from hypothesis import strategies as st

from flodl_bus.protocol import messages as m

U64_MAX = 2**64 - 1

u64 = st.integers(min_value=0, max_value=U64_MAX)
#: any rank id except the reserved 2**64-1
target = st.integers(min_value=0, max_value=U64_MAX - 1)
f64 = st.floats(allow_nan=True, allow_infinity=True)
opt_f64 = st.none() | f64
text = st.text(max_size=40)
opt_text = st.none() | text
opt_entry_id = st.none() | st.builds(
    lambda ms, seq: f"{ms}-{seq}", st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)
)
uid = st.binary(max_size=256)


def tuples(elem: st.SearchStrategy[Any], max_size: int = 6) -> st.SearchStrategy[tuple[Any, ...]]:
    return st.lists(elem, max_size=max_size).map(tuple)


float_map = st.dictionaries(st.text(max_size=12), f64, max_size=4)


def _build(cls: type, **fields: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    declared = {f.name for f in dataclasses.fields(cls)}
    if set(fields) != declared:
        raise AssertionError(f"strategy for {cls.__name__} must set exactly {sorted(declared)}")
    return st.builds(cls, **fields)


plan = _build(m.EpochPlan, epoch=u64, partition_offset=u64, partition_size=u64)
opt_u64 = st.none() | u64
resources = _build(
    m.ResourceSample,
    rss_bytes=opt_u64,
    device_index=opt_u64,
    gpu_util_percent=opt_f64,
    vram_allocated_bytes=opt_u64,
    vram_reserved_peak_bytes=opt_u64,
    vram_total_bytes=opt_u64,
)
epoch_metrics = _build(
    m.EpochMetrics,
    epoch=u64,
    avg_loss=f64,
    epoch_ms=f64,
    scalars=float_map,
    per_rank=tuples(float_map, max_size=4),
    per_rank_throughput=tuples(f64),
    per_rank_batch_share=tuples(f64),
    per_rank_share_complete_ms=tuples(f64),
    per_rank_compute_only_ms=tuples(f64),
    per_rank_data_starve_ms=tuples(f64),
    device_indices=tuples(u64),
    per_rank_loss=tuples(opt_f64),
    per_rank_samples=tuples(u64),
    per_rank_resources=tuples(st.none() | resources, max_size=4),
    per_rank_skipped=tuples(u64),
)
segments = tuples(st.tuples(u64, tuples(st.tuples(u64, u64), max_size=4)), max_size=4)

#: wire type name -> strategy producing that message
STRATEGIES: dict[str, st.SearchStrategy[Any]] = {
    # control
    "RequestParams": _build(m.RequestParams),
    "Update": _build(m.WireUpdate, version=u64, next_plan=st.none() | plan),
    "StageAdvisory": _build(m.StageAdvisory, counts=tuples(u64), segments=segments),
    "SyncNow": _build(m.SyncNow),
    "StartEpoch": _build(m.StartEpoch, plan=plan),
    "DeclareDead": _build(m.DeclareDead, rank=u64),
    "NewNcclSession": _build(m.NewNcclSession, uid_bytes=uid, new_rank=u64, new_world_size=u64),
    "RequestNewNcclId": _build(m.RequestNewNcclId),
    "ShutdownWithSave": _build(m.ShutdownWithSave, reason=st.sampled_from(m.SaveReason)),
    "ExtendPartition": _build(m.ExtendPartition, partition_offset=u64, partition_size=u64),
    "Throttle": _build(m.Throttle),
    "SetGlobalStep": _build(m.SetGlobalStep, global_step=u64),
    "Checkpoint": _build(m.Checkpoint, version=u64, target_rank=target),
    "ExecuteEvalCallback": _build(
        m.ExecuteEvalCallback,
        schedule_id=u64,
        epoch=u64,
        target_rank=target,
        adopt_consensus=st.booleans(),
    ),
    "ArmConsensusEval": _build(m.ArmConsensusEval, schedule_id=u64, epoch=u64, target_rank=target),
    "ArmEpochEval": _build(m.ArmEpochEval, schedule_id=u64, epoch=u64, target_rank=target),
    "SetEpochCallbackRole": _build(m.SetEpochCallbackRole, rank=u64),
    "Shutdown": _build(m.Shutdown),
    "EpochAggregated": _build(m.EpochAggregated, metrics=epoch_metrics),
    "EvalBroadcast": _build(m.EvalBroadcast, epoch=u64, metric=f64),
    "SaveConsensusModel": _build(m.SaveConsensusModel, target_rank=target),
    "CoordHeartbeat": _build(m.CoordHeartbeat),
    # upstream
    "Batch": _build(
        m.Batch,
        rank=u64,
        batch_ms=f64,
        data_ms=f64,
        step_count=u64,
        batch_loss=f64,
        param_norm=opt_f64,
        sync_divergence=opt_f64,
    ),
    "SyncAck": _build(
        m.SyncAck,
        rank=u64,
        step_count=u64,
        divergence=opt_f64,
        post_norm=opt_f64,
        pre_norm=opt_f64,
    ),
    "Exiting": _build(m.Exiting, rank=u64, reason=opt_text),
    "LrUpdate": _build(m.LrUpdate, rank=u64, lr=f64),
    "Heartbeat": _build(
        m.Heartbeat, rank=u64, step_count=u64, ctl_read=opt_entry_id, all_read=opt_entry_id
    ),
    "Intent": _build(m.Intent, rank=u64, kind=st.sampled_from(m.IntentKind)),
    "SnapshotReady": _build(m.SnapshotReady, rank=u64),
    "NewNcclIdGenerated": _build(m.NewNcclIdGenerated, rank=u64, uid_bytes=uid),
    "EvalResult": _build(
        m.EvalResult,
        rank=u64,
        schedule_id=u64,
        epoch=u64,
        metric=f64,
        elapsed_ms=f64,
        error=opt_text,
    ),
    "CheckpointResult": _build(
        m.CheckpointResult, rank=u64, version=u64, elapsed_ms=f64, error=opt_text
    ),
    "EpochFnElapsed": _build(m.EpochFnElapsed, rank=u64, epoch=u64, elapsed_ms=f64),
    "Metrics": _build(
        m.MetricsMsg,
        rank=u64,
        epoch=u64,
        avg_loss=f64,
        batches_processed=u64,
        epoch_ms=f64,
        samples_processed=u64,
        share_complete_ms=f64,
        compute_only_ms=f64,
        data_starve_ms=f64,
        scalars=st.dictionaries(st.text(max_size=12), st.tuples(f64, u64), max_size=4),
        resources=st.none() | resources,
    ),
    # membership
    "Hello": _build(
        m.Hello,
        worker_id=text,
        host=text,
        dataset_sig=text,
        device=text,
        requested_rank=st.none() | u64,
        kx_pub=text,
        model_sig=st.none() | text,
        device_score=opt_f64,
    ),
    "Assign": _build(m.Assign, worker_id=text, rank=u64, world_size=u64),
    "Reject": _build(m.Reject, worker_id=text, reason=text),
}


def same(a: Any, b: Any) -> bool:
    """Structural equality where NaN equals NaN, -0.0 differs from 0.0, and types must match
    exactly (so an int that came back as a float, or a list instead of a tuple, fails)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, enum.Enum):
        return a is b
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)
