"""Before/after the fast-rank bridge (issue 19 item 5): `bench train` on two code trees,
interleaved, each call beside its own DDP run.

    PYTHONPATH=. python scripts/idle_compare.py --before /tmp/idle-before --after . \\
        --job flodl_bus.examples.charrnn:job --modes nccl-cadence,nccl-sync --repeats 3 \\
        [--slow-rank 1 --slow-factor 2] --out /tmp/idle-compare

``--before`` and ``--after`` are checkouts of the package (e.g. ``git archive BASE | tar
-x -C /tmp/idle-before``). Repeat i runs ``flodl-bus bench train --repeats 1 --ddp
--no-plain`` once with each tree on ``PYTHONPATH`` (the order alternates per repeat),
so both trees and DDP share the machine's state. For each tree and bus mode it prints
the medians of: time to target, its ratio to the DDP run of the same call, time to the
fixed epochs, and per rank (``bench.idle``, from the coordinator's record) the share of
the run spent waiting across a SyncNow and the median wait per averaging in that rank's
steps. The 1-minute load average before each call is printed: on a shared machine only
ratios from the same call mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from flodl_bus.bench.idle import idle_of_run


def _call(tree: Path, args: argparse.Namespace, run_dir: Path) -> dict[str, Any] | None:
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    out = run_dir / "bench.json"
    cmd = [
        sys.executable, "-m", "flodl_bus.cli", "bench", "train", "--job", args.job,
        "--workers", "2", "--modes", args.modes, "--ddp", "--no-plain", "--repeats", "1",
        "--run-dir", str(run_dir), "--json", str(out),
    ]  # fmt: skip
    if args.slow_rank is not None:
        cmd += ["--slow-rank", str(args.slow_rank), "--slow-factor", str(args.slow_factor)]
    if args.epochs:
        cmd += ["--epochs", str(args.epochs)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        # A failed call is reported and left out of the medians (it is no timing).
        tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
        print(f"bench train failed in {run_dir}:\n    " + "\n    ".join(tail), flush=True)
        return None
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--job", default="flodl_bus.examples.charrnn:job")
    p.add_argument("--modes", default="nccl-cadence")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=0)
    p.add_argument("--slow-rank", type=int)
    p.add_argument("--slow-factor", type=float, default=2.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    trees = {"before": args.before, "after": args.after}
    # rows[(tree, mode)] = list of per-call figures
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    print(f"{args.job}, modes {args.modes}, slow rank {args.slow_rank} x{args.slow_factor}, "
          f"{os.cpu_count()} cores")  # fmt: skip
    for rep in range(args.repeats):
        order = list(trees) if rep % 2 == 0 else list(reversed(trees))
        for name in order:
            load = os.getloadavg()[0]
            run_dir = args.out / f"{name}-{rep}"
            res = _call(trees[name], args, run_dir)
            if res is None:
                continue
            ddp = res["runs"]["ddp"][0]
            ddp_tt = ddp["to_target"][0] if ddp["to_target"] else None
            line = [f"rep {rep} {name:<6} load {load:4.1f}  ddp to target {_f(ddp_tt)} s"]
            for mode in modes:
                r = res["runs"][f"bus {mode}"][0]
                tt = r["to_target"][0] if r["to_target"] else None
                idle = idle_of_run(run_dir / f"{mode}-0", 2)
                fig: dict[str, Any] = {
                    "to_target": tt,
                    "wall": r["wall"],
                    "vs_ddp": tt / ddp_tt if tt is not None and ddp_tt else None,
                    "ddp_wall": ddp["wall"],
                    "load": load,
                }
                if idle is not None:
                    fig["at_sync_share"] = [s / r["wall"] for s in idle.at_sync_s]
                    fig["median_steps"] = [
                        m / st if st > 0 else 0.0
                        for m, st in zip(idle.median_sync_s, idle.step_s, strict=True)
                    ]
                    fig["syncs"] = idle.syncs
                rows.setdefault((name, mode), []).append(fig)
                line.append(f"{mode} {_f(tt)} s ({_f(fig['vs_ddp'], '.3f')}x ddp)")
            print("  ".join(line), flush=True)
    print(f"\nmedians of {args.repeats} call(s)")
    print(f"{'tree':<7}{'mode':<14}{'to target s':>12}{'vs ddp':>8}{'train s':>9}"
          f"{'ddp train s':>12}  wait at SyncNow (share of run / median in steps)")  # fmt: skip
    summary: dict[str, Any] = {}
    for (name, mode), figs in rows.items():
        med = {
            k: _median([f[k] for f in figs if f.get(k) is not None])
            for k in ("to_target", "vs_ddp", "wall", "ddp_wall")
        }
        ranks = []
        for r in range(2):
            share = _median([f["at_sync_share"][r] for f in figs if "at_sync_share" in f])
            steps = _median([f["median_steps"][r] for f in figs if "median_steps" in f])
            ranks.append(f"r{r} {_f(share, '.0%')} / {_f(steps, '.1f')}")
        print(f"{name:<7}{mode:<14}{_f(med['to_target']):>12}{_f(med['vs_ddp'], '.3f'):>7}x"
              f"{_f(med['wall']):>9}{_f(med['ddp_wall']):>12}  " + ", ".join(ranks))  # fmt: skip
        summary[f"{name} {mode}"] = {"medians": med, "calls": figs}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
