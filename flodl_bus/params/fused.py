"""The divergence triple of a SyncNow chunk in one pass over memory (CUDA, Triton).

A round needs ``‖pre - post‖²``, ``‖post‖²`` and ``‖pre‖²`` of every chunk. Eager torch
reads them in six passes over the chunk (the difference is written out and read back);
at 100M parameters that is about 0.75 ms of HBM traffic on an H200, most of SyncNow's
cost beyond the all-reduce itself. One Triton kernel reads ``pre`` and ``post`` once
and writes a per-block partial triple; the partials are summed in float64.

The partial sums are fixed per block and summed by torch's reduction, so the result is
the same bits for the same inputs (no atomics). Where Triton is missing or a launch
fails, ``stats`` returns None and the caller uses its eager passes.
"""

from __future__ import annotations

import functools
from typing import Any, Final

import structlog
import torch

log = structlog.get_logger("flodl_bus.params")

#: elements per Triton program: large enough that the partials are few, small enough to
#: keep every SM busy on a 16M-element chunk
BLOCK: Final = 8192
#: smallest chunk worth the kernel: below it the eager passes cost less than a Triton
#: launch (one H200: a 2.8M-param model's round was 0.6 ms eager, up to 1.1 ms fused;
#: 100M params in 64 MB chunks, 1.55 ms eager, 0.85 ms fused)
MIN_NUMEL: Final = 1 << 23


@functools.cache
def _kernel() -> Any:
    """The compiled-on-first-use kernel, or None where Triton is not installed."""
    try:
        import triton  # type: ignore[import-not-found,unused-ignore]
        import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None

    @triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
    # Triton reads the annotations itself (only its own types are allowed): none here.
    def triple(pre, post, out, n, block: tl.constexpr):  # type: ignore[no-untyped-def]
        pid = tl.program_id(0)
        offs = pid * block + tl.arange(0, block)
        inside = offs < n
        a = tl.load(pre + offs, mask=inside, other=0.0).to(tl.float32)
        b = tl.load(post + offs, mask=inside, other=0.0).to(tl.float32)
        d = a - b
        tl.store(out + pid * 3, tl.sum(d * d, axis=0))
        tl.store(out + pid * 3 + 1, tl.sum(b * b, axis=0))
        tl.store(out + pid * 3 + 2, tl.sum(a * a, axis=0))

    return triple


_failed = False


def disable() -> None:
    """Use the eager norms from now on in this process (a bench's comparison run)."""
    global _failed
    _failed = True


def available() -> bool:
    """Whether ``stats`` can serve (Triton importable, no launch failed yet)."""
    return not _failed and _kernel() is not None


def stats(pre: torch.Tensor, post: torch.Tensor) -> torch.Tensor | None:
    """``[‖pre - post‖², ‖post‖², ‖pre‖²]`` as a float64 device tensor, queued on the
    current stream; None where the fused path cannot serve (not CUDA, no Triton, a
    non-contiguous chunk, or an earlier launch failed)."""
    global _failed
    if _failed or pre.device.type != "cuda" or not (pre.is_contiguous() and post.is_contiguous()):
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    n = pre.numel()
    blocks = max(1, -(-n // BLOCK))
    partial = torch.empty(blocks * 3, dtype=torch.float32, device=pre.device)
    try:
        kernel[(blocks,)](pre, post, partial, n, block=BLOCK, num_warps=8)
    except Exception as exc:  # a Triton/driver mismatch must not stop the round
        _failed = True
        log.warning("fused_divergence_unavailable", error=str(exc)[:200])
        return None
    return partial.view(blocks, 3).double().sum(0)
