"""Replaying one rank: a fresh ``WorkerControl`` behind the rank runtime's own router."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from flodl_bus.bus.ids import parse_id
from flodl_bus.bus.streams import RedisRankBus
from flodl_bus.partition import SHUFFLE_BASE_SEED
from flodl_bus.protocol import signing, wire
from flodl_bus.protocol.messages import AveragedParams, ControlMsg, EpochPlan, StartEpoch, Update
from flodl_bus.replay.engine import (
    REPLAY_KEYS,
    ReplayResult,
    _dead_letters,
    _drain,
    _ident,
    _msg_of,
    _Replay,
    _seed,
    norm,
)
from flodl_bus.replay.load import Recording
from flodl_bus.replay.ports import RecordedClock, RecordedModel, RecordedParams, Script
from flodl_bus.worker.control import WorkerControl
from flodl_bus.worker.inbox import Inbox
from flodl_bus.worker.recording import log_record
from flodl_bus.worker.runtime import RankRuntime


class RankReplay(_Replay):
    def __init__(self, rec: Recording, *, explore: bool = False) -> None:
        super().__init__(rec, explore=explore)
        h = rec.header
        rank = rec.rank
        assert rank is not None
        self.rank = rank
        inputs: dict[tuple[str, str], dict[str, Any]] = {}
        for ev in rec.events:
            if ev.get("event") == "read":
                for e in ev.get("entries", ()):
                    inputs.setdefault((e["stream"], e["id"]), e)
            elif ev.get("event") in ("dispatch", "take") and ev.get("stream"):
                inputs.setdefault((ev["stream"], ev["id"]), ev)
        _seed(self.client, self.keys, inputs)
        self.bus = RedisRankBus(
            self.client, self.keys, rank, signing.rank_keys_for(REPLAY_KEYS, rank), where="replay"
        )
        self.script = Script()
        self.params = RecordedParams(self.script)
        self.inbox = Inbox()
        self.control = WorkerControl(
            rank=rank,
            params=self.params,
            batch_size=int(h.get("batch_size", 1)),
            pick_space=int(h.get("pick_space", 0)),
            clock=RecordedClock(self.script),
            model=RecordedModel(self.script, h.get("model")),
            seed=int(h.get("seed", SHUFFLE_BASE_SEED)),
            splits=int(h.get("splits", 1)),
        )
        # The runtime's router, not its threads: heartbeats, dead-rank notices, session
        # requests and the wire Update's next plan are handled exactly as in the run.
        self.runtime = RankRuntime(
            bus=self.bus,
            inbox=self.inbox,
            params=self.params,
            world_size=int(h.get("world_size", 1)),
        )
        self.pending: deque[tuple[ControlMsg, tuple[str, str] | None]] = deque()
        self.taken_plan: EpochPlan | None = None

    def run(self) -> ReplayResult:
        try:
            deliveries = _drain(self.bus.read_control)
            self.runtime.route(deliveries)
            self.bus.ack(deliveries)
            while (msg := self.inbox.poll()) is not None:
                self.pending.append((msg, self.inbox.last_origin))
            handlers = {
                "dispatch": self._dispatch,
                "take": self._take,
                "plan": self._plan,
                "step": self._step,
                "closed": self._closed,
            }
            for ev in self.rec.core_events():
                handlers[ev["event"]](ev)
                self.result.replayed += 1
                if self.stopped:
                    break
            self.result.dead_letters = _dead_letters(self.client, self.keys)
        finally:
            self.bus.flush(2.0)
            self.bus.close()
        return self.result

    # -- inputs

    def _consume(self, ev: Mapping[str, Any]) -> ControlMsg | None:
        want = (ev["stream"], ev["id"])
        want_id = parse_id(ev["id"])
        while True:
            if not self.pending:
                self.missing(ev, None)
                return None
            msg, origin = self.pending[0]
            if origin == want:
                self.pending.popleft()
                return msg
            if origin is not None and parse_id(origin[1]) < want_id:
                # Delivered, and the record never consumed it here.
                self.diverge(ev, "entry", f"{want[0]} {want[1]}", f"{origin[0]} {origin[1]}")
                if self.stopped:
                    return None
                self.pending.popleft()
                self._extra(msg, origin)
                continue
            self.missing(ev, f"{origin[0]} {origin[1]}" if origin else None)
            return None

    def _extra(self, msg: ControlMsg, origin: tuple[str, str]) -> None:
        ev = {"event": "dispatch", "i": -1, "stream": origin[0], "id": origin[1], "extra": True}
        self.result.actual.append({**ev, **self._run(msg, None)})

    @staticmethod
    def _local(data: Mapping[str, Any]) -> ControlMsg:
        if data.get("local"):
            n_params, n_buffers = data.get("tensors", (0, 0))
            avg = AveragedParams(
                params=(None,) * int(n_params),
                buffers=(None,) * int(n_buffers),
                version=int(data["version"]),
                realized=bool(data["realized"]),
            )
            return Update(avg)
        msg: ControlMsg = _msg_of(data)
        return msg

    # -- core calls

    def _run(self, msg: ControlMsg, calls: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
        control = self.control
        before = control.state()
        self.script.load(calls)
        actual: dict[str, Any] = {"msg": msg, "before": before}
        try:
            out = control.dispatch(msg)
        except Exception as exc:
            actual["out"] = []
            actual["raised"] = [type(exc).__name__, str(exc)]
            logs = []
        else:
            actual["out"] = list(out.upstream)
            actual["stop"] = out.stop
            actual["throttled"] = out.throttled
            logs = [log_record(line) for line in out.logs]
            for up in out.upstream:
                self.bus.publish(up)
        actual["calls"] = self.script.actual
        actual["logs"] = logs
        actual["after"] = control.state()
        return {k: norm(v) for k, v in actual.items()}

    def _message_of(self, ev: Mapping[str, Any]) -> Any:
        """The message an event fed the core: the next one off its stream (None when the
        stream has not got it: already reported) or one injected in process."""
        if ev.get("stream"):
            return self._consume(ev)
        return self._local(ev["msg"])

    def _dispatch(self, ev: Mapping[str, Any]) -> None:
        msg = self._message_of(ev)
        if msg is None:
            return
        actual = self._run(msg, ev.get("calls"))
        self.result.actual.append({**_ident(ev), **actual})
        fields = ("msg", "before", "calls", "out", "raised", "logs", "stop", "throttled", "after")
        self.compare(ev, actual, fields)

    def _take(self, ev: Mapping[str, Any]) -> None:
        msg = self._message_of(ev)
        if msg is None:
            return
        if ev.get("why") == "plan" and isinstance(msg, StartEpoch):
            self.taken_plan = msg.plan
        actual = {"msg": norm(msg), "why": ev.get("why")}
        self.result.actual.append({**_ident(ev), **actual})
        self.compare(ev, actual, ("msg",))

    def _plan(self, ev: Mapping[str, Any]) -> None:
        control = self.control
        if ev.get("source") == "taken":
            plan, self.taken_plan = self.taken_plan, None
        else:
            plan = control.take_pending_plan()
        if plan is None:
            self.diverge(ev, "plan", ev.get("plan"), None)
            if self.stopped:
                return
            plan = _msg_of({"v": 1, "type": "StartEpoch", "plan": ev["plan"]}).plan
        assert plan is not None
        picks = control.begin_plan(plan)
        actual = norm(
            {"plan": wire.to_map(StartEpoch(plan))["plan"], "partition_len": len(picks)}
        ) | {"after": norm(control.state()), "source": ev.get("source")}
        self.result.actual.append({**_ident(ev), **actual})
        self.compare(ev, actual, ("plan", "partition_len", "after"))

    def _step(self, ev: Mapping[str, Any]) -> None:
        loss, batch_ms, data_ms, lr = (
            float(x) if x is not None else float("nan") for x in ev["args"]
        )
        self.script.load(ev.get("calls"))
        out = self.control.step_done(loss, batch_ms, data_ms, lr)
        for up in out:
            self.bus.publish(up)
        actual = {
            "args": norm(ev["args"]),
            "calls": norm(self.script.actual),
            "out": norm(list(out)),
            "after": norm(self.control.state()),
        }
        self.result.actual.append({**_ident(ev), **actual})
        self.compare(ev, actual, ("calls", "out", "after"))

    def _closed(self, ev: Mapping[str, Any]) -> None:
        out = self.control.channel_closed()
        actual = {"out": norm(out), "after": norm(self.control.state())}
        self.result.actual.append({**_ident(ev), **actual})
        self.compare(ev, actual, ("out", "after"))
