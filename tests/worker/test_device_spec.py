"""A device's spec score (flodl's ``spec_prior``), and what a rank reports in its Hello.

This host has no GPU: the CUDA query is exercised through its CPU path only (no CUDA,
no such device: None); a GPU host checks it against the device's own properties."""

from __future__ import annotations

import pytest
import torch

from flodl_bus.worker.cli import _local_rank_before_join, _spec_candidates
from flodl_bus.worker.device_spec import cuda_spec_score, hello_spec_score, spec_score

GIB = 1 << 30


def test_the_score_is_compute_capability_first_then_memory_in_unrounded_gib() -> None:
    # An A100 80GB (sm_80, 81920 MiB) and an RTX 3090 (sm_86, 24576 MiB): flodl's
    # formula ranks the A100 *below* the 3090 (880 < 884), so it is the spec-slowest.
    a100 = spec_score(8, 0, 81920 * 2**20)
    rtx3090 = spec_score(8, 6, 24576 * 2**20)
    assert a100 == 880.0 and rtx3090 == 884.0
    assert a100 < rtx3090
    # the memory is not rounded to whole GiB: half a GiB counts as half a point
    assert spec_score(7, 5, 11 * GIB + GIB // 2) == 761.5
    assert spec_score(8, 6, 24 * GIB - 2**20) == pytest.approx(883.9990234375)
    # the generation dominates: a sm_75 card with 48 GiB still scores below any sm_80
    assert spec_score(7, 5, 48 * GIB) < spec_score(8, 0, 1 * GIB)


def test_a_device_that_cannot_be_asked_has_no_score() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert cuda_spec_score(count) is None  # no such device (every index, without CUDA)
    assert cuda_spec_score(-1) is None
    if count:
        props = torch.cuda.get_device_properties(0)
        assert cuda_spec_score(0) == spec_score(props.major, props.minor, props.total_memory)
    else:
        assert cuda_spec_score(0) is None
    # nothing to ask, or devices that cannot be asked: no score in the Hello
    assert hello_spec_score([]) is None
    assert hello_spec_score([count]) is None


def test_a_cpu_rank_has_no_candidate_devices() -> None:
    assert _spec_candidates("cpu", 0) == []
    assert _spec_candidates("cpu", None) == []
    if not torch.cuda.is_available():
        for wanted in ("auto", "cuda", "cuda:0"):
            assert _spec_candidates(wanted, None) == []
            assert _spec_candidates(wanted, 1) == []
    else:
        count = torch.cuda.device_count()
        assert _spec_candidates("auto", None) == list(range(count))
        assert _spec_candidates("cuda:0", None) == [0]
        assert _spec_candidates("auto", count + 1) == [(count + 1) % count]


def test_the_local_rank_before_the_join_follows_rank_envs_rule() -> None:
    assert _local_rank_before_join(3, {}) == 3
    assert _local_rank_before_join(None, {}) is None
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert _local_rank_before_join(None, env) == 1
    assert _local_rank_before_join(5, env) == 1
    # LOCAL_RANK alone is not a launcher's pair: the rank stands in, as rank_env does
    assert _local_rank_before_join(4, {"LOCAL_RANK": "1"}) == 4
