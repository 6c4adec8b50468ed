"""Feeding the training thread: the batches of the running plan, made ahead of use.

The loop asks for batch ``i`` by its picks and names the picks of batch ``i + 1`` when it
knows them (a full batch's picks never change: ExtendPartition only appends), so the next
batch is made while this one trains. What "made" means depends on the data and device:

* an ``ArrayDataset`` on a GPU that has room for it (``data_on_device``): the tensors move
  to the device once; a batch is a gather there, with no host copy at all;
* an ``ArrayDataset`` otherwise: one background thread gathers the next batch; for a GPU
  into pinned memory, copied on a side stream the training stream then waits for;
* any other map-style ``torch.utils.data.Dataset``: a ``DataLoader`` whose batch sampler
  walks the plan's picks (its worker processes load ahead; pinned memory for a GPU).

Every path gives the batches of the synchronous gather, bit for bit and in the same
order; only when they are made differs. Settings (``FeedOptions.from_env``):
``FLODL_PREFETCH`` (auto, 1, 0: the background gather of an ``ArrayDataset``; auto is on
for a GPU, off for the CPU), ``FLODL_DATA_ON_DEVICE`` (auto, 1, 0),
``FLODL_DATA_WORKERS`` (DataLoader workers of a map-style Dataset).

Why not prefetch on the CPU: there the gather is a few microseconds of indexing that the
intra-op threads already spread over the cores, while handing it to a thread costs a
wake-up and a GIL hand-over every step, and the thread wants a core the intra-op threads
are using (issue 27: 0.20 s of data wait against the plain loop's 0.04 s on 15 threads).
On a GPU the gather overlaps the device's work and the copy runs on a side stream.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import torch
from torch.utils.data import DataLoader, Dataset

from flodl_bus.job import ArrayDataset, MapDataset, TrainData

#: An ``ArrayDataset`` moves to the GPU (``data_on_device="auto"``) when it takes at most
#: this share of the device's free memory: the model, activations and the optimizer need
#: the rest.
ON_DEVICE_SHARE = 0.25

OnDevice = Literal["auto", "1", "0"]
Prefetch = Literal["auto", "1", "0"]
Picks = Sequence[int]


@dataclass(frozen=True)
class FeedOptions:
    #: make the next batch off the training thread: "auto" on a GPU only (see above)
    prefetch: Prefetch = "auto"
    #: keep an ``ArrayDataset`` on the GPU: "auto" when it fits (``ON_DEVICE_SHARE``)
    data_on_device: OnDevice = "auto"
    #: DataLoader worker processes of a map-style Dataset (0: load on the training thread)
    workers: int = 2

    def __post_init__(self) -> None:
        if self.prefetch not in ("auto", "1", "0"):
            raise ValueError(f"prefetch must be auto, 1 or 0, got {self.prefetch!r}")
        if self.data_on_device not in ("auto", "1", "0"):
            raise ValueError(f"data_on_device must be auto, 1 or 0, got {self.data_on_device!r}")
        if self.workers < 0:
            raise ValueError(f"workers must be 0 or more, got {self.workers}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FeedOptions:
        """``FLODL_PREFETCH``, ``FLODL_DATA_ON_DEVICE``, ``FLODL_DATA_WORKERS``."""
        env = os.environ if env is None else env
        prefetch = env.get("FLODL_PREFETCH", "auto").strip().lower()
        on_device = env.get("FLODL_DATA_ON_DEVICE", "auto").strip().lower()
        workers = env.get("FLODL_DATA_WORKERS", "2").strip()
        if prefetch not in ("auto", "0", "1"):
            raise ValueError(
                f"FLODL_PREFETCH={prefetch!r}: use auto (on for a GPU), 1 (on) or 0 (off)"
            )
        if on_device not in ("auto", "1", "0"):
            raise ValueError(f"FLODL_DATA_ON_DEVICE={on_device!r}: use auto, 1 or 0")
        if not workers.isdigit():
            raise ValueError(f"FLODL_DATA_WORKERS={workers!r}: use a count of processes, 0 or more")
        return cls(prefetch, on_device, int(workers))  # type: ignore[arg-type]

    def prefetches(self, device: torch.device) -> bool:
        """Whether an ``ArrayDataset`` is gathered ahead by a background thread."""
        if self.prefetch == "auto":
            return device.type == "cuda"
        return self.prefetch == "1"


#: The picks of batch ``j`` of the running plan, None past its (current) end. Called on
#: the training thread only: it reads the control core.
PicksOf = Callable[[int], Picks | None]


class Feed(Protocol):
    """Where the loop gets batch after batch of one plan."""

    def begin(self, picks_of: PicksOf) -> None:
        """A new plan starts: anything made ahead for the previous one is dropped."""
        ...

    def get(self, index: int) -> Any:
        """Batch ``index`` of the plan, on the device (batches after it may be made now,
        off the training thread)."""
        ...

    def close(self) -> None: ...


def make_feed(
    data: TrainData,
    device: torch.device,
    options: FeedOptions,
    *,
    seed: int = 0,
) -> Feed:
    if isinstance(data, ArrayDataset):
        if device.type == "cuda" and _wants_device(data, device, options.data_on_device):
            return DeviceArrayFeed(data, device)
        return ArrayFeed(data, device, prefetch=options.prefetches(device))
    return LoaderFeed(data, device, workers=options.workers, seed=seed)


def _wants_device(data: ArrayDataset, device: torch.device, choice: OnDevice) -> bool:
    if choice != "auto":
        return choice == "1"
    size = data.x.nelement() * data.x.element_size() + data.y.nelement() * data.y.element_size()
    free, _total = torch.cuda.mem_get_info(device)
    return size <= ON_DEVICE_SHARE * free


def _index(picks: Picks, n: int, device: torch.device | None = None) -> torch.Tensor:
    # A pick beyond the dataset wraps (augmentation passes reuse samples), as in
    # ``ArrayDataset.batch``.
    return torch.as_tensor(picks, dtype=torch.long, device=device) % n


def _no_picks(index: int) -> Picks | None:
    return None


class DeviceArrayFeed:
    """The whole dataset on the GPU: a batch is a gather on the training stream."""

    def __init__(self, data: ArrayDataset, device: torch.device) -> None:
        self.x = data.x.to(device)
        self.y = data.y.to(device)
        self.device = device
        self.n = len(data)
        self._picks_of: PicksOf = _no_picks

    def begin(self, picks_of: PicksOf) -> None:
        self._picks_of = picks_of

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        picks = self._picks_of(index)
        assert picks is not None, f"batch {index} is past the plan"
        idx = _index(picks, self.n).to(self.device, non_blocking=True)
        return self.x[idx], self.y[idx]

    def close(self) -> None:
        return None


class ArrayFeed:
    """An in-memory dataset gathered on the host, the next batch by a background thread
    (into pinned memory, copied on a side stream, for a GPU)."""

    def __init__(self, data: ArrayDataset, device: torch.device, *, prefetch: bool) -> None:
        self.data = data
        self.device = device
        self.cuda = device.type == "cuda"
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flodl-feed") if prefetch else None
        self._ahead: tuple[tuple[int, ...], Future[_Made]] | None = None
        self._stream: Any = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self._picks_of: PicksOf = _no_picks
        #: batches served from the background gather vs made on the training thread
        self.hits = 0
        self.misses = 0

    def begin(self, picks_of: PicksOf) -> None:
        self._drop()
        self._picks_of = picks_of

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        picks = self._picks_of(index)
        assert picks is not None, f"batch {index} is past the plan"
        key = tuple(picks)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == key:
            (x, y), done = ahead[1].result()
            self.hits += 1
        else:
            if ahead is not None:
                ahead[1].result()  # never leave a gather running on buffers we drop
            (x, y), done = self._make(key) if self._pool is not None else self._plain(key)
            self.misses += 1
        nxt = self._picks_of(index + 1) if self._pool is not None else None
        if nxt is not None:
            assert self._pool is not None
            key_next = tuple(nxt)
            self._ahead = (key_next, self._pool.submit(self._make, key_next))
        if done is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)
            # Made on the side stream, used on this one: the allocator must not reuse
            # the memory before this stream is done with it.
            x.record_stream(stream)
            y.record_stream(stream)
        return x, y

    def _make(self, picks: tuple[int, ...]) -> _Made:
        idx = _index(picks, len(self.data))
        x, y = self.data.x[idx], self.data.y[idx]
        if not self.cuda:
            return (x, y), None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            x = x.pin_memory().to(self.device, non_blocking=True)
            y = y.pin_memory().to(self.device, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)
        return (x, y), done

    def _plain(self, picks: tuple[int, ...]) -> _Made:
        # Without prefetch: the gather and copy the loop always did, on its thread.
        x, y = self.data.batch(picks)
        if self.cuda:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return (x, y), None

    def _drop(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].result()

    def close(self) -> None:
        self._drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


#: a batch and the CUDA event its copy recorded (None: ready as it is)
_Made = tuple[tuple[torch.Tensor, torch.Tensor], Any]


class _PlanSampler:
    """The DataLoader's batch sampler: the plan's picks from a start index, pulled lazily
    (by the loader's iterator, on the training thread) so it follows a growing plan."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.picks_of: PicksOf = _no_picks
        self.start = 0

    def __iter__(self) -> Iterator[list[int]]:
        j, picks_of, n = self.start, self.picks_of, self.n
        while (picks := picks_of(j)) is not None:
            # A pick beyond the dataset wraps, as in ``ArrayDataset.batch``.
            yield [p % n for p in picks]
            j += 1


class LoaderFeed:
    """A map-style ``Dataset`` loaded by a ``DataLoader``: its worker processes make the
    batches ahead (pinned for a GPU); the sampler yields the plan's picks in order."""

    def __init__(
        self, data: MapDataset, device: torch.device, *, workers: int, seed: int = 0
    ) -> None:
        self.device = device
        self.sampler = _PlanSampler(len(data))
        self.loader: DataLoader[Any] | None = DataLoader(
            cast(Dataset[Any], data),
            batch_sampler=self.sampler,  # type: ignore[arg-type]
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=workers > 0,
            prefetch_factor=2 if workers > 0 else None,
            # Not fork: the rank already runs its bus reader, heartbeat and param-plane
            # threads, and a forked child can inherit one of their locks held forever.
            multiprocessing_context="forkserver" if workers > 0 else None,
            # Its own generator: the workers' seeds must not draw from the global RNG,
            # which the model's training (dropout) reads.
            generator=torch.Generator().manual_seed(seed),
        )
        self._it: Iterator[Any] | None = None
        self._next = 0
        #: times the loader was (re)started: once per plan, again if a plan grew after
        #: the loader had reached its end
        self.starts = 0

    def begin(self, picks_of: PicksOf) -> None:
        self.sampler.picks_of = picks_of
        self._it = None

    def _start(self, index: int) -> Iterator[Any]:
        assert self.loader is not None, "the feed is closed"
        self.sampler.start = index
        self.starts += 1
        self._it = iter(self.loader)
        return self._it

    def get(self, index: int) -> Any:
        it = self._it if self._it is not None and self._next == index else self._start(index)
        try:
            batch = next(it)
        except StopIteration:
            # The loader had walked to the plan's end before ExtendPartition grew it.
            batch = next(self._start(index))
        self._next = index + 1
        return _to_device(batch, self.device)

    def close(self) -> None:
        # Dropping the iterator stops the persistent workers.
        self._it = None
        self.loader = None


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch
