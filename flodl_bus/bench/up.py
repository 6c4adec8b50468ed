"""``flodl-bus bench up``: time to the first step and wall time of ``flodl-bus up``.

Each figure is printed next to a reference measured in the same run, on the same job,
from a cold process start (the interpreter and torch imports included, as for ``up``):

* first step: one process that imports torch and the job, builds the data and the
  model and takes one training step: the least any launcher could do before a step;
* wall time: that process training the whole job alone (``baselines.plain_loop``).

Medians over ``--repeat`` runs; the runs alternate so machine load hits both sides.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from flodl_bus.record.log import read_records

_FIRST_STEP = """
import sys, torch
from flodl_bus.job import load_job
job = load_job(sys.argv[1])
torch.manual_seed(job.seed)
model = job.build_model()
opt = job.build_optimizer(model)
data = job.train_data()
loss = job.loss_fn(model, data.batch(range(job.batch_size)))
loss.backward()
opt.step()
"""

_PLAIN = """
import sys
from flodl_bus.bench.baselines import plain_loop
from flodl_bus.job import load_job
epochs = int(sys.argv[2]) if len(sys.argv) > 2 else None
result = plain_loop(load_job(sys.argv[1]), epochs=epochs)
print("METRIC", result.metric)
"""


def _timed(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, str]:
    t0 = time.monotonic()
    out = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    if out.returncode != 0:
        raise SystemExit(
            f"bench up: {argv[:4]} failed ({out.returncode}):\n{out.stdout}{out.stderr}"
        )
    return took, out.stdout


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flodl-bus bench up", description=__doc__)
    p.add_argument("--job", default="flodl_bus.examples.digits:job")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mode", default="cpu-cadence")
    p.add_argument("--epochs", type=int)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    env = {**os.environ}
    env.pop("FLODL_RUN_SECRET", None)
    one_thread = {**env, "OMP_NUM_THREADS": "1"}
    epochs = [] if args.epochs is None else [str(args.epochs)]
    first: list[float] = []
    wall: list[float] = []
    ref_first: list[float] = []
    ref_wall: list[float] = []
    with tempfile.TemporaryDirectory(prefix="flodl-bench-up-") as tmp:
        for i in range(args.repeat):
            run = f"bench{i}"
            up = [sys.executable, "-m", "flodl_bus.cli", "up", "--no-progress", "--no-plot",
                  "--run", run, "--job", args.job, "--workers", str(args.workers),
                  "--mode", args.mode]  # fmt: skip
            if args.epochs is not None:
                up += ["--epochs", str(args.epochs)]
            _timed(up, env, tmp)
            summary = read_records(Path(tmp, "runs", run, "up.jsonl"))[-1]
            first.append(float(summary["first_step_s"]))
            wall.append(float(summary["wall_s"]))
            t, _ = _timed([sys.executable, "-c", _FIRST_STEP, args.job], one_thread, tmp)
            ref_first.append(t)
            t, _ = _timed([sys.executable, "-c", _PLAIN, args.job, *epochs], one_thread, tmp)
            ref_wall.append(t)
    med = statistics.median
    print(f"flodl-bus up: {args.job}, {args.workers} workers, {args.mode}, {args.repeat} runs")
    print(
        f"  first step   {med(first):6.2f}s   reference (one cold process to its first step) "
        f"{med(ref_first):6.2f}s   ratio {med(first) / med(ref_first):.2f}x"
    )
    print(
        f"  wall time    {med(wall):6.2f}s   reference (one cold process, plain loop)        "
        f"{med(ref_wall):6.2f}s   ratio {med(wall) / med(ref_wall):.2f}x"
    )
    print(f"  runs: first step {[round(x, 2) for x in first]}, wall {[round(x, 2) for x in wall]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
