"""``flodl-bus replay RUN_DIR [--role coordinator|rank:R] [--until T]``.

A recorded run is re-fed to FRESH cores through the same transport code it ran on:

1. every entry the process read is written into fakeredis streams under its recorded id
   (re-signed with a replay key: the run's secret is never recorded);
2. the process's own bus class (``RedisRankBus`` / ``RedisCoordinatorBus``) reads them
   back on a fakeredis client, with its cursor, ordering, authentication and dead-letter
   rules; a rank's deliveries go through the rank runtime's own router into its inbox;
3. the recorded core calls are walked in order (``i``): each consumes the entry the record
   says it consumed, drives the core, and compares the state before, every port call,
   everything emitted and the state after with the record. Ports, the clock and training
   steps are answered from the record (``record.ports``), so no model is needed.

Exit status 0 with ``identical (N dispatches)``, or 1 with the first divergence: the
event's index, the entry, the field, expected vs actual. Nothing here reads a clock or a
random source, so a replay prints the same thing every time.

``explore=True`` (the surgery helpers' mode) does not stop at the first divergence: an
entry the record never consumed is dispatched where it appears (as the loop would between
batches), an entry the transport no longer delivers (dropped, dead-lettered) is skipped,
and synthetic ticks are run; ``ReplayResult.actual`` is the new record.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fakeredis
import orjson

from flodl_bus.bus import entries as bus_entries
from flodl_bus.bus.api import Delivery
from flodl_bus.bus.entries import F_BODY, F_MAC, F_RANK, F_SEQ, F_TYPE
from flodl_bus.bus.ids import EntryId, parse_id
from flodl_bus.bus.keys import BROADCAST, RunKeys
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.coordinator.config import CoordinatorConfig, MaxFailure
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Broadcast, Out, Send
from flodl_bus.partition import SHUFFLE_BASE_SEED
from flodl_bus.protocol import signing, wire
from flodl_bus.protocol.messages import (
    AveragedParams,
    ControlMsg,
    EpochPlan,
    StartEpoch,
    SyncAck,
    Update,
)
from flodl_bus.record import dispatch as _dispatch  # noqa: F401  (installs the encoder)
from flodl_bus.record.log import DamagedRecord, _dumps, read_records, unjson
from flodl_bus.record.ports import RecordedClock, RecordedModel, RecordedParams, Script
from flodl_bus.record.rank import Capture, CaptureLogger
from flodl_bus.worker.control import WorkerControl
from flodl_bus.worker.inbox import Inbox
from flodl_bus.worker.runtime import RankRuntime

RANK_CORE = frozenset({"dispatch", "take", "plan", "step", "closed"})
COORD_CORE = frozenset({"start", "dispatch", "tick", "send_failed", "declare_dead", "interrupt"})
#: Stands in for the run secret (never recorded): entries are re-signed with it.
#: replay re-signs what it feeds with fixed keys (no run secret is ever recorded)
REPLAY_KEYS = signing.fixed_keys(hashlib.sha256(b"flodl-bus replay: not a run secret").digest())

# ------------------------------------------------------------------------ loading


@dataclass
class Recording:
    """One process's record: ``key`` is ``coordinator`` or ``rank:R``."""

    key: str
    header: dict[str, Any]
    #: every record with an ``i`` (core calls, and a rank's reads), in ``i`` order
    events: list[dict[str, Any]]
    #: free-form records (no ``i``), kept for tools that want them
    other: list[dict[str, Any]] = field(default_factory=list)

    @property
    def role(self) -> str:
        return "coordinator" if self.key == "coordinator" else "rank"

    @property
    def rank(self) -> int | None:
        return None if self.key == "coordinator" else int(self.key.split(":")[1])

    def core_events(self) -> list[dict[str, Any]]:
        kinds = COORD_CORE if self.role == "coordinator" else RANK_CORE
        return [e for e in self.events if e.get("event") in kinds]

    def records(self) -> list[dict[str, Any]]:
        """Everything, header first: what ``save`` writes."""
        return [self.header, *self.other, *self.events]


