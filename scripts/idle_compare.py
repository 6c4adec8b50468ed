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


def _figures(run_dir: Path, modes: list[str]) -> dict[str, dict[str, Any]]:
    """One call's figures per bus mode, read back from its run directory."""
    res = json.loads((run_dir / "bench.json").read_text())
    ddp = res["runs"]["ddp"][0]
    ddp_tt = ddp["to_target"][0] if ddp["to_target"] else None
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        r = res["runs"][f"bus {mode}"][0]
        tt = r["to_target"][0] if r["to_target"] else None
        fig: dict[str, Any] = {
            "to_target": tt,
            "ddp_to_target": ddp_tt,
            "vs_ddp": tt / ddp_tt if tt is not None and ddp_tt else None,
            "wall": r["wall"],
            "ddp_wall": ddp["wall"],
        }
        idle = idle_of_run(run_dir / f"{mode}-0", 2)
        if idle is not None:
            fig["syncs"] = idle.syncs
            fig["at_sync_share"] = [a / r["wall"] for a in idle.at_sync_s]
            fig["peer_share"] = [a / r["wall"] for a in idle.peer_s]
            fig["peer_end_share"] = [a / r["wall"] for a in idle.peer_epoch_end_s]
            fig["peer_steps"] = [
                m / st if st > 0 else 0.0
                for m, st in zip(idle.median_peer_s, idle.step_s, strict=True)
            ]
        out[mode] = fig
    return out


def summarize(out_dir: Path, modes: list[str]) -> dict[str, Any]:
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run_dir in sorted(out_dir.glob("*-*")):
        if not (run_dir / "bench.json").exists():
            continue
        tree = run_dir.name.rsplit("-", 1)[0]
        for mode, fig in _figures(run_dir, modes).items():
            rows.setdefault((tree, mode), []).append(fig)
    print(f"\nmedians over the calls that finished ({out_dir})")
    print(f"{'tree':<7}{'mode':<14}{'calls':>6}{'to target s':>12}{'vs ddp':>8}{'train s':>9}"
          f"{'ddp train s':>12}  per rank: waiting at SyncNow / for a peer (at epoch ends)"
          " as shares of the run / median wait for a peer in steps")  # fmt: skip
    summary: dict[str, Any] = {}
    for (tree, mode), figs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        med = {
            k: _median([f[k] for f in figs if f.get(k) is not None])
            for k in ("to_target", "vs_ddp", "wall", "ddp_wall")
        }
        ranks = []
        for r in range(2):
            at, peer, end, steps = (
                _median([f[key][r] for f in figs if key in f])
                for key in ("at_sync_share", "peer_share", "peer_end_share", "peer_steps")
            )
            ranks.append(
                f"r{r} {_f(at, '.0%')} / {_f(peer, '.0%')} ({_f(end, '.0%')}) / {_f(steps, '.1f')}"
            )
        print(f"{tree:<7}{mode:<14}{len(figs):>6}{_f(med['to_target']):>12}"
              f"{_f(med['vs_ddp'], '.3f'):>7}x{_f(med['wall']):>9}{_f(med['ddp_wall']):>12}  "
              + ", ".join(ranks))  # fmt: skip
        summary[f"{tree} {mode}"] = {"medians": med, "calls": figs}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path)
    p.add_argument("--after", type=Path)
    p.add_argument("--job", default="flodl_bus.examples.charrnn:job")
    p.add_argument("--modes", default="nccl-cadence")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=0)
    p.add_argument("--slow-rank", type=int)
    p.add_argument("--slow-factor", type=float, default=2.0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--summarize", action="store_true", help="no new calls: the medians of --out's calls"
    )
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.summarize:
        summarize(args.out, modes)
        return 0
    if args.before is None or args.after is None:
        p.error("--before and --after are required (or --summarize)")
    trees = {"before": args.before, "after": args.after}
    print(f"{args.job}, modes {args.modes}, slow rank {args.slow_rank} x{args.slow_factor}, "
          f"{os.cpu_count()} cores")  # fmt: skip
    for rep in range(args.repeats):
        order = list(trees) if rep % 2 == 0 else list(reversed(trees))
        for name in order:
            load = os.getloadavg()[0]
            run_dir = args.out / f"{name}-{rep}"
            if _call(trees[name], args, run_dir) is None:
                continue
            figs = _figures(run_dir, modes)
            ddp_tt = next(iter(figs.values()))["ddp_to_target"]
            line = [f"rep {rep} {name:<6} load {load:4.1f}  ddp to target {_f(ddp_tt)} s"]
            for mode, fig in figs.items():
                line.append(f"{mode} {_f(fig['to_target'])} s ({_f(fig['vs_ddp'], '.3f')}x ddp)")
            print("  ".join(line), flush=True)
    summarize(args.out, modes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
