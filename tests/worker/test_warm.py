"""``worker.warm``: a rank loads what its first optimizer imports before it says Hello."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, sys
import torch
{warm}
before = set(sys.modules)
torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith("torch"))))
"""


def _loaded_by_first_optimizer(warm: bool) -> list[str]:
    """The torch modules a job's first optimizer imports, in a fresh interpreter."""
    # as a rank's join does it: on a thread, waited for before the Hello
    warm_up = "from flodl_bus.worker.warm import start_warming; start_warming()()"
    code = _PROBE.format(warm=warm_up if warm else "")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_a_warmed_rank_imports_nothing_when_its_job_builds_its_optimizer() -> None:
    cold = _loaded_by_first_optimizer(warm=False)
    if not cold:
        pytest.skip("this torch imports nothing on the first optimizer: nothing to warm")
    # The import the warm-up exists for (torch 2.x: the dynamo stack, seconds of a core).
    assert any(m.startswith("torch._dynamo") for m in cold), cold
    assert _loaded_by_first_optimizer(warm=True) == []


def test_the_wait_for_the_warm_up_is_bounded_and_says_when_it_gave_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from flodl_bus.worker import warm

    release = threading.Event()
    # an import that never ends (a wedged file system): the Hello must not wait for it
    monkeypatch.setattr(warm, "warm_optimizer_imports", lambda: release.wait(60))
    try:
        assert warm.start_warming(bound_s=0.2)() is False
    finally:
        release.set()
    monkeypatch.setattr(warm, "warm_optimizer_imports", lambda: None)
    assert warm.start_warming(bound_s=30.0)() is True
