"""What torch loads lazily on a rank's first steps, loaded before the rank says Hello.

The first optimizer a process builds imports ``torch._dynamo`` (about 1.2-1.7 s on a
2-core machine, 3-4 s on the 16-core H200 host under gVisor). A rank builds its optimizer
after the world has formed and its first plan is out, so that import ran while the run's
clock was going, and it did not take the same time on every rank: on the host the two
ranks of a run started training 0.15-1.3 s apart, and the first trained the epochs it was
allowed ahead alone, then idled until its peer arrived (issue 27). Loaded before the
Hello, the import delays the world's formation instead, which waits for every rank anyway,
and the ranks start their first plan together, as DDP's ranks leave its first barrier.

The import runs on a thread from the start of the rank's join (``start_warming``), beside
what the join waits on anyway (Redis, the coordinator's secret and identity, the job's own
imports), so that it seldom adds to the time before the Hello: waited for on the join's
thread, it made a 2-rank test run 0.5 s longer on the 2-core machine.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Final

import structlog

#: The longest a rank waits for the warm-up before its Hello (it takes seconds): past
#: it the rank says Hello anyway and its optimizer finishes the import, as before.
WARM_BOUND_S: Final = 120.0


def warm_optimizer_imports() -> None:
    """Build and drop a throwaway optimizer: whatever torch imports on the first one
    (whichever class the job builds: the imports are the base class's) is loaded."""
    import torch

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


def start_warming(bound_s: float = WARM_BOUND_S) -> Callable[[], bool]:
    """Run ``warm_optimizer_imports`` on a thread now; the callable returned waits for it,
    at most ``bound_s``, and says whether it finished (a failure there is the job's
    optimizer's to report, when the rank builds it)."""
    thread = threading.Thread(target=_warm_quietly, name="flodl-warm-imports", daemon=True)
    thread.start()

    def wait() -> bool:
        thread.join(bound_s)
        if thread.is_alive():
            structlog.get_logger("flodl_bus.worker").warning(
                "warm_imports_unfinished",
                waited_s=bound_s,
                detail="saying Hello anyway: the job's optimizer finishes the import",
            )
            return False
        return True

    return wait


def _warm_quietly() -> None:
    # A failure here is the rank's own optimizer's to report: it meets the same error.
    with contextlib.suppress(Exception):
        warm_optimizer_imports()
