"""The digits step pinned to CPU 0, alone and beside a pure-Python spinner pinned to each
other CPU in turn (BENCHMARKS.md, 2026-12-06, sixth session): a CPU whose spinner slows the
step shares a core or its caches with CPU 0; the step alone at both ends shows the host's
own drift. Run from the repository root: ``python3 scripts/spin_pin.py``
"""

import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_noise import digits_steps

torch.set_num_threads(1)
os.sched_setaffinity(0, {0})
steps = digits_steps(1000)

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
