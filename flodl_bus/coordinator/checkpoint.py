"""Checkpoints (reference §4.14): when a save is due, its meta with coverage, and the
validation of that meta on resume.

Sans-IO like the core: a save is the effects ``WriteMeta`` then ``SaveConsensusModel``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flodl_bus.coordinator.chunk_pool import Range, coalesce
from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.effects import Broadcast, Out, WriteMeta
from flodl_bus.coordinator.guard import MsfGuard
from flodl_bus.coordinator.views import Controllers
from flodl_bus.protocol.messages import SaveConsensusModel, SaveReason


class _Coverage(Protocol):
    """What a save asks of the dispatch: what is trained, and where a resume starts."""

    def coverage(self) -> tuple[int, list[tuple[int, list[Range]]]]: ...
    def current_epoch(self) -> int: ...
    def resume_at(self, epoch: int) -> None: ...


class CheckpointCore(Controllers, Protocol):
    """The core as checkpoints see it: the run's counters and controllers, the epoch
    counters a resume writes back, and what the dispatch covered (the part imports no
    core back; the core and its parts form a tree)."""

    hooked_epoch: int
    last_aggregated: int
    start_epoch: int

    @property
    def dispatch(self) -> _Coverage: ...


SCHEMA = 5


def coverage_block(
    config: CoordinatorConfig, next_epoch: int, epochs: Sequence[tuple[int, Sequence[Range]]]
) -> dict[str, Any]:
    return {
        "seed": config.seed,
        "epoch_splits": config.epoch_splits,
        "batch_size": config.batch_size,
        "total_samples": config.total_samples,
        "augment": config.augment,
        #: epochs >= next_epoch were never started (fully uncovered)
        "next_epoch": next_epoch,
        "epochs": [
            {"epoch": e, "uncovered": [[o, s] for o, s in coalesce(holes)]} for e, holes in epochs
        ],
    }


@dataclass(frozen=True, slots=True)
class Resume:
    start_epoch: int
    #: epoch -> ranges still to train; epochs absent and >= next_epoch train in full
    holes: dict[int, list[Range]]
    global_step: int
    sync_round: int
    version: int
    elche_state: Mapping[str, Any] | None
    trend_history: list[float]
    #: the controllers' state (absent in metas written before it was kept)
    scheduler: Mapping[str, Any] | None = None


def read_meta(config: CoordinatorConfig, meta: Mapping[str, Any]) -> Resume:
    """Validate a meta dict against ``config``; a mismatch is a loud ``ValueError``."""
    schema = meta.get("schema")
    if schema != SCHEMA:
        raise ValueError(f"checkpoint meta schema {schema!r} is not {SCHEMA}; cannot resume")
    cov = meta.get("coverage")
    if not isinstance(cov, Mapping):
        raise ValueError("checkpoint meta has no coverage block; cannot resume")
    for key in ("seed", "epoch_splits", "batch_size", "total_samples", "augment"):
        if cov.get(key) != getattr(config, key):
            raise ValueError(
                f"checkpoint coverage {key}={cov.get(key)!r} does not match this run's "
                f"{key}={getattr(config, key)!r}; resume with the same {key}"
            )
    holes: dict[int, list[Range]] = {}
    for entry in cov.get("epochs", []):
        holes[int(entry["epoch"])] = [(int(o), int(s)) for o, s in entry["uncovered"]]
    next_epoch = int(cov.get("next_epoch", 0))
    start = next_epoch
    for e in sorted(holes):
        if holes[e]:
            start = e
            break
    # Epochs below ``next_epoch`` that are not listed were fully trained and aggregated.
    for e in range(start, next_epoch):
        holes.setdefault(e, [])
    elche = meta.get("elche_state")
    return Resume(
        start_epoch=start,
        holes={e: h for e, h in holes.items() if e >= start},
        global_step=int(meta.get("global_step", 0)),
        sync_round=int(meta.get("sync_round", 0)),
        version=int(meta.get("version", meta.get("sync_round", 0))),
        elche_state=elche if isinstance(elche, Mapping) else None,
        trend_history=[float(x) for x in (elche or {}).get("trend_history", [])],
        scheduler=sched if isinstance(sched := meta.get("scheduler"), Mapping) else None,
    )


@dataclass(slots=True)
class ArmedSave:
    """A save due at the next reduce, its coverage captured when the reduce opened."""

    coverage: dict[str, Any]
    epoch: int


class Checkpoints:
    """When the consensus is saved, and the meta written beside it."""

    def __init__(self, core: CheckpointCore) -> None:
        self.core = core
        #: a save waits for the next reduce (a checkpoint epoch, the final reduce)
        self.due = False
        self.saved_at_version = -1
        #: epoch -> ranges a resumed run has still to train (consumed as epochs open)
        self.resume_holes: dict[int, list[Range]] = {}

    @property
    def enabled(self) -> bool:
        return self.core.config.save_path is not None

    def restore(self, res: Resume) -> None:
        """Put a resumed core where the checkpoint left off."""
        core = self.core
        core.global_step = res.global_step
        core.avg_count = res.sync_round
        core.version = res.version
        if res.elche_state is not None and len(res.elche_state.get("counts", [])) == core.ws:
            core.elche.restore(res.elche_state)
        core.guard.restore(res.trend_history)
        if res.scheduler is not None:
            self._restore_scheduler(res.scheduler)
        core.start_epoch = res.start_epoch
        core.last_aggregated = res.start_epoch - 1
        core.dispatch.resume_at(res.start_epoch)
        self.resume_holes = dict(res.holes)
        # The resumed first epoch is not an epoch *transition*: no eval/checkpoint hook.
        core.hooked_epoch = res.start_epoch - 1 if res.start_epoch == 0 else res.start_epoch

    def scheduler_state(self) -> dict[str, Any]:
        """What the controllers learned: a resumed run continues them, not restarts."""
        core = self.core
        state: dict[str, Any] = {
            "max_overshoot": core.max_overshoot,
            "meta_controller": core.meta.state(),
            "callback_ewma_ms": dict(core.roles.ewma_ms),
            # Who evaluates and saves was elected from measured speed: a resume keeps it.
            "roles": {
                "epoch_callback": core.roles.epoch_callback,
                "eval": core.roles.eval,
                "checkpoint": core.roles.checkpoint,
            },
        }
        if isinstance(core.guard, MsfGuard):
            state["msf"] = core.guard.state()
        return state

    def _restore_scheduler(self, state: Mapping[str, Any]) -> None:
        core = self.core
        if core.overshoot_auto and "max_overshoot" in state:
            core.max_overshoot = int(state["max_overshoot"])
        core.meta.restore(state.get("meta_controller", {}))
        for kind, ms in state.get("callback_ewma_ms", {}).items():
            if kind in core.roles.ewma_ms:
                core.roles.ewma_ms[kind] = None if ms is None else float(ms)
        if isinstance(core.guard, MsfGuard) and "msf" in state:
            core.guard.restore_state(state["msf"])
        roles = state.get("roles")
        if isinstance(roles, Mapping) and core.roles.pinned is None:
            picks = [int(roles.get(k, 0)) for k in ("epoch_callback", "eval", "checkpoint")]
            if all(0 <= p < core.ws for p in picks):
                r = core.roles
                r.epoch_callback, r.eval, r.checkpoint = picks
                r.dirty = True

    def request(self, out: list[Out]) -> None:
        """A checkpoint epoch opened: save at the next reduce, or at once in lockstep,
        where an epoch opens only after its predecessor's last window was averaged and
        before any rank has its first batch: the consensus, each rank's state and the
        coverage are then exactly the boundary's, which a resume needs to go on bit for
        bit (the ranks' Adam moments and random state are the ones at the consensus)."""
        if not self.enabled:
            return
        if self.core.config.lockstep:
            out.append(WriteMeta(self.meta(SaveReason.CHECKPOINT, self.coverage())))
            self._send_save(out)
        else:
            self.due = True

    def arm(self) -> ArmedSave | None:
        if not self.enabled or not self.due:
            return None
        self.due = False
        # Coverage is captured now, before any rank freezes for this reduce.
        return ArmedSave(self.coverage(), self.core.dispatch.current_epoch())

    def finish(self, armed: ArmedSave | None, out: list[Out]) -> None:
        if armed is None:
            return
        out.append(WriteMeta(self.meta(SaveReason.CHECKPOINT, armed.coverage)))
        self._send_save(out)

    def final(self, out: list[Out]) -> None:
        """The graceful end: save the consensus unless this version is saved already."""
        if self.enabled and self.saved_at_version != self.core.version:
            out.append(WriteMeta(self.meta(SaveReason.GRACEFUL_SHUTDOWN, self.coverage())))
            self._send_save(out)

    def _send_save(self, out: list[Out]) -> None:
        core = self.core
        target = core.roles.checkpoint
        if core.alive(target):
            # To every rank: the target writes the model, each rank its own state.
            out.append(Broadcast(SaveConsensusModel(target)))
        self.saved_at_version = core.version

    def coverage(self) -> dict[str, Any]:
        next_epoch, epochs = self.core.dispatch.coverage()
        holes = self.resume_holes
        # A resumed epoch not yet re-opened keeps its holes in the next save.
        epochs += [(e, list(h)) for e, h in sorted(holes.items())]
        epochs.sort()
        if holes:
            next_epoch = max(next_epoch, max(holes) + 1)
        return coverage_block(self.core.config, next_epoch, epochs)

    def meta(self, reason: SaveReason, coverage: Mapping[str, Any]) -> dict[str, Any]:
        core = self.core
        elche = core.elche.state()
        elche["trend_history"] = list(core.guard.history)
        return {
            "schema": SCHEMA,
            "epoch": core.dispatch.current_epoch(),
            "global_step": core.global_step,
            "sync_round": core.avg_count,
            "version": core.version,
            "world_size": core.ws,
            "mode": core.config.mode,
            "reason": reason.snake,
            "elche_state": elche,
            "coverage": dict(coverage),
        } | ({"scheduler": self.scheduler_state()} if core.config.scheduler_meta else {})
