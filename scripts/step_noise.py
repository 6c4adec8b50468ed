"""Does an idle Python thread slow the training thread's step on this host? (BENCHMARKS.md)

The digits step timed in one process, in windows of 1,500 steps: alone, then beside three
threads blocked on an event, on a timed wait, on a socket, or waking every 5 ms for a
little Python; three rounds, interleaved, so the host's own drift shows beside the
threads' effect. Run from the repository root:

    T=1 python3 scripts/step_noise.py
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.getcwd())

from flodl_bus.examples import digits
from flodl_bus.job import as_arrays
from flodl_bus.partition import make_partition

THREADS = int(os.environ.get("T", "1"))
WINDOW = 1500


def digits_steps(window: int = WINDOW) -> Callable[..., float]:
    """``steps(n)``: the median µs of ``n`` digits steps (the epoch-0 batches, in turn),
    on a model and optimizer built once, in this thread, at torch's thread count now."""
    job = digits.job
    data = as_arrays(job.train_data(), "step_noise")
    model = job.build_model()
    opt = job.build_optimizer(model)
    picks = make_partition(0, len(data), len(data), 0)
    bs = job.batch_size
    batches = [data.batch(picks[i * bs : (i + 1) * bs]) for i in range(len(data) // bs)]

    def steps(n: int = window) -> float:
        times = []
        for i in range(n):
            t0 = time.perf_counter_ns()
            opt.zero_grad(set_to_none=True)
            loss = job.loss_fn(model, batches[i % len(batches)])
            loss.backward()
            opt.step()
            float(loss.detach())
            times.append(time.perf_counter_ns() - t0)
        return statistics.median(times) / 1000

    return steps


def main() -> None:
    torch.set_num_threads(THREADS)
    steps = digits_steps()

    def beside(kind: str) -> float:
        stop = threading.Event()
        socks: list[socket.socket] = []

        def timed() -> None:
            while not stop.is_set():
                stop.wait(0.25)

        def ticker() -> None:
            while not stop.is_set():
                stop.wait(0.005)
                sum(range(300))

        def reader(s: socket.socket) -> None:
            try:
                while not stop.is_set() and s.recv(10):
                    pass
            except OSError:
                pass

        threads = []
        for _ in range(3):
            target: Callable[..., None]
            args: tuple[object, ...] = ()
            if kind == "sock":
                a, b = socket.socketpair()
                socks += [a, b]
                target, args = reader, (a,)
            else:
                target = {"wait": stop.wait, "timed": timed, "ticker": ticker}[kind]
            t = threading.Thread(target=target, args=args, daemon=True)
            t.start()
            threads.append(t)
        try:
            return steps()
        finally:
            stop.set()
            for s in socks:
                s.close()
            for t in threads:
                t.join(1)

    steps(300)  # warm-up
    kinds = ("alone", "wait", "timed", "sock", "ticker")
    got: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(3):
        for kind in kinds:
            got[kind].append(steps() if kind == "alone" else beside(kind))
    for kind, runs in got.items():
        shown = ", ".join(f"{r:.1f}" for r in runs)
        print(f"T={THREADS} {kind:6s} median step {statistics.median(runs):8.1f} us  ({shown})")


if __name__ == "__main__":
    main()
