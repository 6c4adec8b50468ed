"""Device selection of a rank: where its model and batches live."""

from __future__ import annotations

import pytest
import torch

from flodl_bus.worker.cli import ConfigError, _resolve_device


def test_auto_picks_cpu_without_cuda_and_a_gpu_per_rank_with_it() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expected = f"cuda:{3 % count}" if count else "cpu"
    assert _resolve_device("auto", 3) == expected


def test_cpu_is_always_available() -> None:
    assert _resolve_device("cpu", 0) == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_asking_for_a_gpu_on_a_host_without_one_names_the_fix() -> None:
    with pytest.raises(ConfigError, match="use --device cpu"):
        _resolve_device("cuda", 0)


def test_an_unknown_device_names_the_accepted_ones() -> None:
    with pytest.raises(ConfigError, match="cpu, cuda, cuda:N or auto"):
        _resolve_device("tpu-ish", 0)
