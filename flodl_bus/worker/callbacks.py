"""What a rank's control core asks of the job's model: checkpoint, eval, saves.

``WorkerControl`` decides *when* (every rule of the state machine stays there); these
turn one such decision into the call on the ``ModelPort`` and its report: an upstream
result, or log lines. A failing callback is reported, never raised: the coordinator
decides what a failed checkpoint or eval means, and a failed save must not hold a
shutdown (a stuck rank would hold the whole cluster).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from flodl_bus.protocol.messages import (
    CheckpointResult,
    EvalResult,
    ExecuteEvalCallback,
    ShutdownWithSave,
)
from flodl_bus.worker.ports import ModelPort


@dataclass(frozen=True, slots=True)
class Log:
    """A line for the rank's log, written by the runtime (and kept in the record)."""

    level: Literal["warning", "error"]
    event: str
    fields: Mapping[str, Any] = field(default_factory=dict)


def checkpoint(
    model: ModelPort | None, rank: int, version: int, clock: Callable[[], float]
) -> CheckpointResult:
    # The rank only reports; the coordinator decides retry or fail-over.
    start = clock()
    error: str | None
    if model is None or not model.has_checkpoint_fn:
        error = (
            f"checkpoint dispatched to rank {rank} but no checkpoint_fn is set "
            "(config bug or stale role assignment)"
        )
    else:
        try:
            model.checkpoint(version)
            error = None
        except Exception as exc:
            error = error_text(exc)
    return CheckpointResult(
        rank=rank, version=version, elapsed_ms=(clock() - start) * 1000.0, error=error
    )


def evaluate(
    model: ModelPort | None, rank: int, msg: ExecuteEvalCallback, clock: Callable[[], float]
) -> EvalResult:
    assert model is not None  # checked by the caller
    # The timed span covers the mode flips too: the coordinator subtracts it from this
    # rank's window wall time.
    start = clock()
    metric = float("nan")
    error: str | None = None
    if not model.has_eval_dataset:
        error = (
            "eval_fn set without an eval dataset; give the Job an eval_data builder "
            "(Job(eval_data=...))"
        )
    else:
        model.eval_mode()
        try:
            # Per message (flodl's adopt_consensus): the last consensus, or the live
            # model, whatever the mode.
            score = model.evaluate_consensus if msg.adopt_consensus else model.evaluate
            metric = float(score())
        except Exception as exc:
            error = error_text(exc)
        finally:
            # Back to train mode even when the callback raised, or every later step
            # would train with dropout/batch-norm frozen.
            model.train_mode()
    return EvalResult(
        rank=rank,
        schedule_id=msg.schedule_id,
        epoch=msg.epoch,
        metric=metric,
        elapsed_ms=(clock() - start) * 1000.0,
        error=error,
    )


def save_bundle(model: ModelPort | None, rank: int, msg: ShutdownWithSave) -> tuple[Log, ...]:
    # A failed save is logged loudly but never blocks the exit: a stuck shutdown would
    # hold the whole cluster.
    if model is None or not model.has_save_path:
        fields = {
            "rank": rank,
            "reason": msg.reason.snake,
            "detail": "no save path set; exiting without saving",
        }
        return (Log("warning", "shutdown_with_save_without_save_path", fields),)
    try:
        model.save_bundle(msg.reason)
    except Exception as exc:
        fields = {"rank": rank, "reason": msg.reason.snake, "error": error_text(exc)}
        return (Log("error", "checkpoint_bundle_failed", fields),)
    return ()


def save_consensus(model: ModelPort | None, rank: int) -> tuple[Log, ...]:
    if model is None or not model.has_save_path:
        fields = {"rank": rank, "detail": "no save path set; consensus model not written"}
        return (Log("warning", "save_consensus_without_save_path", fields),)
    try:
        model.save_consensus()
    except Exception as exc:
        return (Log("error", "save_consensus_failed", {"rank": rank, "error": error_text(exc)}),)
    return ()


def save_rank_state(model: ModelPort | None, rank: int) -> tuple[Log, ...]:
    if model is None or not model.has_save_path:
        return ()  # the target said so already; nothing to write anywhere
    try:
        model.save_rank_state()
    except Exception as exc:
        return (Log("error", "rank_state_not_saved", {"rank": rank, "error": error_text(exc)}),)
    return ()


def error_text(exc: BaseException) -> str:
    # The job's JobError is one line already ("checkpoint_fn raised ValueError: x"): its
    # type name in front would say twice that the job's code failed.
    line = getattr(exc, "line", None)
    if isinstance(line, str):
        return line
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
