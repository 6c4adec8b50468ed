"""Does a second training process slow the first on this host? (BENCHMARKS.md, issue 27)

Two bus ranks each step slower than one plain loop on the 16-core host (0.83-0.94 ms
against 0.50-0.52), where this 2-core machine shows them level. Before the bus is blamed,
this times the same digits step (``step_noise.digits_steps``, one torch thread) in K
plain processes at once, no bus, no Redis: K = 1, 2, 4 in turn, alternating for
``ROUNDS`` rounds so the host's drift lands on each K. Each process times a window of
steps after a barrier; the line gives every process's median step (µs). If K = 2 is
1.6x K = 1 here, two cores of this host cannot each run the step at one process's speed,
and no control plane can make two ranks beat that. Run from the repository root:

    ROUNDS=3 python3 scripts/plain_pairs.py

``PIN=0,8`` binds process i to core ``PIN[i]`` (all its threads), to tell two processes
sharing a physical core (hyperthreads) from two on their own.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WINDOW = 3000


def _worker(barrier: mp.synchronize.Barrier, out: mp.Queue, core: int | None) -> None:  # type: ignore[type-arg]
    if core is not None:
        os.sched_setaffinity(0, {core})
    import torch
    from step_noise import digits_steps

    torch.set_num_threads(1)
    steps = digits_steps(WINDOW)
    steps(300)  # warm: the allocator, the first batches
    barrier.wait()
    out.put(steps())


def run(k: int) -> list[float]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(k)
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    pins = [int(c) for c in os.environ["PIN"].split(",")] if os.environ.get("PIN") else []
    procs = [
        ctx.Process(target=_worker, args=(barrier, out, pins[i] if i < len(pins) else None))
        for i in range(k)
    ]
    for p in procs:
        p.start()
    medians = sorted(out.get() for _ in procs)
    for p in procs:
        p.join()
    return medians


def main() -> None:
    counts = [int(x) for x in os.environ.get("COUNTS", "1,2,4").split(",")]
    rows: dict[int, list[float]] = {k: [] for k in counts}
    for r in range(int(os.environ.get("ROUNDS", "3"))):
        for k in counts:
            medians = run(k)
            rows[k].append(statistics.median(medians))
            print(f"round {r} K={k}: " + ", ".join(f"{m:.0f}" for m in medians) + " us", flush=True)
    base = statistics.median(rows[counts[0]])
    for k in counts:
        m = statistics.median(rows[k])
        print(f"K={k}: median step {m:.0f} us, {m / base:.3f}x K={counts[0]}")


if __name__ == "__main__":
    main()
