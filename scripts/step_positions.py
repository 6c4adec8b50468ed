"""Where a rank's stalled steps sit in their plan (BENCHMARKS.md, 2026-12-07, eighth session).

For each rank record given, every step after the first 200 is placed at its position in
its plan (0 = a plan's first step; positions past 40 pooled), and a step over 1.5x the
record's median counts as a stall: per position (single positions up to 4, then groups of
five), the stalls and the seconds they took beyond the median. A stall that sits at one
position in every epoch has a cause at that moment of the epoch (a write, a read, an
eval); one spread evenly does not. Run from the repository root:

    python3 scripts/step_positions.py runs/RUN/rank0.jsonl.zst [...]
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())

from flodl_bus.record.log import read_records

SKIP = 200
STALL = 1.5


def main(paths: list[str]) -> None:
    for path in paths:
        position, steps = 0, []
        for rec in read_records(Path(path)):
            event = rec.get("event")
            if event == "plan":
                position = 0
            elif event == "step":
                args = rec["args"]
                steps.append((position, (args[1] + args[2]) / 1e3))
                position += 1
        if not steps:
            print(f"{path}: no steps")
            continue
        median = statistics.median(s for _, s in steps)
        tail: collections.Counter[int] = collections.Counter()
        stalls: collections.Counter[int] = collections.Counter()
        for p, s in steps[SKIP:]:
            group = min(p if p < 5 else p // 5 * 5, 40)
            if s > STALL * median:
                tail[group] += s - median
                stalls[group] += 1
        cells = " ".join(f"{g}:{stalls[g]}/{tail[g]:.2f}s" for g in sorted(tail))
        print(f"{path}: median {median * 1e3:.3f} ms, tail {sum(tail.values()):.2f} s; {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])
