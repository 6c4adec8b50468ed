"""The coordinator's record with its states rebuilt by a shadow core in the record
process (``FLODL_RECORD_PROCESS=shadow``, opt-in).

The record process of ``record.process`` takes the line building off the coordinator's
thread, but not the state summary and its delta, which at 1,024 ranks are most of what
the record costs there (``bench path``). Yet the core is deterministic and sans-IO:
its states follow from its calls, which is what ``flodl-bus replay`` relies on. So here
the thread hands the record process only the calls (the message's fields, ``now``, the
rank, and the effects when there are any), and the child drives a core of its own,
built from the same config, through the same calls; its states and effects are the
record's ``before``/``after``/``out``, written by the ordinary ``DispatchRecorder``.

A record must be what the core did, not what a copy computed, so the copy is checked:
every call's effects against the ones the real core returned (sent whenever there are
any), and the whole state against the real core's summary about once a second and at
the end (``ShadowRecorder.check``). The first difference ends the child with
``DIVERGED`` and a ``record_shadow_diverged`` error naming the call: the coordinator
stops the run as for any death of its record process (``record.process``), and the
record ends before the call that diverged.

Why opt-in: the child now does everything the thread did (the core's call, the summary,
the delta, the line) plus the line, so it is slower per message than the coordinator's
thread. While messages come faster than it writes (``bench path`` at 1,024 ranks: it
caught up 1.6 s after 9,216 messages on the loaded 2-core host), the pipe fills
(``record.process.PIPE_BYTES``, some 15,000 calls), then the coordinator waits for it:
the record's cost comes back as back pressure, and ``events.jsonl`` lags by as much.
It pays for bursts, and wherever the record process has a core to itself and keeps up.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import structlog

from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.exits import STOP_SIGNALS
from flodl_bus.record import process
from flodl_bus.record.dispatch import DispatchRecorder, record_value

log = structlog.get_logger("flodl_bus.record")

#: the child's exit code when its core and the real one disagreed
DIVERGED: Final = 4
#: how often the loop sends the real core's whole state to be compared (seconds)
CHECK_EVERY_S: Final = 1.0

CORE, CALL, DISPATCH, CHECK, PORT = range(process.EXTRA, process.EXTRA + 5)
#: an empty state: what the loop hands a recorder that does not need them
NO_STATE: Final[Mapping[str, Any]] = {}


class ShadowRecorder(DispatchRecorder):
    """A coordinator's ``DispatchRecorder`` whose states a shadow core rebuilds."""

    process_module = "flodl_bus.coordinator.shadow"
    needs_states = False

    def __init__(
        self,
        run_dir: str | Path,
        *,
        config: CoordinatorConfig,
        resume_meta: Mapping[str, Any] | None = None,
        compress: bool | None = None,
    ) -> None:
        super().__init__(run_dir, "coordinator", compress=compress, process=True)
        if self._remote is None:
            # no record process (logged): an in-thread record, fed states by the loop
            self.needs_states = True
            return
        self._send((CORE, config, resume_meta))
        self._lines -= 1  # not a line

    def dispatch(
        self,
        *,
        stream: str | None,
        entry_id: str | None,
        msg: object,
        now: float,
        before: Mapping[str, Any],
        after: Mapping[str, Any],
        out: Sequence[object],
        sender: int | None = None,
        changes: Mapping[str, Sequence[int] | None] | None = None,
        **extra: Any,
    ) -> None:
        if self._remote is None:
            super().dispatch(
                stream=stream, entry_id=entry_id, msg=msg, now=now, before=before,
                after=after, out=out, sender=sender, changes=changes, **extra,
            )  # fmt: skip
            return
        k, values = process.pack_msg(msg, record_value)
        self._send((DISPATCH, stream, entry_id, sender, k, values, now, _outs(out)))

    def core_call(
        self,
        event: str,
        *,
        now: float,
        before: Mapping[str, Any],
        after: Mapping[str, Any],
        out: Sequence[object],
        **extra: Any,
    ) -> None:
        if self._remote is None:
            super().core_call(event, now=now, before=before, after=after, out=out, **extra)
            return
        msg = extra.get("msg")
        packed = None if msg is None else process.pack_msg(msg, record_value)
        behind = bool(extra.get("behind", False))
        self._send((CALL, event, now, extra.get("rank"), packed, _outs(out), behind))

    def port(self, *, call: str, args: Mapping[str, Any], result: Any) -> None:
        if self._remote is None:
            super().port(call=call, args=args, result=result)
            return
        self._send((PORT, call, record_value(args), record_value(result)))

    def check(self, summary: Mapping[str, Any]) -> None:
        """The real core's whole state now, for the child to compare with its own."""
        if self._remote is None:
            return
        self._send((CHECK, summary))
        self._lines -= 1


