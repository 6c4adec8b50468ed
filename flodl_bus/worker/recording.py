"""Recording a rank: every input of its control core and every answer it got.

The rank's core is ``WorkerControl``; what makes a replay of it exact is recording, for
each core call, the message and where it came from, the state before and after, what it
emitted (upstream messages, log lines: both are the core's effects), and every answer a
port gave it while it ran (the divergence triple of a ``sync_now``, a parameter norm, a
clock reading, an eval metric, a checkpoint error). The core is not changed for this: the
ports are wrapped, and ``CoreRecorder`` observes each call the loop makes into the core
(``worker.loop.CoreObserver``). Port answers are kept by a ``Capture`` that only listens
to the thread running the core call, because the reader and session threads use the same
param port (``abort``, ``new_session``) at times that are not part of any core call.

The training loop's own inputs are recorded too: measured step values (``step``), the
plan it trains (``plan``), and messages it dropped at teardown (``take``). See
``record.dispatch`` for the schema.
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
    UpstreamMsg,
)
from flodl_bus.record.dispatch import DispatchRecorder, record_value
from flodl_bus.worker.callbacks import Log
from flodl_bus.worker.control import Dispatched, WorkerControl
from flodl_bus.worker.inbox import Inbox
from flodl_bus.worker.ports import ModelPort


def log_record(line: Log) -> dict[str, Any]:
    """A core log effect as the record holds it."""
    return {"level": line.level, "event": line.event, **record_value(dict(line.fields))}


def error_fields(exc: BaseException) -> list[str]:
    return [type(exc).__name__, str(exc)]


class Capture:
    """Port calls of the core call running on one thread."""

    __slots__ = ("calls", "tid")

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] | None = None
        self.tid = 0

    def begin(self) -> None:
        self.tid = threading.get_ident()
        self.calls = []

    def end(self) -> list[dict[str, Any]]:
        calls = self.calls or []
        self.calls = None
        return calls

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

    def evaluate_consensus(self) -> float:
        metric: float = self._run("evaluate_consensus", (), self.inner.evaluate_consensus)
        return metric

    def save_bundle(self, reason: SaveReason) -> None:
        self._run("save_bundle", (int(reason),), lambda: self.inner.save_bundle(reason))

    def save_consensus(self) -> None:
        self._run("save_consensus", (), self.inner.save_consensus)

    def save_rank_state(self) -> None:
        self._run("save_rank_state", (), self.inner.save_rank_state)


class RecordingClock:
    def __init__(self, inner: Callable[[], float], capture: Capture) -> None:
        self.inner = inner
        self._cap = capture

    def __call__(self) -> float:
        t = self.inner()
        self._cap.call("clock", "now", (), t)
        return t


class RecordingRankBus:
    """The rank's bus, recording every control read (the rank's input) on the reader."""

    def __init__(self, inner: RankBus, recorder: DispatchRecorder, t0: float) -> None:
        self.inner = inner
        self.rank = inner.rank
        self._rec = recorder
        self._t0 = t0
        poll = getattr(inner, "poll_control", None)
        if callable(poll):
            # Only where the inner bus has it (the runtime asks with getattr): the reads
            # the training thread makes by polling are recorded as the reader's are.
            self.poll_control: Callable[[], Sequence[Delivery]] = lambda: self._recorded(poll())

    def read_control(self, block_ms: int) -> Sequence[Delivery]:
        return self._recorded(self.inner.read_control(block_ms))

    def _recorded(self, deliveries: Sequence[Delivery]) -> Sequence[Delivery]:
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


class CoreRecorder:
    """Writes each core call of the loop to the record (a ``worker.loop.CoreObserver``).
    The core is a plain ``WorkerControl``: replay drives another one and must agree."""

    def __init__(
        self,
        control: WorkerControl,
        *,
        recorder: DispatchRecorder,
        inbox: Inbox,
        capture: Capture,
        t0: float,
    ) -> None:
        self.control = control
        self._rec = recorder
        self._inbox = inbox
        self._cap = capture
        self._t0 = t0
        self._now = 0.0
        self._before: dict[str, Any] = {}

    def before(self) -> None:
        self._now = time.perf_counter() - self._t0
        self._before = self.control.state()
        self._cap.begin()

    def begin(self) -> None:
        self._cap.begin()

    def dispatched(
        self, msg: ControlMsg, out: Dispatched | None, raised: BaseException | None
    ) -> None:
        calls = self._cap.end()
        # The loop dispatches what it just took from the inbox, so the inbox's last
        # origin is this message's (None: injected in process).
        origin = self._inbox.last_origin
        result: dict[str, Any]
        if out is None:
            # A raising dispatch is recorded too: replay must raise the same.
            assert raised is not None
            result = {"out": (), "raised": [type(raised).__name__, str(raised)], "logs": []}
        else:
            result = {
                "out": out.upstream,
                "stop": out.stop,
                "throttled": out.throttled,
                "logs": [log_record(line) for line in out.logs],
            }
        self._rec.dispatch(
            stream=origin[0] if origin else None,
            entry_id=origin[1] if origin else None,
            msg=msg,
            now=self._now,
            before=self._before,
            after=self.control.state(),
            calls=calls,
            **result,
        )

    def planned(self, plan: EpochPlan) -> None:
        self._cap.end()
        # Every plan comes out of the core's mailbox (``take_pending_plan``).
        self._rec.plan(
            source="pending",
            plan=plan,
            now=time.perf_counter() - self._t0,
            partition_len=len(self.control.partition),
            after=self.control.state(),
        )

    def stepped(
        self, args: tuple[float, float, float, float], out: tuple[Batch, LrUpdate | None]
    ) -> None:
        calls = self._cap.end()
        # Fresh or frozen, all of it: the record may encode the line later, off this
        # (the training) thread (``DispatchRecorder.step``).
        self._rec.step(
            args=args,
            calls=calls,
            out=[m for m in out if m is not None],
            after=self.control.state(),
            now=time.perf_counter() - self._t0,
        )

    def closed(self, out: Dispatched) -> None:
        self._cap.end()
        self._rec.closed(out=out, after=self.control.state())

    def dropped(self, msg: ControlMsg) -> None:
        origin = self._inbox.last_origin
        self._rec.take(
            stream=origin[0] if origin else None,
            entry_id=origin[1] if origin else None,
            msg=msg,
            why="drop",
        )


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

    def observer(self, control: WorkerControl, inbox: Inbox) -> CoreRecorder:
        return CoreRecorder(
            control, recorder=self.recorder, inbox=inbox, capture=self.capture, t0=self.t0
        )

    def header(self, **fields: Any) -> None:
        # WorkerControl's default since the LR went upstream only as news; replay builds
        # its core from this (a record without it reported the LR after every step)
        fields.setdefault("lr_reports", "changed")
        self.recorder.header(launched_wall=self.launched_wall, **fields)

    def event(self, name: str, **fields: Mapping[str, Any] | Any) -> None:
        self.recorder.event(name, **fields)

    def close(self) -> None:
        self.recorder.close()
