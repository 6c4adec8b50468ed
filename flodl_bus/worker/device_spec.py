"""A CUDA device's spec score, the prior flodl's ElChe anchors on before any timing
(``ElChe::with_device_indices``): the lower the score, the slower the device is taken
to be.

The score is ``sm_major * 100 + sm_minor * 10 + vram_gb`` with ``vram_gb`` the total
memory in GiB, unrounded: the compute capability dominates and the memory only orders
devices of one generation. A rank sends its device's score in its ``Hello``; the
coordinator picks the slowest (``coordinator.elche.slowest_by_spec``).
"""

from __future__ import annotations

import math

_GIB = float(1 << 30)


def spec_score(sm_major: int, sm_minor: int, total_bytes: int) -> float:
    """The score of a device of compute capability ``sm_major.sm_minor`` with
    ``total_bytes`` of memory (flodl's formula; memory as a fraction of GiB)."""
    return sm_major * 100.0 + sm_minor * 10.0 + total_bytes / _GIB


def cuda_spec_score(index: int) -> float | None:
    """The score of CUDA device ``index`` of this host; None where it cannot be asked
    (no CUDA build, no driver, no such device): a rank without a score gives the run no
    prior, as flodl skips it when any device query fails."""
    import torch

    try:
        if not torch.cuda.is_available() or not 0 <= index < torch.cuda.device_count():
            return None
        props = torch.cuda.get_device_properties(index)
        score = spec_score(int(props.major), int(props.minor), int(props.total_memory))
    except Exception:
        # Any failure of the driver or runtime means "unknown", never a failed join.
        return None
    return score if math.isfinite(score) else None


def hello_spec_score(indices: list[int]) -> float | None:
    """The score a rank reports before it knows which of ``indices`` it will train on
    (its device follows its rank when that is assigned at the join): the score they
    share, else None (a guess could pin the wrong anchor, which is worse than none)."""
    scores = {cuda_spec_score(i) for i in indices}
    if len(scores) != 1:
        return None
    return scores.pop()
