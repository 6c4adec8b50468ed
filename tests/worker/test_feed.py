"""The batch feed: every way of making batches gives the synchronous gather's batches, bit
for bit and in order (CPU here; the CUDA paths are guarded by the device type)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from flodl_bus.examples import digits
from flodl_bus.job import ArrayDataset
from flodl_bus.partition import make_partition
from flodl_bus.worker.feed import (
    ArrayFeed,
    FeedOptions,
    LoaderFeed,
    make_feed,
)

CPU = torch.device("cpu")
BS = 32


class Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A map-style Dataset over the digits arrays: one sample per ``__getitem__``."""

    def __init__(self, data: ArrayDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.x[i], self.data.y[i]


class Plan:
    """A growing partition, as ``WorkerControl`` holds it (ExtendPartition appends)."""

    def __init__(self, picks: list[int]) -> None:
        self.picks = picks

    def __call__(self, index: int) -> list[int] | None:
        if index >= len(self.picks) // BS:
            return None
        return self.picks[index * BS : (index + 1) * BS]


def walk(feed: object, data: ArrayDataset) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two plans; the first grows after its loader/prefetch reached its end; the second
    starts while a batch of the first is still made ahead."""
    space = len(data)
    got: list[tuple[torch.Tensor, torch.Tensor]] = []
    first = Plan(make_partition(0, 4 * BS + 7, space, 0))
    feed.begin(first)  # type: ignore[attr-defined]
    for i in range(4):
        got.append(feed.get(i))  # type: ignore[attr-defined]
    first.picks += make_partition(4 * BS + 7, 2 * BS, space, 0)
    for i in range(4, len(first.picks) // BS):
        got.append(feed.get(i))  # type: ignore[attr-defined]
    second = Plan(make_partition(100, 3 * BS, space, 1) + [space + 5] * BS)  # picks wrap
    feed.begin(second)  # type: ignore[attr-defined]
    got.append(feed.get(0))  # type: ignore[attr-defined]
    feed.begin(Plan(make_partition(0, 2 * BS, space, 2)))  # dropped mid-plan
    got.append(feed.get(1))  # type: ignore[attr-defined]
    feed.close()  # type: ignore[attr-defined]
    return got


def expected(data: ArrayDataset) -> list[tuple[torch.Tensor, torch.Tensor]]:
    space = len(data)
    first = make_partition(0, 4 * BS + 7, space, 0) + make_partition(4 * BS + 7, 2 * BS, space, 0)
    second = make_partition(0, 2 * BS, space, 2)
    picks = [first[i * BS : (i + 1) * BS] for i in range(len(first) // BS)]
    picks += [make_partition(100, 3 * BS, space, 1)[:BS], second[BS : 2 * BS]]
    return [data.batch(p) for p in picks]


def same(
    a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]
) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x1, x2) and torch.equal(y1, y2) and x1.dtype == x2.dtype
        for (x1, y1), (x2, y2) in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("prefetch", [True, False])
def test_an_array_feed_gives_the_gather_of_each_batch_in_order(prefetch: bool) -> None:
    data = digits.train_data()
    feed = ArrayFeed(data, CPU, prefetch=prefetch)
    assert same(walk(feed, data), expected(data))


def test_the_prefetch_serves_the_next_batch_from_the_background_gather() -> None:
    data = digits.train_data()
    feed = ArrayFeed(data, CPU, prefetch=True)
    plan = Plan(make_partition(0, 6 * BS, len(data), 0))
    feed.begin(plan)
    for i in range(6):
        feed.get(i)
    feed.close()
    # The first batch is made on the spot; every later one was made ahead.
    assert (feed.misses, feed.hits) == (1, 5)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_map_style_dataset_gives_the_same_batches_through_a_data_loader(workers: int) -> None:
    data = digits.train_data()
    feed = LoaderFeed(Rows(data), CPU, workers=workers)
    assert same(walk(feed, data), expected(data))
    # One start per plan; with workers the loader reads the picks ahead, past the first
    # plan's end before it grew, so it starts once more there.
    assert feed.starts == (3 if workers == 0 else 4)


def test_the_loaders_workers_come_from_a_forkserver_never_a_fork_of_the_threaded_rank() -> None:
    # A fork of the rank copies locks its bus and param-plane threads may hold.
    feed = LoaderFeed(Rows(digits.train_data()), CPU, workers=2)
    assert feed.loader is not None
    assert feed.loader.multiprocessing_context.get_start_method() == "forkserver"
    feed.close()


def test_the_loader_draws_nothing_from_the_global_rng() -> None:
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    data = digits.train_data()
    feed = LoaderFeed(Rows(data), CPU, workers=2, seed=9)
    feed.begin(Plan(make_partition(0, 2 * BS, len(data), 0)))
    feed.get(0)
    feed.close()
    assert torch.equal(torch.rand(4), want)


def test_make_feed_picks_the_path_by_the_data() -> None:
    data = digits.train_data()
    feed = make_feed(data, CPU, FeedOptions())
    assert isinstance(feed, ArrayFeed)
    loader = make_feed(Rows(data), CPU, FeedOptions(workers=0))
    assert isinstance(loader, LoaderFeed)


def test_an_array_dataset_is_gathered_on_the_training_thread_on_the_cpu_unless_asked() -> None:
    # A thread per step costs a CPU rank more than the gather it hands over (issue 27).
    data = digits.train_data()
    auto = make_feed(data, CPU, FeedOptions())
    forced = make_feed(data, CPU, FeedOptions(prefetch="1"))
    assert isinstance(auto, ArrayFeed) and isinstance(forced, ArrayFeed)
    assert auto._pool is None and forced._pool is not None
    assert FeedOptions().prefetches(torch.device("cuda", 0))
    assert not FeedOptions(prefetch="0").prefetches(torch.device("cuda", 0))
    auto.close()
    forced.close()


def test_feed_options_come_from_the_environment_and_bad_values_name_the_fix() -> None:
    assert FeedOptions.from_env({}) == FeedOptions("auto", "auto", 2)
    env = {"FLODL_PREFETCH": "0", "FLODL_DATA_ON_DEVICE": "1", "FLODL_DATA_WORKERS": "4"}
    assert FeedOptions.from_env(env) == FeedOptions("0", "1", 4)
    for key, bad, hint in (
        ("FLODL_PREFETCH", "yes", "use auto (on for a GPU), 1 (on) or 0 (off)"),
        ("FLODL_DATA_ON_DEVICE", "gpu", "use auto, 1 or 0"),
        ("FLODL_DATA_WORKERS", "-1", "0 or more"),
    ):
        with pytest.raises(ValueError, match=key) as err:
            FeedOptions.from_env({key: bad})
        assert hint in str(err.value)
