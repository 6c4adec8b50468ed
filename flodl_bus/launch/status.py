"""``flodl-bus status --run RUN``: where a live run is, read from Redis alone.

    flodl-bus status --run RUN [--redis-url URL] [--json]

Everything comes from what the run keeps in Redis, readable by the read-only observer:
the ``meta`` hash (mode, world, status, and the coordinator's state, which it refreshes
about once a second: each rank's epoch, the anchor, whether the averaging gate is open
and why not), each rank's ``up:<r>`` stream (its step rate over the last seconds, from
the entry ids of its ``Batch`` entries) and the dead-letter stream's length. Whether a
rank is alive comes from the coordinator, which verifies every entry: the seconds since
it last heard from each rank (``heard_s``) and the ranks it declared dead or saw leave.
An observer cannot check a MAC, so a ``Heartbeat`` in ``up:<r>`` is used only when the
coordinator published no such view (a coordinator older than it), and then marked as
unverified. Nothing is taken from a consumer group and nothing is written.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import redis

from flodl_bus.bus.connection import (
    REFUSALS,
    add_url_argument,
    describe_refusal,
)
from flodl_bus.bus.entries import F_TYPE
from flodl_bus.bus.ids import parse_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.tail import RunUnavailable, open_run
from flodl_bus.launch.dashboard_state import json_list
from flodl_bus.options import OneLineParser

#: the newest entries of ``up:<r>`` looked at (a rank writes a Batch per step and a
#: Heartbeat a second: enough for the rate and, at up to ~1000 steps/s, the heartbeat)
SCAN_ENTRIES = 1000
#: the step rate is over the newest Batch entries within this window
RATE_WINDOW_MS = 10_000

#: the statuses of a run still training or forming (its gate and rates mean something)
LIVE_STATUSES = ("running", "joining", "unknown")

#: a coordinator behind its input this long is said so (a read or two behind is the
#: ordinary ebb of a large world)
BEHIND_SHOWN_S = 1.0

#: the meta fields the coordinator refreshes while it runs (coordinator/cli.py)
STATE_FIELDS = (
    "state_at",
    "rank_epoch",
    "anchor",
    "gate_open",
    "gate_why",
    "syncs",
    "phase",
    "counts",
    "heard_s",
    "behind_s",
    "dead",
    "exited",
    "resources",
)


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def rank_status(client: redis.Redis, stream: str, now_ms: int) -> dict[str, Any]:
    """A rank's step rate (steps/s over its newest Batch entries), when it last stepped
    and when it last sent a Heartbeat (seconds ago; None: not among the newest)."""
    entries: Any = client.xrevrange(stream, "+", "-", count=SCAN_ENTRIES)
    batches: list[int] = []
    heartbeat_ms: int | None = None
    for raw_id, fields in entries:
        kind = fields.get(F_TYPE)
        ms = parse_id(raw_id)[0]
        if kind == b"Batch" and (not batches or batches[0] - ms <= RATE_WINDOW_MS):
            batches.append(ms)
        elif kind == b"Heartbeat" and heartbeat_ms is None:
            heartbeat_ms = ms
    rate = None
    if len(batches) >= 2 and batches[0] > batches[-1]:
        rate = (len(batches) - 1) / ((batches[0] - batches[-1]) / 1000)
    return {
        "steps_per_s": rate,
        "last_step_s": None if not batches else max(0.0, (now_ms - batches[0]) / 1000),
        "heartbeat_s": None if heartbeat_ms is None else max(0.0, (now_ms - heartbeat_ms) / 1000),
    }


def read_status(client: redis.Redis, run: str, now_ms: int | None = None) -> dict[str, Any]:
    """The run's status as a plain dict (what ``--json`` prints)."""
    keys = RunKeys(run)
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    raw: Any = client.hgetall(keys.meta)
    meta = {_text(k): _text(v) for k, v in raw.items() if _text(k) != "secret"}
    try:
        world = int(meta.get("world_size") or 0)
    except ValueError:
        world = 0
    if world == 0:  # still joining: count the ranks whose streams exist
        world = sum(1 for _ in client.scan_iter(match=keys.up_pattern, count=1000))
    rank_epoch: list[Any] = json_list(meta.get("rank_epoch"))
    status = meta.get("status", "unknown")
    live = status in LIVE_STATUSES
    state_at = _float(meta.get("state_at"))
    state_age = None if state_at is None else max(0.0, now_ms / 1000 - state_at)
    heard = json_list(meta.get("heard_s")) if state_age is not None else []
    dead, exited = set(json_list(meta.get("dead"))), set(json_list(meta.get("exited")))
    resources = json_list(meta.get("resources"))
    ranks = []
    for r in range(world):
        info = rank_status(client, keys.up(r), now_ms)
        info["rank"] = r
        info["epoch"] = rank_epoch[r] if r < len(rank_epoch) else None
        age = heard[r] if r < len(heard) else None
        if isinstance(age, int | float) and state_age is not None:
            info["heartbeat_s"] = float(age) + state_age
            info["verified"] = True
        else:
            info["verified"] = False  # the stream's newest Heartbeat: anyone could add it
        info["state"] = "dead" if r in dead else "left" if r in exited else "alive"
        # The rank's newest sample, sent with its last plan's metrics (None: none yet).
        res = resources[r] if r < len(resources) else None
        info["resources"] = res if isinstance(res, dict) else None
        if not live:
            # A finished run: no step rate, no liveness (the last entries are history).
            info["steps_per_s"] = None
            info["state"] = info["state"] if info["state"] != "alive" else "done"
        ranks.append(info)
    gate_open = meta.get("gate_open")
    epochs = int(meta["epochs"]) if meta.get("epochs", "").isdigit() else None
    epoch = min((e for e in rank_epoch if e is not None), default=None)
    if status == "finished" and epochs is not None:
        epoch = epochs  # every epoch trained (the ranks' last index is epochs - 1)
    return {
        "run": run,
        "status": status,
        "mode": meta.get("mode"),
        "job": meta.get("job"),
        "world_size": world,
        "epochs": epochs,
        "epoch": epoch,
        "anchor": int(meta["anchor"]) if meta.get("anchor", "").isdigit() else None,
        "gate": None
        if gate_open is None or not live
        else {"open": gate_open == "1", "why": meta.get("gate_why")},
        "syncs": int(meta["syncs"]) if meta.get("syncs", "").isdigit() else None,
        "state_age_s": state_age,
        # the coordinator behind its input: a rank's "heard" then grows with the backlog
        "behind_s": _float(meta.get("behind_s")) if live else None,
        "dead_letters": int(client.xlen(keys.dlq)),
        "ranks": ranks,
    }


