"""``flodl-bus events RUN_DIR [--kind K ...] [--json]``: flodl's timeline of a run.

Derived from the coordinator's record (``record.telemetry.derive``), so it works on any
recorded run, finished or cut short, and prints what ``events.jsonl`` received live. One
line an event: seconds since the run's first core call, the record line it came from,
its kind and fields; ``--json`` prints each event's map instead (one JSON object a line).

Exit status: 0 printed (maybe nothing: a run that never closed a window has no events),
2 bad input (not a run directory, no coordinator record), 4 a damaged record (the first
line that breaks its digest chain is named).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from flodl_bus.record.chain import DamagedRecord
from flodl_bus.record.log import read_records
from flodl_bus.record.telemetry import KINDS, derive
from flodl_bus.replay.load import load_run

PROG = "flodl-bus events"
OK = 0
BAD_INPUT = 2
DAMAGED = 4

#: fields every event has; the line prints them in its own columns
_COMMON = ("kind", "i", "now", "elapsed_ms")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Print flodl's timeline events (syncs, divergence, anchor changes, "
        "throttles, lost broadcasts) derived from a run's coordinator record. "
        "Exit 0 printed, 2 bad input, 4 damaged record.",
    )
    p.add_argument("run_dir", help="runs/<run-id>")
    p.add_argument(
        "--kind",
        action="append",
        choices=KINDS,
        metavar="K",
        help=f"only this kind (repeatable): {', '.join(KINDS)}",
    )
    p.add_argument("--json", action="store_true", help="one JSON object a line")
    return p


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ",".join(f"{k}:{_value(x)}" for k, x in v.items()) + "}"
    return "-" if v is None else str(v)


def line(ev: Mapping[str, Any]) -> str:
    """One event as a timeline row: ``+12.345s  i=873  SyncEnd  duration_ms=8.6``."""
    where = "-" if ev.get("i") is None else str(ev["i"])
    fields = " ".join(f"{k}={_value(v)}" for k, v in ev.items() if k not in _COMMON)
    at = f"+{ev['elapsed_ms'] / 1e3:.3f}s"
    return f"{at:>12}  i={where:<7} {ev['kind']:<15} {fields}".rstrip()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"{PROG}: {run_dir} is not a run directory", file=sys.stderr)
        return BAD_INPUT
    try:
        rec = load_run(run_dir).get("coordinator")
        if rec is None or rec.path is None:
            print(f"{PROG}: no coordinator record in {run_dir}", file=sys.stderr)
            return BAD_INPUT
        events = list(derive(read_records(rec.path)))
    except DamagedRecord as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return DAMAGED
    kinds = set(args.kind or KINDS)
    out = sys.stdout
    for ev in events:
        if ev["kind"] not in kinds:
            continue
        out.write(orjson.dumps(ev).decode() if args.json else line(ev))
        out.write("\n")
    return OK
