"""The references a training benchmark is measured against, on the same job and data.

* ``plain_loop``: one process, the same model/optimizer/batches/LR a rank uses, no bus:
  what a user would write by hand (it reads the loss every step, as our ranks do).
* ``ddp_loop``: ``torch.nn.parallel.DistributedDataParallel`` over ``world`` processes
  (NCCL on CUDA, gloo on CPU), each training its 1/world share of every epoch with an
  all-reduce per step, tuned as DDP users tune it (``gradient_as_bucket_view``, and
  ``static_graph`` for the fixed graphs of our jobs).

Fair to them, as a reviewer would ask:

* the same data path as a rank: ``worker.feed`` (the next batch made off the training
  thread, pinned and copied on a side stream, or the dataset kept on the GPU);
* the same share of the host's cores as a rank: each DDP process takes
  ``cores / LOCAL_WORLD_SIZE`` threads, CUDA or not (``worker.host.thread_share``, the
  rule our ranks follow); the plain loop is given one rank's share by its caller;
* the same care with that share: where a CPU rank would size its threads to the work
  over its first steps (``worker.threads``: the default share, no count asked for), so
  do the plain loop and each DDP process, with the same ``ThreadTuner``. Held at their
  share, both lost to a sized rank on small models for the count alone (a host's plain
  loop: 1.22 s at 15 threads, 1.07-1.11 s at 1 or 2; DDP under torchrun would run at
  ``OMP_NUM_THREADS=1``);
* the same eval cadence: the model is evaluated every ``eval_every`` epochs, inside the
  clock as a rank's evals are inside the bus run's, so "time to target" (the clock once
  the eval that reached it is known) means the same on every side.

Both use ``flodl_bus.partition`` for the per-epoch shuffle, so every run sees the same
sample order family.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from flodl_bus.bench.breakdown import BLOCKS, step_profile
from flodl_bus.job import Job, load_job
from flodl_bus.params.hosts import pin_one_host
from flodl_bus.partition import SHUFFLE_BASE_SEED, make_partition
from flodl_bus.worker import thread_stats
from flodl_bus.worker.feed import FeedOptions, make_feed
from flodl_bus.worker.host import set_rank_env, thread_share, tunes_threads, usable_cores
from flodl_bus.worker.threads import ThreadTuner


@dataclass(frozen=True)
class BaselineResult:
    name: str
    #: time of the whole run, first step to the last eval (evals on the cadence included)
    wall_s: float
    samples: int
    steps: int
    metric: float | None
    collectives: int = 0
    #: (epoch, training seconds at its end, metric) of every eval on the cadence
    evals: tuple[tuple[int, float, float], ...] = field(default=())
    #: where the time went, timed as a rank times its steps (``bench.breakdown``):
    #: seconds in ``compute``, ``data``, ``eval`` and the ``rest``, of the ``total``
    parts: dict[str, float] = field(default_factory=dict)
    #: the thread count it kept after sizing them to the work (None: not sized)
    threads: int | None = None


@dataclass
class _Run:
    samples: int = 0
    steps: int = 0
    total: float = 0.0
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    compute: float = 0.0
    data: float = 0.0
    eval: float = 0.0
    #: every step's length (data and compute), seconds
    lengths: list[float] = field(default_factory=list)
    #: the thread count kept once sized to the work (None: not sized)
    threads: int | None = None
    #: times a second the training thread blocked (``worker.thread_stats``; None: unknown)
    blocks_s: float | None = None

    def parts(self) -> dict[str, float]:
        rest = self.total - self.compute - self.data - self.eval
        return {
            "total": self.total,
            "compute": self.compute,
            "data": self.data,
            "eval": self.eval,
            "rest": max(0.0, rest),
            **step_profile(self.lengths),
            **({} if self.blocks_s is None else {BLOCKS: self.blocks_s}),
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _evaluate(job: Job, model: nn.Module) -> float | None:
    if job.eval_fn is None or job.eval_data is None:
        return None
    model.eval()
    try:
        return float(job.eval_fn(model, job.eval_data()))
    finally:
        model.train()


class _Clock:
    """The run's time, stopped only where a caller says (device work included)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.total = 0.0
        self._t0: float | None = None

    def start(self) -> None:
        _sync(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        _sync(self.device)
        assert self._t0 is not None
        self.total += time.perf_counter() - self._t0
        self._t0 = None
        return self.total


def _train(
    job: Job,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    device: torch.device,
    epochs: int,
    *,
    shard: tuple[int, int] = (0, 1),
    eval_every: int = 1,
    evaluate: bool = True,
    barrier: bool = False,
    tuner: ThreadTuner | None = None,
) -> _Run:
    """The rank's step, epoch after epoch, timed as a rank times it; ``tuner``: its
    threads sized to the work over the first steps, as a rank sizes its own."""
    data = job.train_data()
    rank, world = shard
    bs = job.batch_size
    run = _Run()
    planned = job.planned_steps(epochs, len(data))
    feed = make_feed(data, device, FeedOptions.from_env(), seed=job.seed + rank)
    clip = job.max_grad_norm
    clock = _Clock(device)
    now = time.perf_counter
    # Counted as a rank counts its own (``RankSession``): from set up to the end.
    began = thread_stats.sample()
    try:
        clock.start()
        for epoch in range(epochs):
            per_rank = len(data) // world
            picks = make_partition(rank * per_rank, per_rank, len(data), epoch, SHUFFLE_BASE_SEED)
            n = len(picks) // bs

            def picks_of(j: int, picks: list[int] = picks, n: int = n) -> list[int] | None:
                return picks[j * bs : (j + 1) * bs] if j < n else None

            feed.begin(picks_of)
            for b in range(n):
                t0 = now()
                batch = feed.get(b)
                t1 = now()
                lr = job.lr(run.steps * world, planned)
                if lr is not None:  # None: the optimizer's own LR, as a rank trains
                    for group in opt.param_groups:
                        group["lr"] = lr
                opt.zero_grad(set_to_none=True)
                loss = job.loss_fn(model, batch)
                loss.backward()  # type: ignore[no-untyped-call]
                float(loss.detach())  # ranks read every loss after backward; so does this
                if clip is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                t2 = now()
                run.data += t1 - t0
                run.compute += t2 - t1
                run.lengths.append(t2 - t0)
                run.samples += bs
                run.steps += 1
                if tuner is not None:
                    count = tuner.observe((t2 - t0) * 1000.0)
                    if count is not None:
                        torch.set_num_threads(count)
                    if tuner.done:
                        run.threads, tuner = tuner.chosen, None
            if (epoch + 1) % eval_every == 0 or epoch + 1 == epochs:
                t0 = now()
                # the bare module: a DDP forward on one rank alone would wait for the others
                metric = _evaluate(job, getattr(model, "module", model)) if evaluate else None
                run.eval += now() - t0
                if barrier:
                    dist.barrier()  # the others wait for the eval, as DDP users' loops do
                at = clock.stop()
                if metric is not None:
                    run.evals.append((epoch, at, metric))
                clock.start()
        run.total = clock.stop()
        trained = thread_stats.since(began, thread_stats.sample())
        run.blocks_s = None if trained is None else trained["blocks_s"]
    finally:
        feed.close()
    return run


def sizing(device: torch.device) -> ThreadTuner | None:
    """A ``ThreadTuner`` from the current count where a CPU rank would size its own
    threads (``RankSession._thread_tuner``'s rule, lockstep aside: no baseline is)."""
    share = torch.get_num_threads()
    if device.type != "cpu" or share <= 1 or not tunes_threads(os.environ):
        return None
    return ThreadTuner(share)


def plain_loop(
    job: Job,
    device: str = "cpu",
    epochs: int | None = None,
    *,
    eval_every: int = 1,
    tune: bool = True,
) -> BaselineResult:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    set_rank_env(0, 1)
    torch.manual_seed(job.seed)
    model = job.build_model().to(dev)
    opt = job.build_optimizer(model)
    job.train_data()  # build (and cache) the data before the clock starts, as ranks do
    tuner = sizing(dev) if tune else None
    run = _train(job, model, opt, dev, epochs or job.num_epochs, eval_every=eval_every, tuner=tuner)
    metric = run.evals[-1][2] if run.evals else None
    return BaselineResult(
        "plain",
        run.total,
        run.samples,
        run.steps,
        metric,
        evals=tuple(run.evals),
        parts=run.parts(),
        threads=run.threads,
    )


def _ddp_rank(
    rank: int,
    world: int,
    job_ref: str,
    store_path: str,
    epochs: int,
    cuda: bool,
    out: str,
    eval_every: int,
) -> None:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    set_rank_env(rank, world)
    threads = thread_share(os.environ, usable_cores())
    if threads is not None:  # each rank its share of the cores, as our ranks take
        torch.set_num_threads(threads)
    job = load_job(job_ref)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    pin_one_host(os.environ)  # DDP's ranks share this host: gloo/NCCL stay on loopback
    store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world)
    try:
        torch.manual_seed(job.seed)
        model = job.build_model().to(device)
        ddp = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[rank] if cuda else None,
            gradient_as_bucket_view=True,
            static_graph=True,
        )
        opt = job.build_optimizer(ddp)
        job.train_data()
        dist.barrier()
        run = _train(
            job,
            ddp,
            opt,
            device,
            epochs,
            shard=(rank, world),
            eval_every=eval_every,
            evaluate=rank == 0,
            barrier=True,
            tuner=sizing(device),
        )
        if rank == 0:
            torch.save(
                {
                    "threads": run.threads,
                    "wall": run.total,
                    "samples": run.samples * world,
                    "steps": run.steps,
                    "metric": run.evals[-1][2] if run.evals else None,
                    "evals": run.evals,
                    "parts": run.parts(),
                },
                out,
            )
        # Leave together: a gloo peer torn down while the other still holds its pairs
        # can abort the process ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def ddp_loop(
    job_ref: str, world: int, cuda: bool, epochs: int | None = None, *, eval_every: int = 1
) -> BaselineResult:
    job = load_job(job_ref)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        try:
            mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
                _ddp_rank,
                args=(
                    world,
                    job_ref,
                    os.path.join(tmp, "store"),
                    epochs or job.num_epochs,
                    cuda,
                    out,
                    eval_every,
                ),
                nprocs=world,
                join=True,
            )
        except mp.ProcessExitedException as exc:  # type: ignore[attr-defined]
            # Rank 0 writes the result after the last epoch's barrier, which every rank
            # passed: a rank that died after it died in gloo's teardown, not in the run.
            if not os.path.exists(out):
                raise
            print(f"ddp baseline: a rank died after the run, in its teardown ({exc})",
                  file=sys.stderr)  # fmt: skip
        r = torch.load(out)
    # DDP all-reduces gradients once per step on every rank
    return BaselineResult(
        f"ddp x{world}",
        r["wall"],
        r["samples"],
        r["steps"],
        r["metric"],
        collectives=r["steps"],
        evals=tuple(tuple(e) for e in r["evals"]),  # type: ignore[misc]
        parts=r["parts"],
        threads=r.get("threads"),
    )