def _float(raw: str | None) -> float | None:
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def _num(v: float | None, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def render(st: dict[str, Any]) -> str:
    """The status as a few aligned lines."""
    epoch = "-" if st["epoch"] is None else str(st["epoch"])
    if st["epochs"] is not None:
        epoch += f"/{st['epochs']}"
    head = (
        f"run {st['run']}  {st['status']}  {st['mode'] or '-'}  world {st['world_size']}  "
        f"epoch {epoch}"
    )
    if st["state_age_s"] is not None:
        head += f"  (coordinator state {st['state_age_s']:.1f}s old)"
    gate = st["gate"]
    if gate is None:
        gate_text = "-"
    elif gate["open"]:
        gate_text = "open"
    else:
        gate_text = f"shut: {gate['why']}"
    lines = [
        head,
        f"anchor {_num(st['anchor'], 'd')}  averaging rounds {_num(st['syncs'], 'd')}  "
        f"gate {gate_text}  dead letters {st['dead_letters']}",
    ]
    behind = st.get("behind_s")
    if behind is not None and behind >= BEHIND_SHOWN_S:
        lines.append(
            f"coordinator behind its input for {behind:.1f}s: ranks' entries wait unread, "
            "their 'heard' grows and no death is declared until it catches up (fewer ranks "
            "per coordinator, --ingest-procs, longer steps)"
        )
    lines += [
        f"{'rank':>4} {'epoch':>5} {'steps/s':>9} {'last step':>10} {'heard':>10} "
        f"{'rss MiB':>8} {'gpu':>20}  state",
    ]
    for r in st["ranks"]:
        heard = _num(r["heartbeat_s"], ".1f") + ("s" if r.get("verified") else "s?")
        res = r.get("resources") or {}
        lines.append(
            f"{r['rank']:>4} {_num(r['epoch'], 'd'):>5} {_num(r['steps_per_s'], '.1f'):>9} "
            f"{_num(r['last_step_s'], '.1f') + 's':>10} {heard:>10} "
            f"{_mib(res.get('rss_bytes')):>8} {_gpu(res):>20}  {r.get('state', '-')}"
        )
    return "\n".join(lines)


def _mib(n: Any) -> str:
    return f"{n / 2**20:.0f}" if isinstance(n, int | float) else "-"


def _gpu(res: dict[str, Any]) -> str:
    """``cuda:0 62% 1843/4096M``: utilisation, then allocated of the peak reserved (MiB);
    ``-`` for a rank on the CPU."""
    if res.get("device_index") is None:
        return "-"
    util = res.get("gpu_util_percent")
    text = f"cuda:{res['device_index']}"
    if isinstance(util, int | float):
        text += f" {util:.0f}%"
    held, peak = res.get("vram_allocated_bytes"), res.get("vram_reserved_peak_bytes")
    return f"{text} {_mib(held)}/{_mib(peak)}M"


def main(argv: Sequence[str] | None = None) -> int:
    ap = OneLineParser(
        prog="flodl-bus status",
        description="Where a live run is: world, epoch, each rank's step rate and last "
        "heartbeat, the anchor, the averaging gate and why it is shut, dead letters.",
        epilog="Read-only: the observer user is enough. Credentials: in the URL, or "
        "FLODL_REDIS_USERNAME / FLODL_REDIS_PASSWORD.",
    )
    required = ap.add_argument_group("required")
    required.add_argument("--run", required=True, help="run id")
    add_url_argument(ap)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        client, _keys = open_run(args.run, args.redis_url, "flodl-status")
    except RunUnavailable as exc:
        print(f"flodl-bus status: {exc}", file=sys.stderr)
        return 2
    try:
        st = read_status(client, args.run)
    except REFUSALS as exc:
        print(f"flodl-bus status: {describe_refusal(exc, args.redis_url)}", file=sys.stderr)
        return 2
    finally:
        client.close()
    print(json.dumps(st) if args.json else render(st))
    return 0