def recording_from_records(key: str, records: Iterable[dict[str, Any]]) -> Recording:
    """Split a process's records into header, core events and the rest.

    A rank's events are ordered by ``i`` (its reader and training threads share the
    counter but race to the file). The coordinator is one thread, so its file order is
    the order of events, and core calls it logged as free-form events (a ``start`` or
    ``send_failed`` without ``i``) keep their place.
    """
    header: dict[str, Any] = {}
    events: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    coordinator = key == "coordinator"
    for r in records:
        if r.get("event") == "run" and not header:
            header = r
        elif "i" in r or (coordinator and r.get("event") in COORD_CORE):
            events.append(r)
        else:
            other.append(r)
    if not coordinator:
        events.sort(key=lambda e: e["i"])
    numbered = sorted(e["i"] for e in events if "i" in e)
    if numbered and numbered != list(range(numbered[0], numbered[0] + len(numbered))):
        missing = sorted(set(range(numbered[0], numbered[-1] + 1)) - set(numbered))
        raise DamagedRecord(
            f"record of {key} misses core events i={missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}: it cannot be replayed as a whole"
        )
    return Recording(key=key, header=header, events=events, other=other)


def _key_of(path: Path) -> str | None:
    name = path.name
    for suffix in (".jsonl.gz", ".jsonl"):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            if stem == "coordinator":
                return "coordinator"
            if stem.startswith("rank") and stem[4:].isdigit():
                return f"rank:{int(stem[4:])}"
    return None


def load_run(run_dir: str | Path) -> dict[str, Recording]:
    """Every process record of ``run_dir`` (``coordinator.jsonl``, ``rank<r>.jsonl``,
    gzipped or not), keyed ``coordinator`` / ``rank:R`` in that order."""
    found: dict[str, Recording] = {}
    for path in sorted(Path(run_dir).iterdir()):
        key = _key_of(path)
        if key is not None and key not in found:
            found[key] = recording_from_records(key, read_records(path))

    def order(k: str) -> tuple[bool, int]:
        return (k != "coordinator", int(k[5:]) if k != "coordinator" else 0)

    return {k: found[k] for k in sorted(found, key=order)}


def save_run(run: Mapping[str, Recording], run_dir: str | Path, *, gzip: bool = False) -> Path:
    """Write ``run`` as a run directory (e.g. a surgically changed copy)."""
    import gzip as gz

    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    for key, rec in run.items():
        name = "coordinator" if key == "coordinator" else f"rank{key.split(':')[1]}"
        data = b"".join(_dumps(r) + b"\n" for r in rec.records())
        if gzip:
            (out / f"{name}.jsonl.gz").write_bytes(gz.compress(data, mtime=0))
        else:
            (out / f"{name}.jsonl").write_bytes(data)
    return out


# ------------------------------------------------------------------------ results


def norm(value: Any) -> Any:
    """The JSON form of a value as a record holds it (tuples -> lists, NaN -> null)."""
    return orjson.loads(_dumps(value))


def brief(msg: Any) -> str:
    """``StartEpoch(plan={...})`` from a recorded wire map."""
    if not isinstance(msg, dict) or "type" not in msg:
        return _short(msg)
    body = ", ".join(f"{k}={_short(v)}" for k, v in msg.items() if k not in ("v", "type", "local"))
    return f"{msg['type']}({body})"


def _short(value: Any, limit: int = 160) -> str:
    text = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS, default=str).decode()
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Divergence:
    index: int
    event: str
    where: str
    field: str
    expected: Any
    actual: Any

    def __str__(self) -> str:
        return (
            f"divergence at event i={self.index} ({self.event} {self.where}): {self.field}\n"
            f"  expected: {_short(self.expected, 2000)}\n"
            f"  actual:   {_short(self.actual, 2000)}"
        )


@dataclass
class ReplayResult:
    key: str
    replayed: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    #: the replay's own record of what the fresh core did (same schema)
    actual: list[dict[str, Any]] = field(default_factory=list)
    #: entries the transport dead-lettered: stream, entry id, reason
    dead_letters: list[dict[str, str]] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.divergences

    def summary(self) -> str:
        if self.identical:
            return f"identical ({self.replayed} dispatches)"
        return str(self.divergences[0])


