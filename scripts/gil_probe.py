"""Do other Python threads of a rank's process slow its training thread? (issue 27)

The median step of the digits model at N torch threads (default 1), alone and beside
Python threads of the same process that each wake HZ times a second and hold the GIL
for WORK_US (the shape of a rank's publisher, reader and record threads). Every
configuration runs three times, interleaved, and its median is printed beside the
step alone. Run from the repository root:

    python3 scripts/gil_probe.py [N]

``scripts/burst_probe.py`` is the same question for other processes (no GIL shared).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import torch

from flodl_bus.examples.digits import job

#: (threads, wakes a second, µs of work a wake)
LOADS = ((0, 0, 0), (1, 200, 50), (1, 600, 20), (3, 200, 30), (1, 1000, 5), (1, 200, 150))
#: steps timed per configuration and run
STEPS = 1500


def waker(stop: threading.Event, hz: float, work_us: float) -> None:
    period = 1.0 / hz
    nxt = time.perf_counter()
    while not stop.is_set():
        nxt += period
        stop.wait(max(0.0, nxt - time.perf_counter()))
        end = time.perf_counter() + work_us * 1e-6
        while time.perf_counter() < end:
            pass


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    torch.manual_seed(0)
    model = job.build_model()
    opt = job.build_optimizer(model)
    data = job.train_data()
    bs = job.batch_size
    n = len(data) // bs

    def median_step(k: int) -> float:
        took = []
        for i in range(k):
            t0 = time.perf_counter()
            j = i % n
            batch = data.batch(list(range(j * bs, (j + 1) * bs)))
            opt.zero_grad(set_to_none=True)
            loss = job.loss_fn(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            float(loss.detach())
            opt.step()
            took.append(time.perf_counter() - t0)
        return statistics.median(took) * 1e6

    median_step(300)  # warm-up
    runs: dict[tuple[int, int, int], list[float]] = {load: [] for load in LOADS}
    for _ in range(3):
        for load in LOADS:
            count, hz, work = load
            stop = threading.Event()
            threads = [
                threading.Thread(target=waker, args=(stop, hz, work), daemon=True)
                for _ in range(count)
            ]
            for t in threads:
                t.start()
            runs[load].append(median_step(STEPS))
            stop.set()
            for t in threads:
                t.join()
    alone = statistics.median(runs[LOADS[0]])
    for (count, hz, work), got in runs.items():
        med = statistics.median(got)
        print(
            f"{count} thread(s) x {hz:4d} wakes/s x {work:3d} us: median step {med:7.1f} us "
            f"({med / alone:5.3f}x alone)"
        )


if __name__ == "__main__":
    main()
