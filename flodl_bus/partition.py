"""The shared shuffle (reference §4.10.1): ranks and coordinator must agree exactly.

An epoch's picks come from a permutation of the pick space keyed by ``seed + pass``
(``pass = epoch // splits``); the pass is cut into ``splits`` contiguous balanced spans
and epoch ``e`` owns span ``e % splits``. A plan ``(offset, size)`` is a slice of that
span. The coordinator hands out offsets; each rank expands them here.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import numpy.typing as npt

SHUFFLE_BASE_SEED = 42


@lru_cache(maxsize=8)
def _permutation(pick_space: int, key: int) -> npt.NDArray[np.int64]:
    # PCG64 through numpy's Generator is stable for a given seed; the array is cached
    # (an epoch's chunks expand from the same permutation) and frozen so no caller can
    # corrupt the cache.
    perm = np.random.Generator(np.random.PCG64(key)).permutation(pick_space).astype(np.int64)
    perm.flags.writeable = False
    return perm


def split_bounds(pick_space: int, splits: int, split: int) -> tuple[int, int]:
    """``[start, end)`` of ``split`` when a pass is cut into ``splits`` balanced spans."""
    if splits < 1:
        raise ValueError("epoch_splits must be at least 1")
    base, extra = divmod(pick_space, splits)
    start = split * base + min(split, extra)
    return start, start + base + (1 if split < extra else 0)


def epoch_span(
    pick_space: int, epoch: int, seed: int = SHUFFLE_BASE_SEED, splits: int = 1
) -> npt.NDArray[np.int64]:
    """Every pick of ``epoch`` in shuffled order."""
    if splits < 1:  # before divmod, which would raise ZeroDivisionError for 0
        raise ValueError("epoch_splits must be at least 1")
    pass_, split = divmod(epoch, splits)
    start, end = split_bounds(pick_space, splits, split)
    return _permutation(pick_space, seed + pass_)[start:end]


def make_partition(
    offset: int,
    size: int,
    pick_space: int,
    epoch: int,
    seed: int = SHUFFLE_BASE_SEED,
    splits: int = 1,
) -> list[int]:
    """The picks of plan ``(offset, size)`` in ``epoch`` (clamped to the epoch's span)."""
    span = epoch_span(pick_space, epoch, seed, splits)
    # tolist: the same Python ints, made in C (a per-element int() was most of a rank
    # replay's plan events)
    return span[offset : offset + size].tolist()  # type: ignore[no-any-return]
