"""The fused divergence triple (``params.fused``): the eager norms' values in one read of
each chunk, the same bits every time, and out of the way where it cannot serve."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flodl_bus.params import fused

cuda_triton = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs a CUDA device and Triton",
)


def _eager(pre: torch.Tensor, post: torch.Tensor) -> list[float]:
    a, b = pre.double(), post.double()
    return [float((a - b).square().sum()), float(b.square().sum()), float(a.square().sum())]


def test_a_cpu_chunk_is_left_to_the_eager_norms() -> None:
    pre, post = torch.randn(100), torch.randn(100)
    assert fused.stats(pre, post) is None


@cuda_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_triple_matches_the_eager_norms_across_block_edges(dtype: torch.dtype) -> None:
    n = 3 * fused.BLOCK + 17  # a ragged last block
    gen = torch.Generator(device="cuda").manual_seed(0)
    pre = torch.randn(n, device="cuda", generator=gen).to(dtype)
    post = (pre.float() + 1e-3 * torch.randn(n, device="cuda", generator=gen)).to(dtype)
    got = fused.stats(pre, post)
    assert got is not None and got.dtype == torch.float64
    for g, want in zip(got.tolist(), _eager(pre, post), strict=True):
        assert g == pytest.approx(want, rel=1e-5)


@cuda_triton
def test_the_fused_triple_is_the_same_bits_every_time() -> None:
    pre = torch.randn(5_000_003, device="cuda")
    post = pre + 1e-4 * torch.randn_like(pre)
    first = fused.stats(pre, post)
    assert first is not None
    for _ in range(3):
        again = fused.stats(pre, post)
        assert again is not None and torch.equal(first, again)


@cuda_triton
def test_a_non_contiguous_chunk_is_left_to_the_eager_norms() -> None:
    pre = torch.randn(64, 2, device="cuda")[:, 0]
    assert fused.stats(pre, pre.clone()) is None


@cuda_triton
@pytest.mark.redis
def test_a_round_mixing_fused_and_eager_chunks_reads_every_norm_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uuid

    from flodl_bus.params import collective
    from flodl_bus.params.collective import CollectiveSync
    from flodl_bus.params.forming import store_base
    from flodl_bus.params.groups import SessionManager

    # chunks of exactly MIN_NUMEL: the first is fused, the 1,005-element tail is eager
    monkeypatch.setattr(collective, "CHUNK_BYTES", fused.MIN_NUMEL * 4)
    gen = torch.Generator(device="cuda").manual_seed(1)
    big = torch.randn(fused.MIN_NUMEL + 5, device="cuda", generator=gen)  # fused
    small = torch.randn(1000, device="cuda", generator=gen)  # eager
    want = float(torch.cat([big, small]).double().square().sum().sqrt())
    sessions = SessionManager(
        redis_url, store_base(f"fused-{uuid.uuid4().hex[:8]}"), 0, 1, backend="nccl", timeout=20.0
    )
    try:
        result = CollectiveSync([big, small], [], sessions, timeout=20.0).sync_now(1)
    finally:
        sessions.close()
    # one rank: the consensus is the rank's own model, so pre and post norms agree
    assert result.pre_norm == pytest.approx(want, rel=1e-6)
    assert result.post_norm == pytest.approx(want, rel=1e-6)
    assert result.divergence == 0.0
