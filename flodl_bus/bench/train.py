"""``flodl-bus bench train``: a real training run under the bus beside its references.

Runs, each in a fresh process and in this order, on the same job, data and epochs:

1. ``plain``: the same model trained by one process with no bus (``baselines.plain_loop``);
2. ``bus``: ``flodl-bus up`` with ``--workers`` ranks and ``--mode`` (embedded Redis);
3. ``ddp`` (``--ddp``, more than one worker): ``DistributedDataParallel`` on as many ranks.

It prints, for each, the training span (first to last step: process start, imports and
data building are excluded on every side), samples/s, the final eval metric and the number
of averaging rounds (our reduces) or gradient all-reduces (DDP), and the span ratio against
the plain loop. The bus run's record stays in ``--run-dir`` for ``flodl-bus replay``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flodl_bus.job import load_job
from flodl_bus.record.log import read_records

_PLAIN = """
import json, sys, torch
from flodl_bus.bench.baselines import plain_loop
from flodl_bus.job import load_job
torch.set_num_threads(int(sys.argv[4]))
job = load_job(sys.argv[1])
epochs = int(sys.argv[3]) or None
r = plain_loop(job, sys.argv[2], epochs)
print(json.dumps({"wall": r.wall_s, "samples": r.samples, "steps": r.steps, "metric": r.metric}))
"""

_DDP = """
import json, sys
from flodl_bus.bench.baselines import ddp_loop
epochs = int(sys.argv[4]) or None
r = ddp_loop(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "cuda", epochs)
print(json.dumps({"wall": r.wall_s, "samples": r.samples, "steps": r.steps,
                  "metric": r.metric, "collectives": r.collectives}))
"""


def _python(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _bus(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "flodl_bus.cli",
        "up",
        "--job",
        args.job,
        "--workers",
        str(args.workers),
        "--mode",
        args.mode,
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]
    if args.epochs:
        cmd += ["--epochs", str(args.epochs)]
    cmd += ["--lr-scale-ratio", repr(args.lr_scale_ratio)]
    subprocess.run(cmd, check=True)
    records = read_records(run_dir / "up.jsonl")
    first = next(r["after_s"] for r in records if r.get("event") == "first_step")
    epochs = [r for r in records if r.get("event") == "epoch"]
    summary = next(r for r in records if r.get("event") == "summary")
    return {
        "wall": epochs[-1]["at"] - first,
        # every rank's batches: the run's samples, whatever its epochs
        "samples": summary["batches"] * load_job(args.job).batch_size,
        "steps": summary["batches"],
        "metric": summary["final_metric"],
        "collectives": summary["syncs"],
        "launch_wall": summary["wall_s"],
        "first_step": first,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flodl-bus bench train", description=__doc__)
    p.add_argument("--job", default="flodl_bus.examples.digits:job")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--mode", default="nccl-cadence")
    p.add_argument("--epochs", type=int, default=0, help="override the job's epochs")
    p.add_argument(
        "--plain-epochs",
        type=int,
        help="epochs of the plain 1-process loop (default: --epochs); e.g. one GPU at the "
        "job's epochs beside two ranks at twice as many, the same optimizer steps per GPU",
    )
    p.add_argument("--device", default="auto", help="device of the plain loop (auto: cuda:0)")
    p.add_argument("--ddp", action="store_true", help="also run torch DDP on --workers ranks")
    p.add_argument(
        "--lr-scale-ratio", type=float, default=1.0, help="passed to the bus run (flodl's 1.0)"
    )
    p.add_argument("--run-dir", help="keep the bus run's record here")
    args = p.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    device = ("cuda:0" if cuda else "cpu") if args.device == "auto" else args.device
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="flodl-bench-train-"))
    env_note = f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if cuda else "")
    print(f"flodl-bus bench train: {args.job}, {args.workers} worker(s), {args.mode}; {env_note}")

    results: dict[str, dict[str, Any]] = {}
    # One process per core share, as `up` gives each rank: a fair CPU comparison.
    threads = max(1, (os.cpu_count() or 1) // max(args.workers, 1))
    plain_epochs = args.epochs if args.plain_epochs is None else args.plain_epochs
    results["plain (1 proc)"] = _python(_PLAIN, args.job, device, str(plain_epochs), str(threads))
    results[f"bus {args.mode} x{args.workers}"] = _bus(args, run_dir)
    if args.ddp and args.workers > 1:
        results[f"ddp x{args.workers}"] = _python(
            _DDP, args.job, str(args.workers), "cuda" if cuda else "cpu", str(args.epochs)
        )

    base = results["plain (1 proc)"]["wall"]
    plain_samples = results["plain (1 proc)"]["samples"]
    print(f"\n{'run':<26}{'train s':>9}{'samples/s':>11}{'metric':>8}{'rounds':>8}{'vs plain':>10}")
    for name, r in results.items():
        samples = r["samples"] if r["samples"] is not None else plain_samples
        metric = "-" if r["metric"] is None else f"{r['metric']:.4f}"
        rounds = r.get("collectives", 0)
        print(
            f"{name:<26}{r['wall']:>9.2f}{samples / r['wall']:>11.0f}{metric:>8}"
            f"{rounds:>8}{r['wall'] / base:>9.3f}x"
        )
    bus = results[f"bus {args.mode} x{args.workers}"]
    print(
        f"\nbus run: launch to first step {bus['first_step']:.2f}s, whole launch "
        f"{bus['launch_wall']:.2f}s; record in {run_dir}"
    )
    if os.environ.get("FLODL_BENCH_JSON"):
        Path(os.environ["FLODL_BENCH_JSON"]).write_text(json.dumps(results, indent=1))
    return 0
