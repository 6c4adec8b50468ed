"""``flodl-bus replay RUN_DIR [--role coordinator|rank:R] [--until T]`` (see
``replay.engine`` for what a replay does)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from flodl_bus.record.log import DamagedRecord
from flodl_bus.replay import CoordinatorReplay, load_run, replay


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