def _where(ev: Mapping[str, Any]) -> str:
    msg = ev.get("msg")
    what = brief(msg) if msg is not None else ""
    if ev.get("stream"):
        return f"of {what} from {ev['stream']} id {ev['id']}"
    if ev.get("event") in ("tick", "start"):
        return f"at now={ev.get('now')}"
    return f"of {what}" if what else ""


# ------------------------------------------------------------------------ transport


def _msg_of(data: Any) -> Any:
    return wire.from_map(unjson(data))


def _seed(
    client: fakeredis.FakeRedis,
    keys: RunKeys,
    inputs: Mapping[tuple[str, str], dict[str, Any]],
) -> None:
    """Write every input entry under its recorded id, stream by stream in id order."""
    by_stream: dict[str, list[tuple[EntryId, dict[str, Any]]]] = {}
    for (stream, raw_id), entry in inputs.items():
        by_stream.setdefault(stream, []).append((parse_id(raw_id), entry))
    for stream in by_stream:
        # every rank whose stream is replayed has its slot in the broadcasts' MAC vector
        owner = keys.rank_of(stream)
        if owner is not None:
            REPLAY_KEYS.rank(owner)
    for stream in sorted(by_stream):
        rank_field = BROADCAST if stream == keys.ctl_all else stream.rsplit(":", 1)[1]
        pipe = client.pipeline(transaction=False)
        signer: signing.Signer = (
            REPLAY_KEYS.broadcast if rank_field == BROADCAST else REPLAY_KEYS.rank(int(rank_field))
        )
        for seq, (eid, entry) in enumerate(sorted(by_stream[stream], key=lambda x: x[0]), 1):
            eid_s = f"{eid[0]}-{eid[1]}"
            fields = bus_entries.build(
                signer, stream, eid_s, _msg_of(entry["msg"]), rank_field, seq
            )
            corrupt = entry.get("corrupt")
            if corrupt == "mac":
                fields[F_MAC] = b"0" * len(fields[F_MAC])
            elif corrupt is not None:
                # Damaged but correctly signed, so the reader rejects it for the damage.
                if corrupt == "body":
                    fields[F_BODY] = b"\xc1" + fields[F_BODY][1:]
                else:
                    fields[F_TYPE] = str(corrupt).encode()
                fields[F_MAC] = signer.sign(
                    signing.signed_bytes(
                        stream.encode(),
                        eid_s.encode(),
                        fields[F_TYPE],
                        fields[F_RANK],
                        fields[F_SEQ],
                        fields[F_BODY],
                    )
                )
            pipe.xadd(stream, fields, id=eid_s)  # type: ignore[arg-type]
        pipe.execute()


def _dead_letters(client: fakeredis.FakeRedis, keys: RunKeys) -> list[dict[str, str]]:
    out = []
    found: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(keys.dlq)  # type: ignore[assignment]
    for _eid, f in found:
        out.append(
            {
                "stream": f[b"stream"].decode(),
                "id": f[b"entry"].decode(),
                "reason": f[b"reason"].decode(),
            }
        )
    return out


def _drain(read: Any, tries: int = 3) -> list[Delivery]:
    """Everything the transport will deliver now (a cursor releases entries only after
    its first ``>`` read, so a few empty reads in a row mean the end)."""
    got: list[Delivery] = []
    empty = 0
    while empty < tries:
        batch = read(0)
        if batch:
            got.extend(batch)
            empty = 0
        else:
            empty += 1
    return got


# ------------------------------------------------------------------------ base


