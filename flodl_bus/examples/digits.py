"""Handwritten digits (scikit-learn's 8x8 set, shipped as data/digits.npz) with a small MLP.

The file holds ``load_digits()``'s images (0..16 per pixel) and labels as uint8, so the
example needs no scikit-learn at run time; ``scripts/make_digits.py`` rebuilds it.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from flodl_bus.job import ArrayDataset, Job

_TEST_FRACTION = 0.2
DATA = Path(__file__).parent / "data" / "digits.npz"


@lru_cache(maxsize=1)
def _split() -> tuple[ArrayDataset, ArrayDataset]:
    with np.load(DATA) as digits:
        x = np.asarray(digits["images"], dtype=np.float32) / 16.0
        y = np.asarray(digits["labels"], dtype=np.int64)
    order = np.random.default_rng(1234).permutation(len(x))
    n_test = int(len(x) * _TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return (
        ArrayDataset(torch.from_numpy(x[train]), torch.from_numpy(y[train])),
        ArrayDataset(torch.from_numpy(x[test]), torch.from_numpy(y[test])),
    )


def train_data() -> ArrayDataset:
    return _split()[0]


def eval_data() -> ArrayDataset:
    return _split()[1]


def build_model() -> nn.Module:
    torch.manual_seed(0)  # every rank starts from the same weights
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=3e-3)


job = Job(
    name="digits-mlp",
    build_model=build_model,
    build_optimizer=build_optimizer,
    train_data=train_data,
    eval_data=eval_data,
    batch_size=32,
    num_epochs=8,
    lr_at=lambda _step: 3e-3,
    target_metric=0.9,
)
