"""``flodl-bus replay RUN_DIR [--role coordinator|rank:R] [--until T] [--allow-incomplete]``.

Verify, then compare: every record of the run is checked first (its digest chain line by
line, its end record, its header against the file and the other records); only a record
that verifies is replayed (``replay.engine`` says what a replay does).

Exit status (stdout is the report, one line per process; stderr names what was refused):

===  ===================================================================================
0    identical: every replayed process did what its record says
1    a divergence: the first one, with the changed keys, recorded vs replayed
2    bad input: not a run directory, no record in it, an unknown ``--role``, a bad ``T``
4    a damaged record: a line edited, removed, moved or not JSON, a header that disagrees
     with its file or the other records, or a record without a digest chain; the
     message names the file and line
5    an incomplete record: no end record (its process was killed, crashed or hung), or
     an incomplete run: a record its other records name is missing;
     ``--allow-incomplete`` replays what is there, up to its last verified line
===  ===================================================================================
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from flodl_bus.record.chain import DamagedRecord, IncompleteRecord, UnchainedRecord
from flodl_bus.replay import CoordinatorReplay, RankReplay, Recording, load_run, replay
from flodl_bus.replay.coordinator import launch_time
from flodl_bus.replay.engine import TRANSPORTS
from flodl_bus.replay.load import MissingRecords, verify_run

PROG = "flodl-bus replay"
IDENTICAL = 0
DIVERGED = 1
BAD_INPUT = 2
DAMAGED = 4
INCOMPLETE = 5


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Verify a recorded run, then replay it against fresh cores over "
        "fakeredis. Exit 0 identical, 1 diverged, 2 bad input, 4 damaged record, "
        "5 incomplete record.",
    )
    p.add_argument("run_dir", help="runs/<run-id>")
    p.add_argument("--role", help="coordinator or rank:R (default: every recorded process)")
    p.add_argument(
        "--until",
        metavar="T",
        help="stop at T and print the state there: seconds since the coordinator's launch "
        "(e.g. 57.5) or an ISO wall-clock time (2026-12-01T03:40:00+00:00; without an "
        "offset, local time); with --role rank:R, that rank's state",
    )
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="direct",
        help="direct (default): entries go through the bus's entry checks and decoding "
        "(fields, seq, MAC, message), in id order, several times faster; fakeredis: "
        "through the process's own bus class over fakeredis streams (consumer groups, "
        "cursors) as well",
    )
    p.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="replay a record without its end (a killed or hung process) up to its last "
        "verified line",
    )
    return p


def _err(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr)


def _launched_wall(header: Mapping[str, Any]) -> float | None:
    for name in ("launched_wall", "started_wall"):
        v = header.get(name)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _until(text: str, recs: Mapping[str, Recording], role: str) -> tuple[float, str] | str:
    """(limit on ``role``'s clock as its replay counts it, label) or an error line."""
    seconds: float | None
    wall: float | None = None
    try:
        seconds = float(text)
    except ValueError:
        seconds = None
        try:
            wall = datetime.fromisoformat(text).timestamp()
        except ValueError:
            return (
                f"--until {text!r}: give seconds since the coordinator's launch (57.5) or an "
                "ISO time (2026-12-01T03:40:00+00:00)"
            )
    coord = recs.get("coordinator")
    coord_wall = _launched_wall(coord.header) if coord is not None else None
    if role == "coordinator":
        if seconds is not None:
            return seconds, f"t={seconds:.3f}s"
        if coord_wall is None:
            return "--until TIME needs the coordinator record's launch time (launched_wall)"
        assert wall is not None
        rel = wall - coord_wall
        return rel, f"{text} (t={rel:.3f}s)"
    rank_wall = _launched_wall(recs[role].header)
    if seconds is not None:
        if coord_wall is None or rank_wall is None:
            # No common clock: T counts from the rank's own launch.
            return seconds, f"t={seconds:.3f}s of the rank's clock"
        wall = coord_wall + seconds
        label = f"t={seconds:.3f}s"
    else:
        label = text
    if rank_wall is None:
        return f"--until for {role} needs its record's launch time (launched_wall)"
    assert wall is not None
    return wall - rank_wall, label


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from flodl_bus.record.log import configure_console

    # Transport log lines (a dead-lettered entry) go to stderr: stdout is the report,
    # and it must read the same on every replay.
    configure_console("warning")
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        _err(f"{run_dir} is not a run directory")
        return BAD_INPUT
    try:
        recs = load_run(run_dir)
    except DamagedRecord as exc:
        _err(str(exc))
        return DAMAGED
    if not recs:
        _err(f"no coordinator or rank<r> record in {run_dir}")
        return BAD_INPUT
    role = args.role
    if role is not None and role not in recs:
        _err(f"no record for {role!r} in {run_dir} (have: {', '.join(recs)})")
        return BAD_INPUT
    keys = [role] if role is not None else list(recs)
    try:
        verified = verify_run(
            {k: recs[k] for k in keys},
            allow_incomplete=args.allow_incomplete,
            whole=role is None,
        )
        if role is not None:
            # the headers against each other
            verify_run(recs, allow_incomplete=True, whole=False)
    except IncompleteRecord as exc:
        _err(str(exc))
        return INCOMPLETE
    except MissingRecords as exc:
        _err(f"{exc}; --allow-incomplete replays the records that are there")
        return INCOMPLETE
    except (DamagedRecord, UnchainedRecord) as exc:
        _err(str(exc))
        return DAMAGED
    incomplete = {k: v for k, v in verified.items() if not v.complete}
    for k, v in incomplete.items():
        _err(f"{k}: incomplete record: replaying its {v.lines} verified lines")
    try:
        if args.until is not None:
            return _until_main(args.until, recs, role or "coordinator", args.transport)
        ok = True
        for key in keys:
            result = replay(recs[key], keep_actual=False, transport=args.transport)
            ok = ok and result.identical
            line = result.summary()
            if key in incomplete and result.identical:
                line += f", up to line {incomplete[key].lines} (incomplete record)"
            print(line if len(keys) == 1 else f"{key}: {line}")
    except DamagedRecord as exc:
        _err(str(exc))
        return DAMAGED
    return IDENTICAL if ok else DIVERGED


def _until_main(text: str, recs: Mapping[str, Recording], role: str, transport: str) -> int:
    if role not in recs:
        _err("--until needs the coordinator's record (or --role rank:R)")
        return BAD_INPUT
    got = _until(text, recs, role)
    if isinstance(got, str):
        _err(got)
        return BAD_INPUT
    limit, label = got
    r: CoordinatorReplay | RankReplay
    if role == "coordinator":
        r = CoordinatorReplay(recs[role], until=limit, keep_actual=False, transport=transport)
        result = r.run()
        print(r.state_at(label))
    else:
        r = RankReplay(recs[role], until=limit, keep_actual=False, transport=transport)
        result = r.run()
        print(r.state_at(label))
    if not result.identical:
        print(result.summary())
        return DIVERGED
    return IDENTICAL


__all__ = ["BAD_INPUT", "DAMAGED", "DIVERGED", "IDENTICAL", "INCOMPLETE", "launch_time", "main"]


if __name__ == "__main__":
    raise SystemExit(main())