class _Replay:
    def __init__(self, rec: Recording, *, explore: bool) -> None:
        self.rec = rec
        self.explore = explore
        self.result = ReplayResult(rec.key)
        self.stopped = False
        self.client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
        run = rec.header.get("run") or "replay"
        self.keys = RunKeys(str(run))

    def diverge(self, ev: Mapping[str, Any], what: str, expected: Any, actual: Any) -> None:
        self.result.divergences.append(
            Divergence(
                int(ev.get("i", -1)), str(ev.get("event")), _where(ev), what, expected, actual
            )
        )
        if not self.explore:
            self.stopped = True

    def compare(
        self, ev: Mapping[str, Any], actual: Mapping[str, Any], fields: Sequence[str]
    ) -> None:
        if ev.get("synthetic"):
            return
        for f in fields:
            if f not in ev:
                continue  # the record did not keep it: nothing to hold the replay to
            exp, act = ev.get(f), norm(actual.get(f))
            if exp != act:
                self.diverge(ev, f, exp, act)
                return

    def dlq_reason(self, stream: str, eid: str) -> str | None:
        for d in _dead_letters(self.client, self.keys):
            if d["stream"] == stream and d["id"] == eid:
                return d["reason"]
        return None

    def missing(self, ev: Mapping[str, Any], nxt: Any) -> None:
        stream, eid = ev["stream"], ev["id"]
        reason = self.dlq_reason(stream, eid)
        actual = f"dead-lettered: {reason}" if reason else f"not delivered (next: {nxt})"
        self.diverge(ev, "entry", f"{stream} {eid}", actual)


# ------------------------------------------------------------------------ rank


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
        self.capture = Capture()
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
            logger=CaptureLogger(None, self.capture),
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
            self.runtime._route(deliveries)
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
        control, cap = self.control, self.capture
        before = control.state()
        self.script.load(calls)
        cap.begin()
        actual: dict[str, Any] = {"msg": msg, "before": before}
        try:
            out = control.dispatch(msg)
        except Exception as exc:
            actual["out"] = []
            actual["raised"] = [type(exc).__name__, str(exc)]
        else:
            actual["out"] = list(out.upstream)
            actual["stop"] = out.stop
            actual["throttled"] = out.throttled
            for up in out.upstream:
                self.bus.publish(up)
        _, logs = cap.end()
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


