"""Ports that answer from the record, so a replayed core needs no model and no group.

Each core call of a recorded rank carries the list of port calls it made, in order, with
the answers (``worker.recording.Capture``). ``Script`` hands those answers back one by one and
keeps what the replayed core actually asked, so replay can compare the two lists: a core
that asks for a different call (or different arguments) has diverged. A call the record
has no answer for (a what-if replay after message surgery) gets a neutral default.
"""

from __future__ import annotations

import builtins
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

from flodl_bus.params.port import SyncResult
from flodl_bus.protocol.messages import AveragedParams, SaveReason
from flodl_bus.record.dispatch import record_value


def rebuild_exception(fields: Sequence[str]) -> BaseException:
    """An exception whose ``type(exc).__name__`` and ``str(exc)`` are the recorded ones
    (the core turns exceptions into ``"Type: text"`` error strings)."""
    name, text = fields[0], fields[1] if len(fields) > 1 else ""
    found = getattr(builtins, name, None)
    cls: type[Exception] = (
        found
        if isinstance(found, type) and issubclass(found, Exception)
        else type(name, (Exception,), {})
    )
    return cls(text)


class Script:
    """The recorded port answers of one core call, consumed in order."""

    def __init__(self) -> None:
        self._expected: deque[dict[str, Any]] = deque()
        self.actual: list[dict[str, Any]] = []
        self.unanswered = 0
        self.last_clock = 0.0

    def load(self, calls: Sequence[dict[str, Any]] | None) -> None:
        self._expected = deque(calls or ())
        self.actual = []

    def answer(self, port: str, name: str, args: Sequence[Any], default: Any = None) -> Any:
        entry: dict[str, Any] = {"port": port, "call": name, "args": record_value(list(args))}
        exp = self._expected[0] if self._expected else None
        if exp is None or exp.get("port") != port or exp.get("call") != name:
            # Not what the record asked next: answer neutrally, let the comparison of the
            # call lists name the divergence.
            self.unanswered += 1
            entry["result"] = record_value(default)
            self.actual.append(entry)
            return default
        self._expected.popleft()
        if "raised" in exp:
            entry["raised"] = exp["raised"]
            self.actual.append(entry)
            raise rebuild_exception(exp["raised"])
        result = exp.get("result")
        entry["result"] = result
        self.actual.append(entry)
        return result


class RecordedParams:
    """``ParamPort`` answered from the record."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.aborts = 0

    def sync_now(self, steps_since_avg: int) -> SyncResult:
        r = self.script.answer("params", "sync_now", (steps_since_avg,))
        if not isinstance(r, dict):
            return SyncResult(None, None, None)
        return SyncResult(r.get("divergence"), r.get("post_norm"), r.get("pre_norm"))

    def snapshot(self, steps_since_avg: int) -> None:
        self.script.answer("params", "snapshot", (steps_since_avg,))

    def load_averaged(self, avg: AveragedParams) -> None:
        args = (avg.version, avg.realized, len(avg.params), len(avg.buffers))
        self.script.answer("params", "load_averaged", args)

    def param_norm(self) -> float:
        r = self.script.answer("params", "param_norm", (), 0.0)
        return float(r) if r is not None else math.nan

    def abort(self) -> None:
        # Called by the runtime's reader on DeclareDead, outside any core call.
        self.aborts += 1

    def new_session(self, uid: bytes, new_rank: int, new_world_size: int) -> None:
        return None


class RecordedModel:
    """``ModelPort`` answered from the record; capabilities come from the header."""

    def __init__(self, script: Script, capabilities: dict[str, Any] | None = None) -> None:
        caps = capabilities or {}
        self.script = script
        self._ckpt = bool(caps.get("has_checkpoint_fn", False))
        self._eval = bool(caps.get("has_eval_fn", False))
        self._eval_data = bool(caps.get("has_eval_dataset", False))
        self._save = bool(caps.get("has_save_path", False))

    @property
    def has_checkpoint_fn(self) -> bool:
        return self._ckpt

    @property
    def has_eval_fn(self) -> bool:
        return self._eval

    @property
    def has_eval_dataset(self) -> bool:
        return self._eval_data

    @property
    def has_save_path(self) -> bool:
        return self._save

    def checkpoint(self, version: int) -> None:
        self.script.answer("model", "checkpoint", (version,))

    def eval_mode(self) -> None:
        self.script.answer("model", "eval_mode", ())

    def train_mode(self) -> None:
        self.script.answer("model", "train_mode", ())

    def evaluate(self) -> float:
        r = self.script.answer("model", "evaluate", (), math.nan)
        return float(r) if r is not None else math.nan

    def evaluate_consensus(self) -> float:
        r = self.script.answer("model", "evaluate_consensus", (), math.nan)
        return float(r) if r is not None else math.nan

    def save_bundle(self, reason: SaveReason) -> None:
        self.script.answer("model", "save_bundle", (int(reason),))

    def save_consensus(self) -> None:
        self.script.answer("model", "save_consensus", ())

    def save_rank_state(self) -> None:
        self.script.answer("model", "save_rank_state", ())


class RecordedClock:
    """The core's clock: the readings it took while recorded, in order."""

    def __init__(self, script: Script) -> None:
        self.script = script

    def __call__(self) -> float:
        r = self.script.answer("clock", "now", (), self.script.last_clock)
        if isinstance(r, (int, float)):
            self.script.last_clock = float(r)
        return self.script.last_clock
