"""flodl's timeline events, derived from the coordinator's core calls.

flodl's coordinator pushes ``EventKind``s onto a timeline as it decides. Here every
decision is already in the coordinator's record (the message, the state before and
after, the effects), so the events are a fold over those calls: ``Timeline`` takes one
core call at a time, in record form, and returns the events it implies. The same fold
runs twice: post hoc over a record (``derive``), and live inside ``DispatchRecorder``,
which hands it each call it records and appends the result to ``events.jsonl`` beside
the record (``EVENTS_FILE``). The record stays the source of truth; a replay never reads
the events.

Every event is a flat map: ``kind`` (flodl's name), ``i`` (the record line it came
from; None for a runtime event, which has no number), ``now`` (the coordinator's clock
as recorded), ``elapsed_ms`` (since the run's first core call, flodl's ``elapsed_ms``),
then flodl's fields. Where our state carries no counterpart of a field, the field is
``None``, never a guess:

``SyncStart``
    a round opened: ``SyncNow`` or ``RequestParams`` went out. A world of one closes its
    windows without a round (``SoloReduce``): its ``SyncStart`` and ``SyncEnd`` sit on
    the closing line, 0 ms apart, so they still count the windows.
``CpuAvgStart`` / ``CpuAvgEnd {duration_ms}``
    the CPU backend's round, from ``RequestParams`` to the tick that closed it.
``SyncEnd {duration_ms}``
    the window closed (``avg_count`` moved). NCCL closes in the call that sent
    ``SyncNow``, as flodl does, so its duration is 0: the collective's own time shows as
    the ranks' acks (``acks`` in the state), not here. A round cut by the reduce-stall
    ceiling ends without one, as in flodl.
``Divergence {d_raw, lambda_raw, lambda_ema, k_used, k_max, step, deltas, post_norm,
pre_norms, epoch}``
    at each close, what the guard judged: per rank the divergence and pre-norm of its
    last ``SyncAck`` since the previous close (None for a rank that sent none or is not
    alive: flodl writes 0 there), ``d_raw`` their maximum (0 without any), the first
    ack's ``post_norm``; ``k_used`` the steps the window added to ``global_step``,
    ``k_max`` the most steps one rank took in it; ``step`` the new global step;
    ``epoch`` the epoch in flight (``last_aggregated + 1``, the last one for the final
    reduce). Under NCCL the acks arrive
    after the close that sent ``SyncNow``, so a close judges the previous round's acks,
    as the core does. ``lambda_raw``/``lambda_ema``: None, as flodl emits them.
``GuardTelemetry {epoch, step, values}``
    the trend guard's (the default) ``d_history_last``, which is ``d_raw``. The MSF
    guard's lambda is not in the record: no event for it, nor for ``--guard none``.
``MetaNudge {factor, from, to, fired}``
    the meta-controller shrank the anchor (the ``drift`` alert names it). ``factor`` is
    not in the record: None. ``to`` is the anchor after the window where the meta's nudge
    alone moved it, None where the guard moved it too (async relax-up, a guard nudge).
    ``fired``: the detectors (``lr_drop``, ``convergence``), ours.
``AnchorChanged {from, to}``
    whenever a call changed ``anchor``.
``Throttle {rank}``
    each ``Throttle`` the coordinator sent a rank; the CPU sync barrier's broadcast
    ``Throttle`` holds every rank at once: ``rank`` None.
``DivergenceEpoch {epoch, sync_count, d_min, d_max, d_mean, lambda_min, lambda_max,
lambda_mean, lambda_ema_at_epoch_end, d_at_epoch_end, k_at_epoch_end}``
    at each ``EpochAggregated``, over the ``Divergence`` events since the last one (as
    flodl drains its aggregator); none when there were none. The lambdas: None.
``LostBroadcast {control, failures}``
    a broadcast the bus refused (the runtime records ``lost_broadcast``), ``failures`` the
    live ranks it addressed; and each per-rank ``Update`` that could not be sent
    (``send_failed``), ``failures`` 1. Exempt as in flodl: ``Shutdown``, anything once
    the run is shutting down, and a cohort with nobody alive.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

from flodl_bus.record import states

#: the live events of a run, one JSON object a line, beside its coordinator record
EVENTS_FILE: Final = "events.jsonl"

KINDS: Final = (
    "SyncStart",
    "SyncEnd",
    "CpuAvgStart",
    "CpuAvgEnd",
    "Divergence",
    "GuardTelemetry",
    "MetaNudge",
    "AnchorChanged",
    "Throttle",
    "DivergenceEpoch",
    "LostBroadcast",
)

#: the free-form record event the runtime writes for a broadcast the bus refused
LOST_BROADCAST: Final = "lost_broadcast"

#: one timeline event (see the module docstring)
Event = dict[str, Any]

_DRIFT = re.compile(r"anchor \d+ -> \d+ \(([^)]*)\)")
_SHUTDOWN_PHASE: Final = "shutdown"


def _mtype(value: Any) -> str | None:
    return value.get("type") if isinstance(value, Mapping) else None


class Timeline:
    """The fold: one instance per run, fed its core calls in record order."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        cfg = config or {}
        #: the trend guard is the default (records made before ``guard`` existed)
        self.trend_guard = cfg.get("guard", "trend") == "trend"
        mode = str(cfg.get("mode", ""))
        #: a guard Stable may still move the anchor after a meta nudge (async relax-up)
        self.relaxes = mode.endswith("async") and bool(cfg.get("relax_up"))
        epochs = cfg.get("num_epochs")
        #: the last epoch: the final reduce after it aggregated still belongs to it
        self.last_epoch: int | None = epochs - 1 if type(epochs) is int and epochs > 0 else None
        self.t0: float | None = None
        #: the last state recorded (LostBroadcast counts the live ranks in it)
        self.state: Mapping[str, Any] | None = None
        #: the open round: (clock at its trigger, most steps of a rank, cpu backend)
        self._round: tuple[float, int, bool] | None = None
        self._div: dict[int, tuple[float | None, float | None]] = {}
        self._post_norm: float | None = None
        #: (d_raw, k_max) of each close since the last EpochAggregated
        self._epoch: list[tuple[float, int]] = []

    # ------------------------------------------------------------------ input

    def core_call(
        self,
        event: str,
        i: int | None,
        now: float,
        before: Mapping[str, Any],
        after: Mapping[str, Any],
        out: Sequence[Mapping[str, Any]],
        msg: Mapping[str, Any] | None = None,
        sender: int | None = None,
    ) -> list[Event]:
        """The events of one core call (``start``, ``dispatch``, ``tick``...), its
        message and effects in record form (``record.dispatch.record_value``)."""
        if self.t0 is None:
            self.t0 = now
        self.state = after
        evs: list[Event] = []
        mtype = _mtype(msg)
        # The core ignores a dead rank's messages (no resurrection).
        if (
            mtype == "SyncAck"
            and event == "dispatch"
            and sender is not None
            and sender not in before.get("dead", ())
        ):
            assert msg is not None
            self._div[sender] = (msg.get("divergence"), msg.get("pre_norm"))
            if self._post_norm is None:
                self._post_norm = msg.get("post_norm")
        if event == "send_failed" and mtype == "Update":
            evs += self._lost(i, now, "Update", 1)
        closes = event != "start" and after.get("avg_count", 0) != before.get("avg_count", 0)
        moved = before.get("anchor") != after.get("anchor")
        if not out and not closes and not moved:
            return evs
        trigger = close = -1
        for k, o in enumerate(out):
            t = _mtype(o.get("msg"))
            if o.get("kind") != "Broadcast":
                continue
            if trigger < 0 and t in ("SyncNow", "RequestParams"):
                trigger = k
            # The close's own SetGlobalStep carries the step it reached.
            if (
                closes
                and close < 0
                and t == "SetGlobalStep"
                and o["msg"].get("global_step") == after.get("global_step")
            ):
                close = k
        if closes and close < 0:
            close = trigger if trigger >= 0 else 0
        for k in range(len(out) + 1):
            if k == trigger:
                evs += self._open(i, now, before, out[k]["msg"]["type"] == "RequestParams")
            if k == close:
                evs += self._close(i, now, before, after, out)
            if k < len(out):
                evs += self._effect(i, now, out[k])
        if moved and not closes:
            evs.append(self._anchor(i, now, before["anchor"], after["anchor"]))
        if (
            self._round is not None
            and before.get("cpu_pending")
            and not after.get("cpu_pending")
            and not closes
        ):
            self._round = None  # the stall ceiling cut the round: no SyncEnd (flodl)
        return evs

    def runtime_event(self, name: str, now: float, fields: Mapping[str, Any]) -> list[Event]:
        """The events of a free-form record line the runtime wrote (``lost_broadcast``)."""
        if name != LOST_BROADCAST:
            return []
        state = self.state or {}
        steps = state.get("steps") or ()
        gone = set(state.get("dead", ())) | set(state.get("exited", ()))
        live = sum(1 for r in range(len(steps)) if r not in gone)
        return self._lost(None, now, str(fields.get("control")), live)

    # ------------------------------------------------------------------ pieces

    def _ev(self, kind: str, i: int | None, now: float, **fields: Any) -> Event:
        t0 = self.t0 if self.t0 is not None else now
        ev: Event = {"kind": kind, "i": i, "now": now, "elapsed_ms": (now - t0) * 1e3}
        ev.update(fields)
        return ev

    def _anchor(self, i: int | None, now: float, was: Any, now_is: Any) -> Event:
        return self._ev("AnchorChanged", i, now, **{"from": was, "to": now_is})

    def _open(self, i: int | None, now: float, before: Mapping[str, Any], cpu: bool) -> list[Event]:
        self._round = (now, max(before.get("steps") or [0]), cpu)
        evs = [self._ev("SyncStart", i, now)]
        if cpu:
            evs.append(self._ev("CpuAvgStart", i, now))
        return evs

    def _close(
        self,
        i: int | None,
        now: float,
        before: Mapping[str, Any],
        after: Mapping[str, Any],
        out: Sequence[Mapping[str, Any]],
    ) -> list[Event]:
        evs: list[Event] = []
        opened = self._round
        if opened is None:  # a world of one: the window closes without a round
            opened = (now, max(before.get("steps") or [0]), False)
            evs.append(self._ev("SyncStart", i, now))
        started, k_max, cpu = opened
        ws = len(after.get("steps") or ())
        gone = set(before.get("dead", ())) | set(before.get("exited", ()))
        slots = [self._div.get(r) if r not in gone else None for r in range(ws)]
        deltas = [s[0] if s is not None else None for s in slots]
        d_raw = max((d for d in deltas if d is not None and d == d), default=0.0)
        step = after.get("global_step")
        epoch = int(before.get("last_aggregated", -1)) + 1
        if self.last_epoch is not None:
            epoch = min(epoch, self.last_epoch)
        for o in out:
            if o.get("kind") == "Alert" and o.get("event") == "drift":
                found = _DRIFT.search(str(o.get("detail", "")))
                why = [w.strip() for w in found.group(1).split(",")] if found else []
                fired = [w for w in why if w != "guard"]
                if fired:
                    alone = "guard" not in why and not self.relaxes
                    evs.append(
                        self._ev(
                            "MetaNudge",
                            i,
                            now,
                            factor=None,
                            to=after.get("anchor") if alone else None,
                            fired=fired,
                            **{"from": before.get("anchor")},
                        )
                    )
        evs.append(
            self._ev(
                "Divergence",
                i,
                now,
                d_raw=d_raw,
                lambda_raw=None,
                lambda_ema=None,
                k_used=int(step or 0) - int(before.get("global_step") or 0),
                k_max=k_max,
                step=step,
                deltas=deltas,
                post_norm=self._post_norm,
                pre_norms=[s[1] if s is not None else None for s in slots],
                epoch=epoch,
            )
        )
        if self.trend_guard:
            evs.append(
                self._ev(
                    "GuardTelemetry",
                    i,
                    now,
                    epoch=epoch,
                    step=step,
                    values={"d_history_last": d_raw},
                )
            )
        if before.get("anchor") != after.get("anchor"):
            evs.append(self._anchor(i, now, before["anchor"], after["anchor"]))
        ms = (now - started) * 1e3
        if cpu:
            evs.append(self._ev("CpuAvgEnd", i, now, duration_ms=ms))
        evs.append(self._ev("SyncEnd", i, now, duration_ms=ms))
        self._epoch.append((d_raw, k_max))
        self._round = None
        self._div = {}
        self._post_norm = None
        return evs

    def _effect(self, i: int | None, now: float, o: Mapping[str, Any]) -> list[Event]:
        t = _mtype(o.get("msg"))
        if t == "Throttle":
            rank = o.get("rank") if o.get("kind") == "Send" else None
            return [self._ev("Throttle", i, now, rank=rank)]
        if t == "EpochAggregated" and o.get("kind") == "Broadcast" and self._epoch:
            ds = [d for d, _ in self._epoch]
            last_d, last_k = self._epoch[-1]
            self._epoch = []
            metrics = o["msg"].get("metrics") or {}
            return [
                self._ev(
                    "DivergenceEpoch",
                    i,
                    now,
                    epoch=metrics.get("epoch"),
                    sync_count=len(ds),
                    d_min=min(ds),
                    d_max=max(ds),
                    d_mean=sum(ds) / len(ds),
                    lambda_min=None,
                    lambda_max=None,
                    lambda_mean=None,
                    lambda_ema_at_epoch_end=None,
                    d_at_epoch_end=last_d,
                    k_at_epoch_end=last_k,
                )
            ]
        return []

    def _lost(self, i: int | None, now: float, control: str, failures: int) -> list[Event]:
        phase = (self.state or {}).get("phase")
        if control == "Shutdown" or phase == _SHUTDOWN_PHASE or failures <= 0:
            return []
        return [self._ev("LostBroadcast", i, now, control=control, failures=failures)]


def derive(records: Iterable[dict[str, Any]]) -> Iterator[Event]:
    """The events of a coordinator record's lines (``record.log.read_records``), in
    order. Deltas are expanded here; a record made before deltas reads the same."""
    tl: Timeline | None = None
    for rec in states.expand(records):
        name = rec.get("event")
        if name == "run":
            cfg = rec.get("config")
            tl = Timeline(cfg if isinstance(cfg, Mapping) else None)
            continue
        if tl is None:
            tl = Timeline()
        if isinstance(rec.get("after"), Mapping) and isinstance(rec.get("before"), Mapping):
            msg = rec.get("msg")
            yield from tl.core_call(
                str(name),
                rec.get("i"),
                float(rec.get("now") or 0.0),
                rec["before"],
                rec["after"],
                rec.get("out") or [],
                msg if isinstance(msg, Mapping) else None,
                rec.get("sender", rec.get("rank")),
            )
        elif name == LOST_BROADCAST:
            yield from tl.runtime_event(name, float(rec.get("now") or 0.0), rec)