def _ident(ev: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("event", "i", "stream", "id", "sender", "rank", "now", "synthetic")
    return {k: ev[k] for k in keys if k in ev}


# ------------------------------------------------------------------------ coordinator


def config_from_header(header: Mapping[str, Any]) -> CoordinatorConfig:
    raw = header.get("config")
    if not isinstance(raw, Mapping):
        raise ValueError("the coordinator record has no config in its run header")
    known = set(CoordinatorConfig.__dataclass_fields__)
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        if k not in known:
            continue
        if k == "max_failure" and isinstance(v, Mapping):
            v = MaxFailure(absolute=v.get("absolute"), percent=v.get("percent"))
        elif k == "partition_ratios" and v is not None:
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


class CoordinatorReplay(_Replay):
    def __init__(
        self, rec: Recording, *, explore: bool = False, until: float | None = None
    ) -> None:
        super().__init__(rec, explore=explore)
        h = rec.header
        self.config = config_from_header(h)
        meta = h.get("resume_meta", h.get("resume"))
        self.core = (
            Coordinator.from_meta(self.config, meta)
            if isinstance(meta, Mapping)
            else Coordinator(self.config)
        )
        ws = self.config.world_size
        inputs = {
            (ev["stream"], ev["id"]): ev
            for ev in rec.events
            if ev.get("event") == "dispatch" and ev.get("stream")
        }
        _seed(self.client, self.keys, inputs)
        ranks = sorted({_rank_of_stream(s) for s, _ in inputs} | set(range(ws)))
        self.bus = RedisCoordinatorBus(
            self.client, self.keys, REPLAY_KEYS, ranks=ranks, where="replay"
        )
        self.buffers: dict[str, deque[Delivery]] = {}
        core_events = rec.core_events()
        t0 = h.get("t0")
        if not isinstance(t0, (int, float)):
            t0 = next((e["now"] for e in core_events if "now" in e), 0.0)
        self.t0 = float(t0)
        self.until = until
        self.views = [RankView() for _ in range(ws)]
        self.last_event: Mapping[str, Any] | None = None

    def run(self) -> ReplayResult:
        try:
            for d in _drain(self.bus.read_upstream):
                self.buffers.setdefault(d.stream, deque()).append(d)
            self.bus.ack([d for q in self.buffers.values() for d in q])
            for ev in self.rec.core_events():
                now = ev.get("now")
                if self.until is not None and now is not None and now - self.t0 > self.until:
                    break
                self._event(ev)
                self.result.replayed += 1
                self.last_event = ev
                if self.stopped:
                    break
            self.result.dead_letters = _dead_letters(self.client, self.keys)
        finally:
            self.bus.close()
        return self.result

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
        actual = self._call(lambda: self.core.handle(sender, d.msg, now))
        self.result.actual.append({**ev, "msg": norm(d.msg), **actual})

    def _call(self, fn: Any) -> dict[str, Any]:
        before = self.core.state_summary()
        out: list[Out] = fn()
        after = self.core.state_summary()
        for o in out:
            self._effect(o)
        return {"before": norm(before), "out": norm(out), "after": norm(after)}

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
        kind = ev["event"]
        now = float(ev.get("now", 0.0))
        self._now_rel = now - self.t0
        core = self.core
        fields: tuple[str, ...] = ("before", "out", "after")
        extra: dict[str, Any] = {}
        if kind == "start":
            actual = self._call(lambda: core.start(now))
        elif kind == "tick":
            actual = self._call(lambda: core.tick(now))
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
        self.result.actual.append({**_ident(ev), **actual})
        self.compare(ev, actual, fields)

    def state_at(self) -> str:
        """The coordinator's state where the replay stopped (``--until``)."""
        core = self.core
        s = core.state_summary()
        open_, why = core.gate()
        at = self.last_event.get("i") if self.last_event else None
        lines = [
            f"coordinator at t={self.until:.3f}s (after event i={at}, "
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


# ------------------------------------------------------------------------ API + CLI


def replay(rec: Recording, *, explore: bool = False, until: float | None = None) -> ReplayResult:
    if rec.role == "coordinator":
        return CoordinatorReplay(rec, explore=explore, until=until).run()
    return RankReplay(rec, explore=explore).run()


def replay_run(
    run: str | Path | Mapping[str, Recording], *, role: str | None = None, explore: bool = False
) -> dict[str, ReplayResult]:
    recs = load_run(run) if isinstance(run, (str, Path)) else run
    keys = [role] if role is not None else list(recs)
    return {k: replay(recs[k], explore=explore) for k in keys}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flodl-bus replay",
        description="Replay a recorded run against fresh cores over fakeredis.",
    )
    p.add_argument("run_dir", help="runs/<run-id>")
    p.add_argument("--role", help="coordinator or rank:R (default: every recorded process)")
    p.add_argument(
        "--until",
        type=float,
        help="print the coordinator's state T seconds after the run started",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from flodl_bus.record.log import configure_console

    # Transport log lines (a dead-lettered entry) go to stderr: stdout is the report,
    # and it must read the same on every replay.
    configure_console("warning")
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"flodl-bus replay: {run_dir} is not a run directory", file=sys.stderr)
        return 2
    try:
        recs = load_run(run_dir)
    except DamagedRecord as exc:
        print(f"flodl-bus replay: {exc}", file=sys.stderr)
        return 1
    if not recs:
        print(f"flodl-bus replay: no coordinator or rank<r> record in {run_dir}", file=sys.stderr)
        return 2
    role = args.role
    if role is not None and role not in recs:
        print(
            f"flodl-bus replay: no record for {role!r} in {run_dir} (have: {', '.join(recs)})",
            file=sys.stderr,
        )
        return 2
    if args.until is not None:
        if "coordinator" not in recs:
            print("flodl-bus replay: --until needs the coordinator's record", file=sys.stderr)
            return 2
        r = CoordinatorReplay(recs["coordinator"], until=args.until)
        result = r.run()
        print(r.state_at())
        if not result.identical:
            print(result.summary())
            return 1
        return 0
    keys = [role] if role is not None else list(recs)
    ok = True
    for key in keys:
        result = replay(recs[key])
        ok = ok and result.identical
        line = result.summary()
        print(line if len(keys) == 1 else f"{key}: {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
