"""``flodl-bus bench worker``: what the bus costs the training thread per step.

Per step a rank's training thread does exactly this for the bus: account the step and
build its reports (``WorkerControl.step_done``, with the parameter norm every 10th step),
publish a Batch and an LrUpdate, and poll the control queue (``handle_control``). The
bench trains the digits model for real and times that block after every step, with the
rank's runtime threads (control reader, heartbeats, the transport's publisher) running.
The reference is the step time of the same model, same data, with no bus at all,
measured in the same run. Medians over steps, then the median over repeats. Redis is
timed twice: the rank's bus on threads of the training process, and in a process of
its own (``--rank-io process``, ``agent.rank_io``); each line also says how often the
training thread blocked a second (``worker.thread_stats``), the count a GIL hand-over
leaves, which does not drift with the host's speed as times do.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from flodl_bus.bus.api import RankBus
from flodl_bus.bus.keys import RunKeys
from flodl_bus.job import Job, as_arrays, load_job
from flodl_bus.partition import make_partition
from flodl_bus.worker import thread_stats
from flodl_bus.worker.control import PARAM_NORM_EVERY, WorkerControl
from flodl_bus.worker.inbox import Inbox
from flodl_bus.worker.local_params import LocalParams
from flodl_bus.worker.loop import RankLoop
from flodl_bus.worker.runtime import RankRuntime, RuntimeConfig

TARGET_US = 20.0


@dataclass(frozen=True, slots=True)
class Sample:
    step_us: float
    bus_us: float
    bus_mean_us: float
    #: times a second the training thread blocked (another thread took the GIL, or IO)
    blocks_s: float | None = None


def _batches(job: Job, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    data = as_arrays(job.train_data(), "bench worker")
    space, bs, epoch = len(data), job.batch_size, 0
    while True:
        picks = make_partition(0, space, space, epoch)
        for i in range(space // bs):
            if steps == 0:
                return
            steps -= 1
            yield data.batch(picks[i * bs : (i + 1) * bs])
        epoch += 1


def _train_step(
    job: Job, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: object
) -> float:
    opt.zero_grad(set_to_none=True)
    loss = job.loss_fn(model, batch)  # type: ignore[arg-type]
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return float(loss.detach())


def plain_steps(job: Job, steps: int) -> float:
    """Median step time (µs) of the model trained with no bus."""
    model = job.build_model()
    opt = job.build_optimizer(model)
    times: list[int] = []
    for batch in _batches(job, steps):
        t0 = time.perf_counter_ns()
        _train_step(job, model, opt, batch)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1000.0


def bus_steps(job: Job, steps: int, bus: RankBus) -> Sample:
    model = job.build_model()
    opt = job.build_optimizer(model)
    inbox = Inbox()
    params = LocalParams(model, inject=inbox.put, publish=bus.publish)
    control = WorkerControl(
        rank=bus.rank,
        params=params,
        batch_size=job.batch_size,
        pick_space=len(job.train_data()),
        clock=time.perf_counter,
    )
    loop = RankLoop(
        job=job,
        control=control,
        inbox=inbox,
        publish=bus.publish,
        model=model,
        optimizer=opt,
        train_data=job.train_data(),
    )
    runtime = RankRuntime(
        bus=bus,
        inbox=inbox,
        params=params,
        world_size=1,
        config=RuntimeConfig(coord_liveness_timeout=3600.0),
    )
    publish, handle_control = bus.publish, loop.handle_control
    step_ns: list[int] = []
    bus_ns: list[int] = []
    runtime.start()
    began = thread_stats.sample()
    try:
        for batch in _batches(job, steps):
            t0 = time.perf_counter_ns()
            loss = _train_step(job, model, opt, batch)
            t1 = time.perf_counter_ns()
            report, lr = control.step_done(loss, (t1 - t0) / 1e6, 0.0, 3e-3)
            publish(report)
            if lr is not None:
                publish(lr)
            handle_control()
            t2 = time.perf_counter_ns()
            step_ns.append(t1 - t0)
            bus_ns.append(t2 - t1)
        trained = thread_stats.since(began, thread_stats.sample())
    finally:
        runtime.close()
    return Sample(
        step_us=statistics.median(step_ns) / 1000.0,
        bus_us=statistics.median(bus_ns) / 1000.0,
        bus_mean_us=statistics.fmean(bus_ns) / 1000.0,
        blocks_s=None if trained is None else trained["blocks_s"],
    )


@contextmanager
def _redis_bus(url: str | None) -> Iterator[dict[str, Callable[[], RankBus]]]:
    """The Redis contenders: the rank's bus on threads of the training process, and in
    a process of its own (``--rank-io process``)."""
    from flodl_bus.agent.rank_io import RankIoBus
    from flodl_bus.bus.connection import connect
    from flodl_bus.bus.server import RedisServer
    from flodl_bus.bus.streams import RedisRankBus
    from flodl_bus.protocol.signing import fixed_keys, rank_keys_for

    server = None
    if url is None:
        server = RedisServer().start()
        url = server.url
    client = connect(url)
    counter = iter(range(1_000_000))
    try:

        def run() -> str:
            return f"bench-worker-{time.time_ns()}-{next(counter)}"

        def threads() -> RankBus:
            return RedisRankBus(client, run(), 0, rank_keys_for(fixed_keys(), 0))

        def process() -> RankBus:
            assert url is not None
            return RankIoBus(url, RunKeys(run()), 0, rank_keys_for(fixed_keys(), 0))

        yield {"redis": threads, "redis, own process": process}
    finally:
        client.close()
        if server is not None:
            server.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flodl-bus bench worker", description=__doc__)
    p.add_argument("--steps", type=int, default=3000, help="training steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    p.add_argument("--redis-url", help="use this Redis (default: start a local redis-server)")
    p.add_argument("--no-redis", action="store_true", help="in-process bus only")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads of the training step (default 1)"
    )
    args = p.parse_args(argv)
    if args.steps < 10 * PARAM_NORM_EVERY or args.repeats < 1:
        print("flodl-bus bench worker: use --steps >= 100 and --repeats >= 1", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))  # 1: steadier step times on a shared machine
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    from flodl_bus.bus.memory import MemoryHub

    # Loaded by name: examples sit above the worker plane.
    job = load_job("flodl_bus.examples.digits:job")
    buses: list[tuple[str, Callable[[], RankBus]]] = [
        ("memory", lambda: MemoryHub(1, roundtrip=False).rank_bus(0))
    ]
    with _maybe_redis(args) as redis_buses:
        buses[:0] = redis_buses.items()
        plain: list[float] = []
        results: dict[str, list[Sample]] = {name: [] for name, _ in buses}
        for _ in range(args.repeats):
            plain.append(plain_steps(job, args.steps))
            for name, make in buses:
                results[name].append(bus_steps(job, args.steps, make()))

    ref = statistics.median(plain)
    print(f"model: {job.name}, batch {job.batch_size}, {args.steps} steps x {args.repeats} runs")
    print(f"  plain PyTorch step, no bus (median)            {ref:8.1f} us")
    for name, samples in results.items():
        bus = statistics.median(s.bus_us for s in samples)
        mean = statistics.median(s.bus_mean_us for s in samples)
        step = statistics.median(s.step_us for s in samples)
        verdict = "ok" if bus <= TARGET_US else "OVER TARGET"
        print(
            f"  [{name}] bus block per step (median)          {bus:8.2f} us"
            f"  = {100 * bus / ref:.1f}% of a plain step; target <= {TARGET_US:.0f} us: {verdict}"
        )
        every = f"{PARAM_NORM_EVERY}th"
        print(f"  [{name}]   mean, incl. the param norm every {every} step {mean:8.2f} us")
        print(
            f"  [{name}]   train step while the bus threads run {step:8.1f} us"
            f"  ({step - ref:+.1f} us vs plain: what the rank's other threads cost the step"
            " itself)"
        )
        blocks = [s.blocks_s for s in samples if s.blocks_s is not None]
        if blocks:
            print(
                f"  [{name}]   training thread blocked           {statistics.median(blocks):8.1f}"
                " /s  (each a wait for the GIL another thread held, or for IO)"
            )
    return 0


@contextmanager
def _maybe_redis(args: argparse.Namespace) -> Iterator[dict[str, Callable[[], RankBus]]]:
    if args.no_redis:
        yield {}
        return
    with _redis_bus(args.redis_url) as make:
        yield make
