"""The digits step pinned to CPU 0, alone and beside a pure-Python spinner pinned to each
other CPU in turn (BENCHMARKS.md, 2026-12-06, sixth session): a CPU whose spinner slows the
step shares a core or its caches with CPU 0; the step alone at both ends shows the host's
own drift. Run from the repository root: ``python3 scripts/spin_pin.py``
"""

import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from flodl_bus.examples import digits
from flodl_bus.job import as_arrays
from flodl_bus.partition import make_partition

torch.set_num_threads(1)
os.sched_setaffinity(0, {0})
job = digits.job
data = as_arrays(job.train_data(), "x")
model = job.build_model()
opt = job.build_optimizer(model)
picks = make_partition(0, len(data), len(data), 0)
bs = job.batch_size
batches = [data.batch(picks[i * bs : (i + 1) * bs]) for i in range(len(data) // bs)]


def steps(n=1000):
    ts = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        opt.zero_grad(set_to_none=True)
        loss = job.loss_fn(model, batches[i % len(batches)])
        loss.backward()
        opt.step()
        float(loss.detach())
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1000


steps(500)
ncpu = os.cpu_count() or 1
for _ in range(int(os.environ.get("ROUNDS", "1"))):
    row = [f"alone {steps():.0f}"]
    for k in range(1, ncpu):
        p = subprocess.Popen(["taskset", "-c", str(k), sys.executable, "-c", "while True: pass"])
        time.sleep(0.15)
        row.append(f"{k}:{steps():.0f}")
        p.kill()
        p.wait()
    row.append(f"alone {steps():.0f}")
    print(" ".join(row), flush=True)
