"""Replaying one rank: a fresh ``WorkerControl`` behind the rank runtime's own router."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from flodl_bus.bus import entries as bus_entries
from flodl_bus.bus.api import Delivery
from flodl_bus.bus.ids import parse_id
from flodl_bus.bus.streams import RedisRankBus
from flodl_bus.partition import SHUFFLE_BASE_SEED
from flodl_bus.protocol import signing, wire
from flodl_bus.protocol.messages import AveragedParams, ControlMsg, EpochPlan, StartEpoch, Update
from flodl_bus.replay.engine import (
    REPLAY_KEYS,
    REPLAY_STREAMS,
    ReplayResult,
    _msg_of,
    _Replay,
    _short,
    brief,
    norm,
)
from flodl_bus.replay.load import Recording
from flodl_bus.replay.ports import RecordedClock, RecordedModel, RecordedParams, Script
from flodl_bus.worker.control import WorkerControl
from flodl_bus.worker.inbox import Inbox
from flodl_bus.worker.recording import log_record
from flodl_bus.worker.runtime import RankRuntime


class RankReplay(_Replay):
    def __init__(
        self,
        rec: Recording,
        *,
        explore: bool = False,
        keep_actual: bool = True,
        allow_incomplete: bool = True,
        until: float | None = None,
        transport: str = "direct",
    ) -> None:
        super().__init__(
            rec,
            explore=explore,
            keep_actual=keep_actual,
            allow_incomplete=allow_incomplete,
            transport=transport,
        )
        h = rec.header
        rank = rec.rank
        assert rank is not None
        self.rank = rank
        #: stop before the first event whose ``now`` (the rank's clock) is past this
        self.until = until
        REPLAY_KEYS.rank(rank)  # its slot in the broadcasts' MAC vector, before any is fed
        rank_keys = signing.rank_keys_for(REPLAY_KEYS, rank)
        self.bus = RedisRankBus(
            self.client, self.keys, rank, rank_keys, config=REPLAY_STREAMS, where="replay"
        )
        if transport == "direct":
            self.use_direct(
                {
                    self.keys.ctl(rank): rank_keys.rank_key,
                    self.keys.ctl_all_of(rank): rank_keys.broadcast_verifier(rank),
                },
                wire.CONTROL,
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
            # records made before the LR was reported only when it changed have no key
            lr_every_step=h.get("lr_reports") != "changed",
            plans_wait_for_update=bool(h.get("plans_wait_for_update", False)),
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
        self.last_now: float | None = None
        self._after: Any = None

    def inputs_of(self, ev: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        kind = ev.get("event")
        if kind == "read":
            return list(ev.get("entries", ()))
        if kind in ("dispatch", "take") and ev.get("stream"):
            return [ev]
        return []

    def deliver(self, n: int) -> None:
        deliveries = self.delivered(n, self.bus.read_control)
        route(self.runtime, deliveries)
        self.bus.ack(deliveries)
        while (msg := self.inbox.poll()) is not None:
            self.pending.append((msg, self.inbox.last_origin))
        last: dict[str, str] = {}
        for d in deliveries:
            last[d.stream] = d.entry_id
        self.feeder.trim(last)

    def run(self) -> ReplayResult:
        handlers = {
            "dispatch": self._dispatch,
            "take": self._take,
            "plan": self._plan,
            "step": self._step,
            "closed": self._closed,
        }
        try:
            for ev in self.windowed(self.rec.stream(allow_incomplete=self.allow_incomplete)):
                handler = handlers.get(ev.get("event", ""))
                if handler is None:
                    continue
                now = ev.get("now")
                if isinstance(now, (int, float)):
                    if self.until is not None and now > self.until:
                        break
                    self.last_now = float(now)
                handler(ev)
                self.result.replayed += 1
                self.last_event = ev
                if self.stopped:
                    break
            self.result.dead_letters = self.dead_letters()
        finally:
            self.bus.close()
        return self.result

    def state_at(self, label: str) -> str:
        """The rank's state where the replay stopped (``--until``)."""
        at = self.last_event.get("i") if self.last_event else None
        lines = [
            f"rank {self.rank} at {label} (after event i={at}, "
            f"{self.result.replayed} events replayed; rank clock "
            f"{self.last_now if self.last_now is not None else 0.0:.3f}s)"
        ]
        for k, v in self.control.state().items():
            lines.append(f"  {k}: {_short(norm(v), 200)}")
        waiting = [brief(norm(m)) for m, _ in list(self.pending)[:5]]
        lines.append(
            f"  delivered, not yet taken: {len(self.pending)}"
            + (
                f" ({', '.join(waiting)}{'...' if len(self.pending) > 5 else ''})"
                if waiting
                else ""
            )
        )
        return "\n".join(lines)

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
        self.keep(ev, self._run(msg, None))

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
        # The core changes only through the calls replayed here, each of which keeps its
        # "after": the last one is this call's "before".
        before = self._after if self._after is not None else norm(control.state())
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
            _encodable(out.upstream)
        actual["calls"] = self.script.actual
        actual["logs"] = logs
        after = norm(control.state())
        self._after = after
        out_json = {k: norm(v) for k, v in actual.items() if k != "before"}
        return {**out_json, "before": before, "after": after}

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
        self.keep(ev, actual)
        fields = ("msg", "before", "calls", "out", "raised", "logs", "stop", "throttled", "after")
        self.compare(ev, actual, fields)

    def _take(self, ev: Mapping[str, Any]) -> None:
        msg = self._message_of(ev)
        if msg is None:
            return
        if ev.get("why") == "plan" and isinstance(msg, StartEpoch):
            self.taken_plan = msg.plan
        actual = {"msg": norm(msg), "why": ev.get("why")}
        self.keep(ev, actual)
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
        self._after = actual["after"]
        self.keep(ev, actual)
        self.compare(ev, actual, ("plan", "partition_len", "after"))

    def _step(self, ev: Mapping[str, Any]) -> None:
        loss, batch_ms, data_ms, lr = (
            float(x) if x is not None else float("nan") for x in ev["args"]
        )
        self.script.load(ev.get("calls"))
        out = [m for m in self.control.step_done(loss, batch_ms, data_ms, lr) if m is not None]
        _encodable(out)
        actual = {
            "args": norm(ev["args"]),
            "calls": norm(self.script.actual),
            "out": norm(out),
            "after": norm(self.control.state()),
        }
        self._after = actual["after"]
        self.keep(ev, actual)
        self.compare(ev, actual, ("calls", "out", "after"))

    def _closed(self, ev: Mapping[str, Any]) -> None:
        out = self.control.channel_closed()
        actual = {"out": norm(out), "after": norm(self.control.state())}
        self._after = actual["after"]
        self.keep(ev, actual)
        self.compare(ev, actual, ("out", "after"))


def _encodable(msgs: Sequence[object]) -> None:
    """What the rank emitted is compared as messages (``out``); it is not written
    upstream (nothing reads it here), only put through the wire encoder the publisher
    would use, so a message the bus could not carry still fails the replay."""
    for msg in msgs:
        bus_entries.encode(msg)


def route(runtime: RankRuntime, deliveries: Sequence[Delivery]) -> None:
    """The runtime's routing of one read, as its reader thread does it."""
    runtime.route(deliveries)
