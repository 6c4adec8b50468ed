"""The references a training benchmark is measured against, on the same job and data.

* ``plain_loop``: one process, the same model/optimizer/batches/LR a rank uses, no bus —
  what a user would write by hand (it reads the loss every step, as our ranks do).
* ``ddp_loop``: ``torch.nn.parallel.DistributedDataParallel`` over ``world`` processes
  (NCCL on CUDA, gloo on CPU), each training its 1/world share of every epoch with an
  all-reduce per step.

Both use ``flodl_bus.partition`` for the per-epoch shuffle, so every run sees the same
sample order family, and both report wall time, samples/s and the final eval metric.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from flodl_bus.job import Job, as_arrays, load_job
from flodl_bus.partition import SHUFFLE_BASE_SEED, make_partition


@dataclass(frozen=True)
class BaselineResult:
    name: str
    wall_s: float
    samples: int
    steps: int
    metric: float | None
    collectives: int = 0


def _train_epochs(
    job: Job,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    device: torch.device,
    epochs: int,
    shard: tuple[int, int] = (0, 1),
) -> tuple[int, int]:
    data = as_arrays(job.train_data(), "the baseline loop")
    rank, world = shard
    bs = job.batch_size
    samples = steps = 0
    planned = job.planned_steps(epochs, len(data))
    for epoch in range(epochs):
        per_rank = len(data) // world
        picks = make_partition(rank * per_rank, per_rank, len(data), epoch, SHUFFLE_BASE_SEED)
        for b in range(len(picks) // bs):
            for group in opt.param_groups:
                group["lr"] = job.lr(steps * world, planned)
            x, y = data.batch(picks[b * bs : (b + 1) * bs])
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = job.loss_fn(model, (x, y))
            loss.backward()  # type: ignore[no-untyped-call]
            if job.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), job.max_grad_norm)
            opt.step()
            float(loss.item())  # ranks report every loss; so does the reference
            samples += bs
            steps += 1
    return samples, steps


def _evaluate(job: Job, model: nn.Module) -> float | None:
    if job.eval_fn is None or job.eval_data is None:
        return None
    model.eval()
    try:
        return float(job.eval_fn(model, job.eval_data()))
    finally:
        model.train()


def plain_loop(job: Job, device: str = "cpu", epochs: int | None = None) -> BaselineResult:
    dev = torch.device(device)
    model = job.build_model().to(dev)
    opt = job.build_optimizer(model)
    job.train_data()  # build (and cache) the data before the clock starts, as ranks do
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    samples, steps = _train_epochs(job, model, opt, dev, epochs or job.num_epochs)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    return BaselineResult("plain", wall, samples, steps, _evaluate(job, model))


def _ddp_rank(
    rank: int, world: int, job_ref: str, store_path: str, epochs: int, cuda: bool, out: str
) -> None:
    job = load_job(job_ref)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # ranks share the cores, as the bus's ranks do
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world)
    try:
        model = job.build_model().to(device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
        opt = job.build_optimizer(ddp)
        job.train_data()
        dist.barrier()
        t0 = time.perf_counter()
        samples, steps = _train_epochs(job, ddp, opt, device, epochs, (rank, world))
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        wall = time.perf_counter() - t0
        metric = _evaluate(job, model) if rank == 0 else None
        if rank == 0:
            torch.save(
                {"wall": wall, "samples": samples * world, "steps": steps, "metric": metric}, out
            )
    finally:
        dist.destroy_process_group()


def ddp_loop(job_ref: str, world: int, cuda: bool, epochs: int | None = None) -> BaselineResult:
    job = load_job(job_ref)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
            _ddp_rank,
            args=(world, job_ref, os.path.join(tmp, "store"), epochs or job.num_epochs, cuda, out),
            nprocs=world,
            join=True,
        )
        r = torch.load(out)
    # DDP all-reduces gradients once per step on every rank
    return BaselineResult(
        f"ddp x{world}", r["wall"], r["samples"], r["steps"], r["metric"], collectives=r["steps"]
    )
