"""Message surgery: turn a recorded run into the input of a failure that never happened.

Each function takes a run (``{key: Recording}`` from ``replay.load_run``) and returns a
changed deep copy; the original is untouched. Replay the result with ``explore=True``:
the fresh cores then take the path the change leads to, and ``ReplayResult.actual`` is
the record of that path (a plain replay reports the first place it leaves the original).

- ``drop_upstream``: rank r falls silent after t (heartbeats and everything else); the
  coordinator's timeline is extended by synthetic ticks past the heartbeat timeout, so
  staleness fires (rank_lost, forfeit / ExtendPartition, DeclareDead + re-session on nccl).
- ``duplicate_start_epoch``: the coordinator "sends" one of rank r's StartEpochs twice.
- ``delay_sync_ack``: one SyncAck of rank r reaches the coordinator ``by`` seconds late.
- ``corrupt_entry``: one entry's mac/body/type is damaged; the transport dead-letters it.

Entry ids: a stream's ids must stay strictly increasing and, on a rank's control streams,
must keep the coordinator's send order across ``ctl:r`` and ``ctl:all``. Inserting an
entry therefore renumbers the record's ids as ``(ms, 2*seq)``, leaving ``(ms, 2*seq+1)``
free right after each one; moving an entry permutes the stream's messages over its
existing ids.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from flodl_bus.bus.ids import format_id, parse_id
from flodl_bus.replay.load import Recording

Run = Mapping[str, Recording]


def _copy(run: Run) -> dict[str, Recording]:
    return {k: copy.deepcopy(v) for k, v in run.items()}


def _t0(rec: Recording) -> float:
    t0 = rec.header.get("t0")
    if isinstance(t0, (int, float)):
        return float(t0)
    return float(next((e["now"] for e in rec.events if "now" in e), 0.0))


def _entry_refs(rec: Recording) -> Iterator[dict[str, Any]]:
    """Every dict in the record that names an entry by stream and id."""
    for ev in rec.events:
        if ev.get("event") == "read":
            yield from ev.get("entries", ())
        elif ev.get("stream") and ev.get("id"):
            yield ev


def _sender(ev: Mapping[str, Any]) -> int | None:
    s = ev.get("sender")
    if s is not None:
        return int(s)
    stream = ev.get("stream")
    return int(stream.rsplit(":", 1)[1]) if stream else None


def _coordinator(run: Mapping[str, Recording]) -> Recording:
    if "coordinator" not in run:
        raise KeyError("this surgery needs the coordinator's record")
    return run["coordinator"]


# ----------------------------------------------------------------------- drop


def drop_upstream(
    run: Run,
    rank: int,
    after: float,
    *,
    tick_every: float = 0.25,
    heartbeat_every: float = 1.0,
    margin: float = 2.0,
) -> dict[str, Recording]:
    """Rank ``rank`` says nothing more after ``after`` seconds (run time).

    Its later upstream entries are removed from the coordinator's input, and the run
    stalls right there for ``heartbeat_timeout + margin`` seconds: synthetic ticks every
    ``tick_every`` and synthetic heartbeats of every other rank every ``heartbeat_every``
    fill the gap (the survivors are alive, only waiting), then the rest of the record
    follows, shifted by the gap. The staleness sweep therefore finds exactly ``rank``
    silent while the others still have work to be given.
    """
    out = _copy(run)
    rec = _coordinator(out)
    t0 = _t0(rec)
    cut = t0 + after
    timeout = float(rec.header.get("config", {}).get("heartbeat_timeout", 30.0))
    gap = timeout + margin
    before = [e for e in rec.events if float(e.get("now", t0)) <= cut]
    later = [
        e
        for e in rec.events[len(before) :]
        if not (e.get("event") == "dispatch" and _sender(e) == rank)
    ]
    # Ids: room after every entry for the synthetic heartbeats.
    per_stream_last: dict[str, tuple[int, int]] = {}
    room = 1 + int(gap / heartbeat_every) + 1
    for e in rec.events:
        if e.get("stream") and e.get("id"):
            ms, seq = parse_id(e["id"])
            e["id"] = format_id((ms, seq * room))
    for e in before:
        if e.get("stream"):
            per_stream_last[e["stream"]] = parse_id(e["id"])
    streams = {_sender(e): e["stream"] for e in rec.events if e.get("event") == "dispatch"}
    filler: list[dict[str, Any]] = []
    for k in range(1, int(gap / tick_every) + 1):
        filler.append({"event": "tick", "now": cut + k * tick_every, "synthetic": True})
    for s in sorted(r for r in streams if r is not None and r != rank):
        stream = streams[s]
        base = per_stream_last.get(stream)
        if base is None:
            continue
        for k in range(1, int(gap / heartbeat_every) + 1):
            filler.append(
                {
                    "event": "dispatch",
                    "stream": stream,
                    "id": format_id((base[0], base[1] + k)),
                    "sender": s,
                    "msg": {"v": 1, "type": "Heartbeat", "rank": s, "step_count": 10**6 + k},
                    "now": cut + k * heartbeat_every - 1e-6,
                    "synthetic": True,
                }
            )
    filler.sort(key=lambda e: e["now"])
    for e in later:
        if "now" in e:
            e["now"] = float(e["now"]) + gap
    rec.events = before + filler + later
    return out


# ------------------------------------------------------------------ duplicate


def _double_ids(rec: Recording) -> None:
    for ref in _entry_refs(rec):
        ms, seq = parse_id(ref["id"])
        ref["id"] = format_id((ms, 2 * seq))


def duplicate_start_epoch(
    run: Run, rank: int, nth: int = 0, *, copies: int = 1
) -> dict[str, Recording]:
    """Rank ``rank`` receives its ``nth`` StartEpoch ``1 + copies`` times in a row.

    One copy of a plan the rank dispatched while training overwrites its one-plan
    mailbox; a plan it took while idle needs two (the first copy fills the mailbox)."""
    if not copies >= 1:
        raise ValueError("copies must be at least 1")
    out = _copy(run)
    key = f"rank:{rank}"
    rec = out[key]
    starts = [
        ev
        for ev in rec.events
        if ev.get("event") in ("dispatch", "take")
        and ev.get("stream")
        and (ev.get("msg") or {}).get("type") == "StartEpoch"
    ]
    if len(starts) <= nth:
        raise ValueError(f"{key} received {len(starts)} StartEpoch(s); no index {nth}")
    _double_ids(rec)
    orig = starts[nth]
    ms, seq = parse_id(orig["id"])
    if copies > 1:
        # Room for more than one id after each entry.
        for ref in _entry_refs(rec):
            m, q = parse_id(ref["id"])
            ref["id"] = format_id((m, q * copies))
        ms, seq = parse_id(orig["id"])
    dups = [
        {"stream": orig["stream"], "id": format_id((ms, seq + k)), "msg": orig["msg"]}
        for k in range(1, copies + 1)
    ]
    # The copies are part of the same read as the original.
    for ev in rec.events:
        if ev.get("event") != "read":
            continue
        pos = next(
            (
                k
                for k, e in enumerate(ev["entries"])
                if e["stream"] == orig["stream"] and e["id"] == orig["id"]
            ),
            None,
        )
        if pos is not None:
            ev["entries"][pos + 1 : pos + 1] = dups
            break
    else:
        rec.events.insert(0, {"event": "read", "i": -1, "now": 0.0, "entries": dups})
    return out


# ---------------------------------------------------------------------- delay


def delay_sync_ack(run: Run, rank: int, by: float, nth: int = 0) -> dict[str, Recording]:
    """The ``nth`` SyncAck of ``rank`` reaches the coordinator ``by`` seconds later."""
    out = _copy(run)
    rec = _coordinator(out)
    acks = [
        k
        for k, ev in enumerate(rec.events)
        if ev.get("event") == "dispatch"
        and _sender(ev) == rank
        and (ev.get("msg") or {}).get("type") == "SyncAck"
    ]
    if len(acks) <= nth:
        raise ValueError(f"rank {rank} sent {len(acks)} SyncAck(s); no index {nth}")
    ev = rec.events.pop(acks[nth])
    stream = ev["stream"]
    ids = sorted(
        (e["id"] for e in [*rec.events, ev] if e.get("stream") == stream),
        key=parse_id,
    )
    when = float(ev["now"]) + by
    pos = next(
        (k for k, e in enumerate(rec.events) if "now" in e and float(e["now"]) > when),
        len(rec.events),
    )
    ev["now"] = when
    rec.events.insert(pos, ev)
    # Same stream, new order: hand the stream's ids out again in delivery order.
    own = [e for e in rec.events if e.get("stream") == stream]
    for e, eid in zip(own, ids, strict=True):
        e["id"] = eid
    return out


# -------------------------------------------------------------------- corrupt


def corrupt_entry(
    run: Run, key: str, stream: str, entry_id: str, how: str = "mac"
) -> dict[str, Recording]:
    """Damage one entry of ``key``'s input: ``mac`` (fails authentication), ``body``
    (not msgpack) or any other text (written as the entry's ``type`` field)."""
    out = _copy(run)
    hit = False
    for ref in _entry_refs(out[key]):
        if ref["stream"] == stream and ref["id"] == entry_id:
            ref["corrupt"] = how
            hit = True
    if not hit:
        raise KeyError(f"{key} read no entry {entry_id} on {stream}")
    return out


def find_entry(
    run: Run, key: str, type_: str, *, sender: int | None = None, nth: int = 0
) -> tuple[str, str]:
    """(stream, id) of the ``nth`` dispatched entry of wire type ``type_``."""
    found = [
        (ev["stream"], ev["id"])
        for ev in run[key].events
        if ev.get("event") == "dispatch"
        and ev.get("stream")
        and (ev.get("msg") or {}).get("type") == type_
        and (sender is None or _sender(ev) == sender)
    ]
    if len(found) <= nth:
        raise ValueError(f"{key} dispatched {len(found)} {type_}; no index {nth}")
    return found[nth]
