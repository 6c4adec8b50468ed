"""Replaying the coordinator: a fresh ``Coordinator`` reading its upstream through the
coordinator's own bus class."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flodl_bus.bus.api import Delivery
from flodl_bus.bus.ids import parse_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.streams import RedisCoordinatorBus
from flodl_bus.coordinator.config import LEGACY_DEFAULTS, CoordinatorConfig, MaxFailure
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Broadcast, Out, Send
from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import SyncAck, is_upstream
from flodl_bus.replay.engine import (
    REPLAY_KEYS,
    REPLAY_STREAMS,
    ReplayResult,
    _msg_of,
    _Replay,
    brief,
    norm,
)
from flodl_bus.replay.load import DamagedRecord, Recording


def config_from_header(header: Mapping[str, Any]) -> CoordinatorConfig:
    raw = header.get("config")
    if not isinstance(raw, Mapping):
        raise ValueError("the coordinator record has no config in its run header")
    known = set(CoordinatorConfig.__dataclass_fields__)
    kwargs: dict[str, Any] = {k: v for k, v in LEGACY_DEFAULTS.items() if k not in raw}
    for k, v in raw.items():
        if k not in known:
            continue
        if k == "max_failure" and isinstance(v, Mapping):
            v = MaxFailure(absolute=v.get("absolute"), percent=v.get("percent"))
        elif (
            k
            in (
                "partition_ratios",
                "speed_hints",
                "device_scores",
                "checkpoint_at_epoch",
            )
            and v is not None
        ):
            v = tuple(v)
        kwargs[k] = v
    return CoordinatorConfig(**kwargs)


def _rank_of_stream(stream: str) -> int:
    return int(stream.rsplit(":", 1)[1])


@dataclass
class RankView:
    """What the coordinator last said to one rank and last heard from it."""

    told: tuple[float, Any] | None = None
    acked: tuple[float, Any] | None = None


class _UpVerifiers(dict[str, Any]):
    """The replay key of whichever rank's upstream stream is asked for."""

    def __init__(self, run_keys: RunKeys) -> None:
        super().__init__()
        self.run_keys = run_keys

    def __missing__(self, stream: str) -> Any:
        rank = self.run_keys.rank_of(stream)
        if rank is None:
            raise KeyError(stream)
        self[stream] = key = REPLAY_KEYS.rank(rank)
        return key


def launch_time(header: Mapping[str, Any]) -> float | None:
    """The coordinator's clock at its launch, when the record says (``--until`` counts
    from there)."""
    for name in ("launched_at", "t0"):
        value = header.get(name)
        if isinstance(value, (int, float)):
            return float(value)
    return None


