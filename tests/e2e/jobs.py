"""Jobs the end-to-end tests train, next to the bundled digits example.

Imported by rank processes as ``tests.e2e.jobs:NAME`` (the tests run them from the
repository root, which ``python -m`` puts on the path).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn

from flodl_bus.examples import digits
from flodl_bus.job import (
    ArrayDataset,
    Job,
    classification_loss,
    request_checkpoint,
    request_eval,
)
from flodl_bus.protocol.messages import EpochMetrics

#: Seconds each training step sleeps in ``slow_job``.
STEP_SLEEP = 0.03


def _slow_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # A slow step stretches the run so a test can act mid-run (kill a rank, stop a
    # run after a checkpoint) without racing the last epoch.
    time.sleep(STEP_SLEEP)
    return classification_loss(model, batch)


slow_job = dataclasses.replace(digits.job, name="digits-mlp-slow", loss_fn=_slow_loss)


def _other_train() -> ArrayDataset:
    data = digits.train_data()
    # Drop one sample: same shapes per sample, a different dataset (a worker that
    # loaded another copy of the data files).
    return ArrayDataset(data.x[1:], data.y[1:])


other_data_job: Job = dataclasses.replace(
    digits.job, name="digits-mlp-other-data", train_data=_other_train
)


def _wider_model() -> nn.Module:
    # Same data, same layers, another hidden width: a worker running other code.
    return nn.Sequential(nn.Linear(64, 65), nn.ReLU(), nn.Linear(65, 10))


other_model_job: Job = dataclasses.replace(
    digits.job, name="digits-mlp-other-model", build_model=_wider_model
)


def _process_rank() -> int | None:
    """This worker process's ``--rank`` (the tests start ranked workers)."""
    argv = sys.argv
    return int(argv[argv.index("--rank") + 1]) if "--rank" in argv else None


#: Batches rank 1 trains before its job fails (sleeping like ``slow_job``, so the fault
#: lands mid-run after the first averaging rounds).
FAIL_AFTER = 40
_calls = [0]


