"""What a rank's process holds, sampled when it reports a plan's metrics (flodl's
``ResourceSampler``, attached to ``MetricsMsg.resources``).

Read once per plan, on the training thread, between two plans: the reads are cheap
(a ``/proc`` file and the CUDA allocator's counters) and need no thread of their own.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from flodl_bus.protocol.messages import ResourceSample

_STATM = Path("/proc/self/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """This process's resident set size now (not its peak: ``getrusage`` has only that);
    None where the kernel does not offer ``/proc`` (the sample then has no RSS)."""
    try:
        # statm: size resident shared text lib data dt, in pages
        return int(_STATM.read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


#: devices whose utilisation could not be read once: not asked again every plan (a
#: missing pynvml costs an import search per attempt, on the training thread)
_NO_UTIL: set[int] = set()


def _gpu_util(index: int) -> float | None:
    # torch asks NVML (the pynvml package); without it, or on a driver that refuses,
    # there is no utilisation figure rather than a failed report.
    if index in _NO_UTIL:
        return None
    try:
        return float(torch.cuda.utilization(index))
    except Exception:
        _NO_UTIL.add(index)
        return None


def sample(device: torch.device) -> ResourceSample:
    """The rank's resources on ``device``: RSS always, the GPU fields on CUDA only."""
    rss = rss_bytes()
    if device.type != "cuda" or not torch.cuda.is_available():
        return ResourceSample(rss_bytes=rss)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return ResourceSample(
        rss_bytes=rss,
        device_index=index,
        gpu_util_percent=_gpu_util(index),
        vram_allocated_bytes=int(torch.cuda.memory_allocated(index)),
        vram_reserved_peak_bytes=int(torch.cuda.max_memory_reserved(index)),
        vram_total_bytes=int(torch.cuda.get_device_properties(index).total_memory),
    )
