"""The batch feed's CUDA paths (pinned staging and a side-stream copy, the dataset on the
GPU, a DataLoader pinning for the GPU) give the plain gather's batches, bit for bit and in
order. Skipped on a host without CUDA."""

from __future__ import annotations

import pytest
import torch

from flodl_bus.examples import digits
from flodl_bus.job import ArrayDataset
from flodl_bus.worker.feed import (
    ArrayFeed,
    DeviceArrayFeed,
    FeedOptions,
    LoaderFeed,
    make_feed,
)
from tests.worker.test_feed import Rows, expected, walk

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _on_host(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
    torch.cuda.synchronize()
    out = []
    for x, y in batches:
        assert x.device.type == "cuda" and y.device.type == "cuda"
        out.append((x.cpu(), y.cpu()))
    return out


def _same(
    got: list[tuple[torch.Tensor, ...]], want: list[tuple[torch.Tensor, torch.Tensor]]
) -> bool:
    return len(got) == len(want) and all(
        torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("prefetch", [True, False])
def test_an_array_feed_on_a_gpu_gives_the_gather_of_each_batch(prefetch: bool) -> None:
    data = digits.train_data()
    feed = ArrayFeed(data, torch.device("cuda", 0), prefetch=prefetch)
    assert _same(_on_host(walk(feed, data)), expected(data))


def test_a_dataset_kept_on_the_gpu_gives_the_same_batches() -> None:
    data = digits.train_data()
    assert _same(
        _on_host(walk(DeviceArrayFeed(data, torch.device("cuda", 0)), data)), expected(data)
    )


def test_a_data_loader_pinning_for_the_gpu_gives_the_same_batches() -> None:
    data = digits.train_data()
    feed = LoaderFeed(Rows(data), torch.device("cuda", 0), workers=2)
    assert _same(_on_host(walk(feed, data)), expected(data))


def test_a_small_dataset_goes_on_the_gpu_unless_told_not_to() -> None:
    data: ArrayDataset = digits.train_data()
    cuda = torch.device("cuda", 0)
    assert isinstance(make_feed(data, cuda, FeedOptions()), DeviceArrayFeed)
    kept = make_feed(data, cuda, FeedOptions(data_on_device="0"))
    assert isinstance(kept, ArrayFeed)
    kept.close()
