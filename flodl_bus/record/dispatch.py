"""The record of one process: what it read, what its core decided, what it emitted.

One JSON object per line in ``runs/<run>/coordinator.jsonl`` or ``runs/<run>/rank<r>.jsonl``:

``{"event": "run", ...}``
    first line: everything needed to rebuild the core (config, world size, mode, job).
``{"event": "dispatch", "i", "stream", "id", "sender", "msg", "now", "before", "after", "out"}``
    one decoded entry handed to the core. ``msg`` and the messages inside ``out`` are wire
    maps (``flodl_bus.protocol.wire.to_map``); ``before``/``after`` are the core's
    decision-relevant state; ``now`` is the clock reading the core acted on.
``{"event": "tick", "i", "now", "before", "after", "out"}``
    a coordinator tick that emitted something or changed state.
``{"event": "port", "i", "call", "args", "result"}``
    what a port answered (divergence triple, realized mass, eval metric...), so a replay
    needs no model.
``{"event": <other>, ...}``
    free-form runtime events (membership, reconnects, alerts); replay ignores them.

``i`` numbers the core-facing events of the process in order; replay walks them in ``i``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flodl_bus.protocol import wire
from flodl_bus.record.log import Recorder


def record_value(value: Any) -> Any:
    """A JSON-ready form of a message, an effect, or plain data."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    try:
        return wire.to_map(value)
    except TypeError:
        pass
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {"kind": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = record_value(getattr(value, f.name))
        return out
    if isinstance(value, Mapping):
        return {str(k): record_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [record_value(v) for v in value]
    return repr(value)


def record_path(run_dir: str | Path, role: str, rank: int | None = None) -> Path:
    name = "coordinator" if role == "coordinator" else f"rank{rank}"
    return Path(run_dir) / f"{name}.jsonl"


class DispatchRecorder:
    """Thin, allocation-light writer of the events above for one process."""

    def __init__(self, run_dir: str | Path, role: str, rank: int | None = None) -> None:
        self.role = role
        self.rank = rank
        self.path = record_path(run_dir, role, rank)
        self._rec = Recorder(self.path)
        self._i = 0

    def header(self, **config: Any) -> None:
        self._rec.record("run", role=self.role, rank=self.rank, **record_value(config))

    def dispatch(
        self,
        *,
        stream: str,
        entry_id: str,
        msg: object,
        now: float,
        before: Mapping[str, Any],
        after: Mapping[str, Any],
        out: Sequence[object],
        sender: int | None = None,
    ) -> None:
        self._rec.record(
            "dispatch",
            i=self._next(),
            stream=stream,
            id=entry_id,
            sender=sender,
            msg=record_value(msg),
            now=now,
            before=record_value(before),
            after=record_value(after),
            out=[record_value(o) for o in out],
        )

    def tick(
        self,
        *,
        now: float,
        before: Mapping[str, Any],
        after: Mapping[str, Any],
        out: Sequence[object],
    ) -> None:
        self._rec.record(
            "tick",
            i=self._next(),
            now=now,
            before=record_value(before),
            after=record_value(after),
            out=[record_value(o) for o in out],
        )

    def port(self, *, call: str, args: Mapping[str, Any], result: Any) -> None:
        self._rec.record(
            "port", i=self._next(), call=call, args=record_value(args), result=record_value(result)
        )

    def event(self, name: str, **fields: Any) -> None:
        self._rec.record(name, **record_value(fields))

    def _next(self) -> int:
        i = self._i
        self._i += 1
        return i

    def flush(self) -> None:
        self._rec.flush()

    def close(self) -> None:
        self._rec.close()