class CoordinatorReplay(_Replay):
    def __init__(
        self,
        rec: Recording,
        *,
        explore: bool = False,
        until: float | None = None,
        keep_actual: bool = True,
        allow_incomplete: bool = True,
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
        self.config = config_from_header(h)
        meta = h.get("resume_meta", h.get("resume"))
        self.core = (
            Coordinator.from_meta(self.config, meta)
            if isinstance(meta, Mapping)
            else Coordinator(self.config)
        )
        ws = self.config.world_size
        for r in range(ws):
            REPLAY_KEYS.rank(r)
        self.bus = RedisCoordinatorBus(
            self.client,
            self.keys,
            REPLAY_KEYS,
            ranks=range(ws),
            config=REPLAY_STREAMS,
            where="replay",
        )
        if transport == "direct":
            self.use_direct(_UpVerifiers(self.keys), wire.UPSTREAM)
        self.buffers: dict[str, deque[Delivery]] = {}
        #: the clock reading ``until`` counts from: the launch, else the first event's
        self.t0 = launch_time(h)
        #: seconds after ``t0``: stop before the first event past it
        self.until = until
        self.views = [RankView() for _ in range(ws)]
        self._checked_world = False

    def inputs_of(self, ev: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        if ev.get("event") != "dispatch" or not ev.get("stream"):
            return []
        rank = _rank_of_stream(ev["stream"])
        self.bus.add_rank(rank)  # a no-op for a rank it reads already
        return [ev]

    def deliver(self, n: int) -> None:
        got = self.delivered(n, self.bus.read_upstream)
        last: dict[str, str] = {}
        for d in got:
            self.buffers.setdefault(d.stream, deque()).append(d)
            last[d.stream] = d.entry_id
        self.bus.ack(got)
        self.feeder.trim(last)

    def run(self) -> ReplayResult:
        try:
            for ev in self.windowed(self.rec.stream(allow_incomplete=self.allow_incomplete)):
                now = ev.get("now")
                if isinstance(now, (int, float)):
                    if self.t0 is None:
                        self.t0 = float(now)
                    if self.until is not None and now - self.t0 > self.until:
                        break
                self._event(ev)
                self.result.replayed += 1
                self.last_event = ev
                if self.stopped:
                    break
            self.result.dead_letters = self.dead_letters()
        finally:
            self.bus.close()
        return self.result

    def check_world(self, ev: Mapping[str, Any]) -> None:
        """The header's world size against the events' per-rank state (once)."""
        if self._checked_world or ev.get("synthetic"):
            return
        after = ev.get("after")
        steps = after.get("steps") if isinstance(after, Mapping) else None
        if isinstance(steps, list):
            self._checked_world = True
            if len(steps) != self.config.world_size:
                raise DamagedRecord(
                    self.rec.path or self.rec.key,
                    0,
                    f"the header's world_size {self.config.world_size} disagrees with the "
                    f"events (state of {len(steps)} ranks at i={ev.get('i')})",
                )

    def _consume(self, ev: Mapping[str, Any]) -> Any:
        stream = ev["stream"]
        want = parse_id(ev["id"])
        q = self.buffers.get(stream, deque())
        while q:
            head = q[0]
            hid = parse_id(head.entry_id)
            if hid == want:
                q.popleft()
                return head.msg
            if hid > want:
                break
            self.diverge(ev, "entry", f"{stream} {ev['id']}", f"{stream} {head.entry_id}")
            if self.stopped:
                return None
            q.popleft()
            self._extra(head, float(ev.get("now", 0.0)))
        self.missing(ev, f"{stream} {q[0].entry_id}" if q else None)
        return None

    def _extra(self, d: Delivery, now: float) -> None:
        """An entry the record never consumed here: handled now, as the runtime would."""
        sender = _rank_of_stream(d.stream)
        ev = {"event": "dispatch", "i": -1, "stream": d.stream, "id": d.entry_id, "extra": True}
        msg = d.msg
        assert is_upstream(msg), type(msg).__name__
        actual = self._call(lambda: self.core.handle(sender, msg, now))
        self.keep(ev, {"msg": norm(d.msg), **actual})

    def _call(self, fn: Any) -> dict[str, Any]:
        # The core changes only through these calls: the last "after" is this "before".
        before = self._after if self._after is not None else norm(self.core.state_summary())
        out: list[Out] = fn()
        after = norm(self.core.state_summary())
        self._after = after
        for o in out:
            self._effect(o)
        return {"before": before, "out": norm(out), "after": after}

    _after: Any = None

    def _effect(self, o: Out) -> None:
        t = self._now_rel
        if isinstance(o, Send):
            self.bus.send(o.rank, o.msg)
            if 0 <= o.rank < len(self.views):
                self.views[o.rank].told = (t, norm(o.msg))
        elif isinstance(o, Broadcast):
            self.bus.broadcast(o.msg)
            for v in self.views:
                v.told = (t, norm(o.msg))

    _now_rel = 0.0

    def _event(self, ev: Mapping[str, Any]) -> None:
        self.check_world(ev)
        kind = ev["event"]
        now = float(ev.get("now", 0.0))
        self._now_rel = now - (self.t0 or 0.0)
        core = self.core
        fields: tuple[str, ...] = ("before", "out", "after")
        extra: dict[str, Any] = {}
        if kind == "start":
            actual = self._call(lambda: core.start(now))
        elif kind == "tick":
            behind = bool(ev.get("behind", False))
            actual = self._call(lambda: core.tick(now, behind=behind))
        elif kind == "dispatch":
            msg = self._consume(ev)
            if msg is None:
                return
            sender = ev.get("sender")
            rank = int(sender) if sender is not None else _rank_of_stream(ev["stream"])
            if isinstance(msg, SyncAck) and 0 <= rank < len(self.views):
                self.views[rank].acked = (self._now_rel, norm(msg))
            actual = self._call(lambda: core.handle(rank, msg, now))
            extra = {"msg": norm(msg)}
            fields = ("msg", "before", "out", "after")
        elif kind == "send_failed":
            msg = _msg_of(ev["msg"])
            actual = self._call(lambda: core.send_failed(int(ev["rank"]), msg, now))
        elif kind == "declare_dead":
            actual = self._call(lambda: core.declare_dead(int(ev["rank"]), now))
        elif kind == "interrupt":
            actual = self._call(lambda: core.interrupt(now))
        else:
            return
        actual |= extra
        self.keep(ev, actual)
        self.compare(ev, actual, fields)

    def state_at(self, label: str | None = None) -> str:
        """The coordinator's state where the replay stopped (``--until``)."""
        core = self.core
        s = core.state_summary()
        open_, why = core.gate()
        at = self.last_event.get("i") if self.last_event else None
        lines = [
            f"coordinator at {label or f't={self.until or 0.0:.3f}s'} (after event i={at}, "
            f"{self.result.replayed} events replayed)",
            f"phase {s['phase']}, version {s['version']}, global_step {s['global_step']}, "
            f"averages {s['avg_count']}, anchor {s['anchor']}",
            f"gate: {'open' if open_ else 'closed'}" + ("" if open_ else f" ({why})"),
        ]
        for r, v in enumerate(self.views):
            flags = [
                name
                for name, members in (("dead", s["dead"]), ("exited", s["exited"]))
                if r in members
            ]
            if r in s["throttled"]:
                flags.append("throttled")
            told = f"{brief(v.told[1])} at t={v.told[0]:.3f}s" if v.told else "nothing"
            acked = f"{brief(v.acked[1])} at t={v.acked[0]:.3f}s" if v.acked else "nothing"
            lines.append(
                f"rank {r}{' [' + ', '.join(flags) + ']' if flags else ''}: "
                f"steps {s['steps'][r]}/{s['counts'][r]}, acked {s['acks'][r]}, "
                f"in flight {s['in_flight'][r]}, epoch {s['rank_epoch'][r]}"
            )
            lines.append(f"  last told: {told}")
            lines.append(f"  last ack:  {acked}")
        return "\n".join(lines)
