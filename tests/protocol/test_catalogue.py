"""The implemented catalogue matches the one flodl defines (seed 004, reference §2)."""

from __future__ import annotations

from flodl_bus.protocol import CONTROL_TYPES, JOIN_TYPES, UPSTREAM_TYPES

CONTROL_CATALOGUE = {
    "RequestParams",
    "Update",
    "StageAdvisory",
    "SyncNow",
    "StartEpoch",
    "DeclareDead",
    "NewNcclSession",
    "RequestNewNcclId",
    "ShutdownWithSave",
    "ExtendPartition",
    "Throttle",
    "SetGlobalStep",
    "Checkpoint",
    "ExecuteEvalCallback",
    "ArmConsensusEval",
    "ArmEpochEval",
    "SetEpochCallbackRole",
    "Shutdown",
    "EpochAggregated",
    "EvalBroadcast",
    "SaveConsensusModel",
    "CoordHeartbeat",
}
TIMING_CATALOGUE = {
    "Batch",
    "SyncAck",
    "Exiting",
    "LrUpdate",
    "Heartbeat",
    "Intent",
    "SnapshotReady",
    "NewNcclIdGenerated",
    "EvalResult",
    "CheckpointResult",
    "EpochFnElapsed",
}


def test_every_control_variant_of_the_catalogue_has_a_wire_form() -> None:
    assert CONTROL_TYPES == CONTROL_CATALOGUE


def test_every_timing_variant_and_metrics_travel_upstream() -> None:
    assert TIMING_CATALOGUE | {"Metrics"} == UPSTREAM_TYPES


def test_membership_messages_travel_on_join() -> None:
    assert {"Hello", "Assign", "Reject"} == JOIN_TYPES
