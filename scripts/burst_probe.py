"""Does bursty work beside a rank slow its intra-op team? (issue 27)

The median step of the digits model (``bench worker``'s plain step) at N torch threads,
alone and beside K processes that each wake HZ times a second and spin WORK_US of CPU,
the shape of what the coordinator, Redis and the records do beside a rank of a world of
one. Run from the repository root:

    python3 scripts/burst_probe.py 15,8      (thread counts)
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

#: (processes, wakes a second, µs of work a wake)
LOADS = ((0, 0.0, 0.0), (1, 450.0, 100.0), (3, 450.0, 100.0), (1, 2000.0, 20.0))


def burner(hz: float, work_us: float, stop: Any) -> None:
    period = 1.0 / hz
    nxt = time.perf_counter()
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < work_us / 1e6:
            pass
        nxt += period
        d = nxt - time.perf_counter()
        if d > 0:
            time.sleep(d)


def median_step_us(threads: int, seconds: float) -> float:
    import torch

    from flodl_bus.bench.worker import _batches, _train_step
    from flodl_bus.job import load_job

    torch.set_num_threads(threads)
    job = load_job("flodl_bus.examples.digits:job")
    model = job.build_model()
    opt = job.build_optimizer(model)
    times: list[int] = []
    end = time.perf_counter() + seconds
    for batch in _batches(job, 10**9):
        t0 = time.perf_counter_ns()
        _train_step(job, model, opt, batch)
        times.append(time.perf_counter_ns() - t0)
        if time.perf_counter() > end:
            break
    return statistics.median(times[200:]) / 1000.0  # past the first steps' warm-up


def main() -> None:
    for threads in (int(x) for x in sys.argv[1].split(",")):
        for k, hz, work in LOADS:
            stop = mp.Event()
            procs = [mp.Process(target=burner, args=(hz, work, stop)) for _ in range(k)]
            for p in procs:
                p.start()
            us = median_step_us(threads, 4.0)
            stop.set()
            for p in procs:
                p.join()
            print(
                f"threads {threads:2d}, {k} process(es) x {hz:.0f}/s x {work:.0f} us: "
                f"median step {us:7.1f} us",
                flush=True,
            )


if __name__ == "__main__":
    main()
