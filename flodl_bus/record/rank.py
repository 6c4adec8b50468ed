"""Recording a rank: every input of its control core and every answer it got.

The rank's core is ``WorkerControl``; what makes a replay of it exact is recording, for
each core call, the message and where it came from, the state before and after, what it
emitted, and every answer a port gave it while it ran (the divergence triple of a
``sync_now``, a parameter norm, a clock reading, an eval metric, a checkpoint error).
The ports are wrapped here; the wrappers write into a ``Capture`` that only listens to
the thread running the core call, because the reader and session threads use the same
param port (``abort``, ``new_session``) at times that are not part of any dispatch.

The training loop's own inputs are recorded too: measured step values (``step``), the
plan it trains and where it came from (``plan``), and messages it consumed without a
dispatch (``take``). See ``record.dispatch`` for the schema.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flodl_bus.bus.api import Delivery, RankBus
from flodl_bus.params.port import ParamPort, SyncResult
from flodl_bus.protocol.messages import (
    AveragedParams,
    Batch,
    ControlMsg,
    EpochPlan,
    LrUpdate,
    SaveReason,
    StartEpoch,
    UpstreamMsg,
)
from flodl_bus.record.dispatch import DispatchRecorder, record_value
from flodl_bus.worker.control import Dispatched, WorkerControl
from flodl_bus.worker.inbox import Inbox
from flodl_bus.worker.ports import ModelPort


def error_fields(exc: BaseException) -> list[str]:
    return [type(exc).__name__, str(exc)]


class Capture:
    """Port calls and log lines of the core call running on one thread."""

    __slots__ = ("calls", "logs", "tid")

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] | None = None
        self.logs: list[dict[str, Any]] | None = None
        self.tid = 0

    def begin(self) -> None:
        self.tid = threading.get_ident()
        self.calls = []
        self.logs = []

    def end(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        calls, logs = self.calls or [], self.logs or []
        self.calls = self.logs = None
        return calls, logs

    def active(self) -> bool:
        return self.calls is not None and threading.get_ident() == self.tid

    def call(self, port: str, name: str, args: Sequence[Any], result: Any = None) -> None:
        if self.calls is not None and threading.get_ident() == self.tid:
            self.calls.append({"port": port, "call": name, "args": list(args), "result": result})

    def raised(self, port: str, name: str, args: Sequence[Any], exc: BaseException) -> None:
        if self.calls is not None and threading.get_ident() == self.tid:
            self.calls.append(
                {"port": port, "call": name, "args": list(args), "raised": error_fields(exc)}
            )

    def run(self, port: str, name: str, args: Sequence[Any], fn: Callable[[], Any]) -> Any:
        """Call a port method, noting its answer (or what it raised) for the record."""
        try:
            result = fn()
        except BaseException as exc:
            self.raised(port, name, args, exc)
            raise
        self.call(port, name, args, record_value(result))
        return result


class RecordingParams:
    """A ``ParamPort`` that reports each answer to a ``Capture``."""

    def __init__(self, inner: ParamPort, capture: Capture) -> None:
        self.inner = inner
        self._cap = capture

    def _run(self, name: str, args: Sequence[Any], fn: Callable[[], Any]) -> Any:
        return self._cap.run("params", name, args, fn)

    def sync_now(self, steps_since_avg: int) -> SyncResult:
        result: SyncResult = self._run(
            "sync_now", (steps_since_avg,), lambda: self.inner.sync_now(steps_since_avg)
        )
        return result

    def snapshot(self, steps_since_avg: int) -> None:
        self._run("snapshot", (steps_since_avg,), lambda: self.inner.snapshot(steps_since_avg))

    def load_averaged(self, avg: AveragedParams) -> None:
        args = (avg.version, avg.realized, len(avg.params), len(avg.buffers))
        self._run("load_averaged", args, lambda: self.inner.load_averaged(avg))

    def param_norm(self) -> float:
        norm: float = self._run("param_norm", (), self.inner.param_norm)
        return norm

    def abort(self) -> None:
        self._run("abort", (), self.inner.abort)

    def new_session(self, uid: bytes, new_rank: int, new_world_size: int) -> None:
        self._run(
            "new_session",
            (new_rank, new_world_size),
            lambda: self.inner.new_session(uid, new_rank, new_world_size),
        )

    def __getattr__(self, name: str) -> Any:
        # close() and other runtime-only extras of the real port
        return getattr(self.inner, name)


class RecordingModel:
    """A ``ModelPort`` that reports each answer to a ``Capture``."""

    def __init__(self, inner: ModelPort, capture: Capture) -> None:
        self.inner = inner
        self._cap = capture

    @property
    def has_checkpoint_fn(self) -> bool:
        return self.inner.has_checkpoint_fn

    @property
    def has_eval_fn(self) -> bool:
        return self.inner.has_eval_fn

    @property
    def has_eval_dataset(self) -> bool:
        return self.inner.has_eval_dataset

    @property
    def has_save_path(self) -> bool:
        return self.inner.has_save_path

    def capabilities(self) -> dict[str, bool]:
        return {
            "has_checkpoint_fn": self.has_checkpoint_fn,
            "has_eval_fn": self.has_eval_fn,
            "has_eval_dataset": self.has_eval_dataset,
            "has_save_path": self.has_save_path,
        }

    def _run(self, name: str, args: Sequence[Any], fn: Callable[[], Any]) -> Any:
        return self._cap.run("model", name, args, fn)

    def checkpoint(self, version: int) -> None:
        self._run("checkpoint", (version,), lambda: self.inner.checkpoint(version))

    def eval_mode(self) -> None:
        self._run("eval_mode", (), self.inner.eval_mode)

    def train_mode(self) -> None:
        self._run("train_mode", (), self.inner.train_mode)

    def evaluate(self) -> float:
        metric: float = self._run("evaluate", (), self.inner.evaluate)
        return metric

    def save_bundle(self, reason: SaveReason) -> None:
        self._run("save_bundle", (int(reason),), lambda: self.inner.save_bundle(reason))

    def save_consensus(self) -> None:
        self._run("save_consensus", (), self.inner.save_consensus)


class RecordingClock:
    def __init__(self, inner: Callable[[], float], capture: Capture) -> None:
        self.inner = inner
        self._cap = capture

    def __call__(self) -> float:
        t = self.inner()
        self._cap.call("clock", "now", (), t)
        return t


class CaptureLogger:
    """The core's structlog logger: forwards every line, and keeps the ones logged
    during a core call for the record (the one-chunk-in-flight violation lives here)."""

    def __init__(self, inner: Any, capture: Capture) -> None:
        self.inner = inner
        self._cap = capture

    def _method(self, level: str) -> Callable[..., None]:
        def log(event: str, *args: Any, **fields: Any) -> None:
            cap = self._cap
            if cap.logs is not None and cap.active():
                cap.logs.append({"level": level, "event": event, **record_value(fields)})
            if self.inner is not None:
                getattr(self.inner, level)(event, *args, **fields)

        return log

    def __getattr__(self, level: str) -> Callable[..., None]:
        if level.startswith("_"):
            raise AttributeError(level)
        return self._method(level)


class RecordingRankBus:
    """The rank's bus, recording every control read (the rank's input) on the reader."""

    def __init__(self, inner: RankBus, recorder: DispatchRecorder, t0: float) -> None:
        self.inner = inner
        self.rank = inner.rank
        self._rec = recorder
        self._t0 = t0

    def read_control(self, block_ms: int) -> Sequence[Delivery]:
        deliveries = self.inner.read_control(block_ms)
        if deliveries:
            self._rec.read(
                now=time.perf_counter() - self._t0,
                entries=[(d.stream, d.entry_id, d.msg) for d in deliveries],
            )
        return deliveries

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        self.inner.ack(deliveries)

    def publish(self, msg: UpstreamMsg) -> None:
        self.inner.publish(msg)

    def flush(self, timeout: float) -> bool:
        return self.inner.flush(timeout)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class RecordedControl(WorkerControl):
    """``WorkerControl`` that writes each core call to the record. The rules are the
    parent's, untouched: replay drives a plain ``WorkerControl`` and must agree."""

    def __init__(
        self,
        *,
        recorder: DispatchRecorder,
        inbox: Inbox,
        capture: Capture,
        t0: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._rec = recorder
        self._inbox = inbox
        self._cap = capture
        self._t0 = t0
        self._plan_source = "pending"

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def dispatch(self, msg: ControlMsg) -> Dispatched:
        # The loop dispatches what it just took from the inbox, so the inbox's last
        # origin is this message's (None: injected in process).
        origin = self._inbox.last_origin
        now = self._now()
        before = self.state()
        cap = self._cap
        cap.begin()
        result: dict[str, Any]
        try:
            out = super().dispatch(msg)
        except BaseException as exc:
            # A raising dispatch is recorded too (replay must raise the same), then re-raised.
            result = {"out": (), "raised": error_fields(exc)}
            raise
        else:
            result = {"out": out.upstream, "stop": out.stop, "throttled": out.throttled}
        finally:
            calls, logs = cap.end()
            self._rec.dispatch(
                stream=origin[0] if origin else None,
                entry_id=origin[1] if origin else None,
                msg=msg,
                now=now,
                before=before,
                after=self.state(),
                calls=calls,
                logs=logs,
                **result,
            )
        return out

    def took(self, msg: ControlMsg, why: str) -> None:
        """``RankLoop.on_take``: a message consumed without a dispatch."""
        origin = self._inbox.last_origin
        if why == "plan" and isinstance(msg, StartEpoch):
            self._plan_source = "taken"
        self._rec.take(
            stream=origin[0] if origin else None,
            entry_id=origin[1] if origin else None,
            msg=msg,
            why=why,
        )

    def take_pending_plan(self) -> EpochPlan | None:
        plan = super().take_pending_plan()
        if plan is not None:
            self._plan_source = "pending"
        return plan

    def begin_plan(self, plan: EpochPlan) -> list[int]:
        picks = super().begin_plan(plan)
        self._rec.plan(
            source=self._plan_source,
            plan=plan,
            now=self._now(),
            partition_len=len(picks),
            after=self.state(),
        )
        return picks

    def step_done(
        self, batch_loss: float, batch_ms: float, data_ms: float, lr: float
    ) -> tuple[Batch, LrUpdate]:
        cap = self._cap
        cap.begin()
        try:
            out = super().step_done(batch_loss, batch_ms, data_ms, lr)
        finally:
            calls, _ = cap.end()
        self._rec.step(
            args=(batch_loss, batch_ms, data_ms, lr), calls=calls, out=out, after=self.state()
        )
        return out

    def channel_closed(self) -> Dispatched:
        out = super().channel_closed()
        self._rec.closed(out=out, after=self.state())
        return out


class RankRecording:
    """Everything a rank needs to record itself, in one place for ``run_rank``."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        self.rank = rank
        self.recorder = DispatchRecorder(run_dir, "rank", rank)
        self.capture = Capture()
        self.t0 = time.perf_counter()
        # the wall time of t0: `replay --until` lines the rank up with the coordinator
        self.launched_wall = time.time()

    def bus(self, bus: RankBus) -> RecordingRankBus:
        return RecordingRankBus(bus, self.recorder, self.t0)

    def params(self, params: ParamPort) -> RecordingParams:
        return RecordingParams(params, self.capture)

    def model(self, model: ModelPort) -> RecordingModel:
        return RecordingModel(model, self.capture)

    def clock(self, clock: Callable[[], float]) -> RecordingClock:
        return RecordingClock(clock, self.capture)

    def logger(self, inner: Any) -> CaptureLogger:
        return CaptureLogger(inner, self.capture)

    def control(self, *, inbox: Inbox, **kwargs: Any) -> RecordedControl:
        return RecordedControl(
            recorder=self.recorder, inbox=inbox, capture=self.capture, t0=self.t0, **kwargs
        )

    def header(self, **fields: Any) -> None:
        self.recorder.header(launched_wall=self.launched_wall, **fields)

    def event(self, name: str, **fields: Mapping[str, Any] | Any) -> None:
        self.recorder.event(name, **fields)

    def close(self) -> None:
        self.recorder.close()
