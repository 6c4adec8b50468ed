"""A wide ResNet (25M parameters) on the synthetic CIFAR-shaped data of ``cifar_resnet``.

The larger GPU example: the same data, blocks and schedule as ``cifar_resnet`` with three
times the channels (192, 384, 768): a step is about three times the small one's on an
H200 (44 ms for a batch of 256, one GPU), and the job's 36 epochs take about two minutes
on one H200, about one on two:

    flodl-bus bench train --job flodl_bus.examples.cifar_wide:job --workers 2 --ddp
"""

from __future__ import annotations

from torch import nn

from flodl_bus.examples.cifar_resnet import build_optimizer, eval_data, make_model, train_data
from flodl_bus.examples.cifar_resnet import job as small
from flodl_bus.job import Job

WIDTHS = (192, 384, 768)


def build_model() -> nn.Module:
    return make_model(WIDTHS)


job = Job(
    name="cifar-wide-resnet-synthetic",
    build_model=build_model,
    build_optimizer=build_optimizer,
    train_data=train_data,
    eval_data=eval_data,
    batch_size=small.batch_size,
    num_epochs=36,
    lr_schedule=small.lr_schedule,
    target_metric=0.8,
)