def _rank1_raises(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    _calls[0] += 1
    if _process_rank() == 1 and _calls[0] > FAIL_AFTER:
        raise ValueError("labels out of range in batch")
    return _slow_loss(model, batch)


def _rank1_nan(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    _calls[0] += 1
    loss = _slow_loss(model, batch)
    if _process_rank() == 1 and _calls[0] > FAIL_AFTER and _calls[0] % 3 == 0:
        return loss * float("nan")
    return loss


def _rank1_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    if _process_rank() == 1:
        raise RuntimeError("no optimizer for this device")
    return digits.job.build_optimizer(model)


#: rank 1's loss_fn raises mid-run
loss_raises_job = dataclasses.replace(slow_job, name="loss-raises", loss_fn=_rank1_raises)
#: rank 1's loss turns NaN every third batch mid-run; the run stops (the default)
nan_stop_job = dataclasses.replace(slow_job, name="nan-stop", loss_fn=_rank1_nan)
#: the same, skipping those batches
nan_skip_job = dataclasses.replace(
    slow_job, name="nan-skip", loss_fn=_rank1_nan, on_nonfinite_loss="skip"
)
#: Folder where ``every_fifth_nan_job`` notes each NaN loss it returned, a file per process.
NAN_DIR_ENV = "FLODL_TEST_NAN_DIR"


def _every_fifth_nan(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    _calls[0] += 1
    loss = classification_loss(model, batch)
    if _calls[0] % 5 != 0:
        return loss
    # The ground truth a test counts against what the run reports it skipped.
    with open(os.path.join(os.environ[NAN_DIR_ENV], f"{os.getpid()}.nan"), "a") as f:
        f.write("nan\n")
    return loss * float("nan")


#: every rank's every fifth batch has a NaN loss, skipped; unslowed, so a short run
every_fifth_nan_job = dataclasses.replace(
    digits.job, name="digits-nan-fifth", loss_fn=_every_fifth_nan, on_nonfinite_loss="skip"
)
#: Seconds each of rank 1's steps sleeps in ``rank1_slowed_job`` (rank 0 is not slowed).
RANK1_STEP_SLEEP = 0.03


def _rank1_sleeps(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # A sleep, not busy work: the slow rank must not take the fast one's core on a
    # loaded host (a CPU-bound slowdown slows both ranks there).
    if _process_rank() == 1:
        time.sleep(RANK1_STEP_SLEEP)
    return classification_loss(model, batch)


#: rank 1 several times slower than rank 0 at every step (heterogeneous ranks)
rank1_slowed_job = dataclasses.replace(
    digits.job, name="digits-rank1-slowed", loss_fn=_rank1_sleeps
)
#: rank 1 cannot build its optimizer
builder_raises_job = dataclasses.replace(
    slow_job, name="builder-raises", build_optimizer=_rank1_optimizer
)


# ------------------------------------------------------------------- job hooks

#: Folder where ``hooks_job`` writes what its hooks saw, one JSON line per call.
HOOKS_DIR_ENV = "FLODL_TEST_HOOKS_DIR"


def _hook_line(kind: str, **fields: object) -> None:
    folder = os.environ[HOOKS_DIR_ENV]
    line = json.dumps({"kind": kind, "rank": _process_rank(), **fields})
    with open(os.path.join(folder, f"rank{_process_rank()}.jsonl"), "a") as f:
        f.write(line + "\n")


def _requesting_epoch_fn(epoch: int, _model: nn.Module) -> None:
    # The role rank asks for one checkpoint and one eval mid-run (neither is scheduled
    # by a flag): the first as epoch 1 starts, the second as epoch 2 starts.
    if epoch in (1, 2):
        (request_checkpoint if epoch == 1 else request_eval)()
        _hook_line("requested", what="checkpoint" if epoch == 1 else "eval")


def _metrics_hook(m: EpochMetrics) -> None:
    _hook_line("metrics", epoch=m.epoch, avg_loss=m.avg_loss)


def _eval_hook(epoch: int, metric: float) -> None:
    _hook_line("eval", epoch=epoch, metric=metric)


def _checkpoint_hook(version: int, model: nn.Module) -> None:
    total = float(sum(p.detach().double().sum() for p in model.parameters()))
    _hook_line("checkpoint", version=version, param_sum=total)


#: every hook set: each call is one line under ``$FLODL_TEST_HOOKS_DIR``
hooks_job = dataclasses.replace(
    slow_job,
    name="digits-hooks",
    epoch_fn=_requesting_epoch_fn,
    metrics_fn=_metrics_hook,
    eval_result_fn=_eval_hook,
    checkpoint_fn=_checkpoint_hook,
)


def _neg_loss(model: nn.Module, data: ArrayDataset) -> float:
    # A continuous metric: two models that differ score differently (accuracy on a small
    # held-out set often ties).
    with torch.no_grad():
        return -float(nn.functional.cross_entropy(model(data.x), data.y, reduction="sum"))


#: scored by its negated summed held-out loss
neg_loss_job = dataclasses.replace(slow_job, name="digits-neg-loss", eval_fn=_neg_loss)


def _model_beside_a_default_group() -> nn.Module:
    # What a torchrun user's code does: the default group from the launcher's
    # MASTER_ADDR/MASTER_PORT, RANK and WORLD_SIZE, then a collective of its own.
    import torch.distributed as dist

    dist.init_process_group("gloo")
    seen = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(seen)
    world = dist.get_world_size()
    if float(seen) != world * (world + 1) / 2:
        raise RuntimeError(f"the job's all_reduce gave {float(seen)} on {world} ranks")
    return digits.build_model()


#: builds its model beside a torch.distributed default group of its own (`--user-group
#: false`: else the bus made one already)
default_group_job = dataclasses.replace(
    digits.job, name="digits-default-group", build_model=_model_beside_a_default_group
)


# ------------------------------------------------------- the bus's default group

#: Folder where ``user_group_job`` writes each collective it ran on the default group.
GROUP_DIR_ENV = "FLODL_TEST_GROUP_DIR"


def _sum_of_ranks(where: str, wait: bool = True) -> None:
    # Every rank adds its group rank + 1: on a world of W the sum is W(W+1)/2, so a
    # wrong world or a rank counted twice shows in the number. ``wait=False`` posts the
    # collective and writes its line at a later step, once it completed.
    import torch.distributed as dist

    from flodl_bus.job import process_group

    info = process_group()
    seen = torch.ones(1) * (dist.get_rank() + 1)
    line: dict[str, Any] = {
        "where": where,
        "bus_rank": int(os.environ["RANK"]),
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "sum": None,
        "generation": None if info is None else info.generation,
        "info_world": None if info is None else info.world_size,
    }
    work = dist.all_reduce(seen, async_op=not wait)
    _posted.append((work, seen, line))
    _write_completed()


#: collectives posted and not yet written: (work or None, tensor, line)
_posted: list[tuple[Any, torch.Tensor, dict[str, Any]]] = []


def _write_completed() -> None:
    while _posted and (_posted[0][0] is None or _posted[0][0].is_completed()):
        work, seen, line = _posted.pop(0)
        if work is not None:
            work.wait()
        line["sum"] = float(seen)
        path = os.path.join(os.environ[GROUP_DIR_ENV], f"rank{os.environ['RANK']}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _model_on_the_default_group() -> nn.Module:
    # The group the bus set up is there before the job's first line runs.
    _sum_of_ranks("build_model")
    return digits.build_model()


_generation_seen = [0]


def _loss_after_a_reform(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    from flodl_bus.job import process_group

    # One collective per new generation of the group, posted at the next step of each
    # survivor: the re-formed group must work over the survivors alone. Posted, not
    # waited for: a survivor may see the new generation a window before its peer does
    # (the re-form reaches each rank's group on its own time), and one blocked in the
    # collective would never report the batch its peer's next plan waits for.
    info = process_group()
    if info is not None and info.generation != _generation_seen[0]:
        _generation_seen[0] = info.generation
        _sum_of_ranks("after_reform", wait=False)
    _write_completed()
    return _slow_loss(model, batch)


#: uses the default group the bus set up: at build_model, and once after each re-form
user_group_job = dataclasses.replace(
    slow_job,
    name="digits-user-group",
    build_model=_model_on_the_default_group,
    loss_fn=_loss_after_a_reform,
)
