"""Jobs the end-to-end tests train, next to the bundled digits example.

Imported by rank processes as ``tests.e2e.jobs:NAME`` (the tests run them from the
repository root, which ``python -m`` puts on the path).
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from flodl_bus.examples import digits
from flodl_bus.job import ArrayDataset, Job, classification_loss

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
