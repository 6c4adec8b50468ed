"""A small ResNet on synthetic CIFAR-shaped data (3x32x32, 10 classes): the GPU example.

The data is generated, not downloaded: each class has a fixed random "prototype" image
and samples are noisy, shifted copies of it, so the task is learnable (accuracy is a real
signal) while needing no files. Sizes are chosen so a GPU step is dominated by compute.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from flodl_bus.job import ArrayDataset, Job

CLASSES = 10
TRAIN, TEST = 20_000, 2_000


@lru_cache(maxsize=1)
def _data() -> tuple[ArrayDataset, ArrayDataset]:
    g = torch.Generator().manual_seed(7)
    prototypes = torch.randn(CLASSES, 3, 32, 32, generator=g)

    def sample(n: int) -> ArrayDataset:
        y = torch.randint(0, CLASSES, (n,), generator=g)
        shifts = torch.randint(-3, 4, (n, 2), generator=g)
        x = prototypes[y] * 0.5 + torch.randn(n, 3, 32, 32, generator=g)
        for i in range(n):  # a random translation, so it is not a lookup table
            x[i] = torch.roll(x[i], shifts=(int(shifts[i, 0]), int(shifts[i, 1])), dims=(1, 2))
        return ArrayDataset(x.contiguous(), y)

    return sample(TRAIN), sample(TEST)


def train_data() -> ArrayDataset:
    return _data()[0]


def eval_data() -> ArrayDataset:
    return _data()[1]


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


def make_model(widths: tuple[int, int, int] = (64, 128, 256)) -> nn.Module:
    """Three stages of two blocks each, ``widths`` channels (the same seed every call)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [
        nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
        nn.BatchNorm2d(widths[0]),
        nn.ReLU(),
    ]
    cin = widths[0]
    for i, w in enumerate(widths):
        layers += [_Block(cin, w, 1 if i == 0 else 2), _Block(w, w, 1)]
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, CLASSES)]
    return nn.Sequential(*layers)


def build_model() -> nn.Module:
    return make_model((64, 128, 256))


_EPOCHS, _BATCH, _PEAK_LR = 4, 256, 0.05


def _lr(step: int, planned_steps: int) -> float:
    """Linear decay to 5% of the peak over the run's global steps (batches of all ranks),
    however many epochs it runs: a BatchNorm net at a constant high LR scores erratically
    from one epoch to the next, which would drown the comparison between runs."""
    return _PEAK_LR * max(0.05, 1.0 - step / planned_steps)


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=_PEAK_LR, momentum=0.9, weight_decay=5e-4)


job = Job(
    name="cifar-resnet-synthetic",
    build_model=build_model,
    build_optimizer=build_optimizer,
    train_data=train_data,
    eval_data=eval_data,
    batch_size=_BATCH,
    num_epochs=_EPOCHS,
    lr_schedule=_lr,
    target_metric=0.8,
)
