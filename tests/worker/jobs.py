"""Jobs for rank processes started by the tests (loaded by name: ``tests.worker.jobs:...``)."""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from torch import nn
from torch.utils.data import Dataset

from flodl_bus.examples import digits

#: where ``dataset_job``'s build_model writes what the rank process looked like
SEEN_PATH = "FLODL_TEST_SEEN"


class DigitRows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The digits as a map-style torch Dataset (one sample per ``__getitem__``)."""

    def __init__(self) -> None:
        data = digits.train_data()
        self.x, self.y = data.x, data.y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _seen_model() -> nn.Module:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    seen = {name: os.environ.get(name) for name in names}
    seen["threads"] = str(torch.get_num_threads())
    with open(os.environ[SEEN_PATH], "w") as f:
        json.dump(seen, f)
    return digits.job.build_model()


dataset_job = dataclasses.replace(
    digits.job, name="digits-rows", train_data=DigitRows, build_model=_seen_model
)