def _outs(out: Sequence[object]) -> Any:
    return record_value(list(out)) if out else None


class _Shadow:
    """The child's side: the shadow core, driven call by call into the recorder."""

    def __init__(self) -> None:
        self.core: Coordinator | None = None
        self.state: dict[str, Any] = {}
        self.calls = 0

    def __call__(self, rec: DispatchRecorder, item: tuple[Any, ...]) -> None:
        op = item[0]
        if op == CORE:
            _, config, meta = item
            self.core = (
                Coordinator.from_meta(config, meta) if meta is not None else Coordinator(config)
            )
            self.state = self.core.state_summary()
            return
        core = self.core
        assert core is not None
        self.calls += 1
        if op == DISPATCH:
            _, stream, entry_id, sender, k, values, now, real = item
            msg = process.unpack_msg(k, values)
            before = self.state
            outs = core.handle(sender, msg, now)
            self._same(real, outs, f"dispatch of {type(msg).__name__} from rank {sender}")
            after = self.state = core.state_summary(before)
            rec.dispatch(
                stream=stream,
                entry_id=entry_id,
                msg=msg,
                now=now,
                before=before,
                after=after,
                out=outs,
                sender=sender,
                changes=core.summary_changes(after, before),
            )
        elif op == CALL:
            self._call(rec, core, *item[1:])
        elif op == CHECK:
            ours = core.state_summary()
            if ours != item[1]:
                diff = sorted(k for k in set(ours) | set(item[1]) if ours.get(k) != item[1].get(k))
                self._diverged(f"the state after call {self.calls} differs in {diff}")
        elif op == PORT:
            _, call, args, result = item
            rec.port(call=call, args=args, result=result)

    def _call(
        self,
        rec: DispatchRecorder,
        core: Coordinator,
        event: str,
        now: float,
        rank: int | None,
        packed: tuple[int, Any] | None,
        real: Any,
        behind: bool = False,
    ) -> None:
        before = self.state
        extra: dict[str, Any] = {}
        if event == "start":
            outs = core.start(now)
        elif event == "tick":
            outs = core.tick(now, behind=behind)
            if behind:
                extra["behind"] = True
        elif event == "interrupt":
            outs = core.interrupt(now)
        elif event == "declare_dead" and rank is not None:
            outs = core.declare_dead(rank, now)
            extra["rank"] = rank
        elif event == "send_failed" and rank is not None and packed is not None:
            msg = process.unpack_msg(*packed)
            outs = core.send_failed(rank, msg, now)
            extra["rank"] = rank
            extra["msg"] = msg
        else:
            self._diverged(f"a core call the shadow does not know: {event}")
            return
        self._same(real, outs, event)
        after = core.state_summary(before)
        # As the loop records them: a tick or a death report that neither emitted nor
        # changed anything leaves no line (and the last state stays the base).
        if event in ("tick", "declare_dead") and not outs and after == before:
            return
        self.state = after
        rec.core_call(event, now=now, before=before, after=after, out=outs, **extra)

    def _same(self, real: Any, outs: Sequence[object], what: str) -> None:
        ours = record_value(list(outs)) if outs else None
        if ours != real:
            self._diverged(f"call {self.calls} ({what}) emitted {ours!r}, the core {real!r}")

    def _diverged(self, why: str) -> None:
        log.error("record_shadow_diverged", why=why[:2000])
        sys.stderr.flush()
        # Straight out: the record ends before this call, and nothing after it is true.
        raise SystemExit(DIVERGED)


def main(argv: Sequence[str] | None = None) -> int:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    args = sys.argv[1:] if argv is None else list(argv)
    return process.serve(json.loads(args[0]), _Shadow())


if __name__ == "__main__":
    sys.exit(main())
