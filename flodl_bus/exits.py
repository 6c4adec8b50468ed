"""The exit codes every ``flodl-bus`` command follows (the table in README.md).

One table for ``up``, ``coordinator`` and ``worker``, so a supervisor (a shell script,
compose, Kubernetes) reads the same outcome from any of them:

===  ==========================================================================
0    finished: the run trained every epoch (and, for ``up --require-target``,
     reached the job's target)
1    failed: the job raised, a process crashed or was killed, ``up``'s target
     missed, the coordinator's record process or a reader process hung; the log
     names the cause
2    bad configuration or input, refused before anything ran (one line names
     the fix)
3    stopped in order by the protocol before the run finished: the coordinator
     ended it with a save (``ShutdownWithSave``: too many ranks lost, a lone NCCL
     survivor, a stalled reduce), or a rank lost its coordinator
128+N  stopped in order by signal N: 129 SIGHUP, 130 SIGINT (Ctrl-C), 143 SIGTERM;
     records closed, the run's state marked interrupted
===  ==========================================================================
"""

from __future__ import annotations

import signal
from typing import Final

OK: Final = 0
FAILED: Final = 1
CONFIG: Final = 2
STOPPED: Final = 3

#: The signals every process stops in order on (and installs its own handler for:
#: an inherited disposition may be "ignored", e.g. SIGINT in a background job).
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def by_signal(signum: int) -> int:
    """The shell's convention: 128 + the signal's number."""
    return 128 + int(signum)


def signal_of(code: int) -> int | None:
    """The stop signal an exit code reports, if it is one of ours."""
    sig = code - 128
    return sig if sig in {int(s) for s in STOP_SIGNALS} else None


def describe(code: int | None) -> str:
    """One phrase for a child's ``returncode`` (negative: killed by that signal)."""
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {_name(-code)}"
    sig = signal_of(code)
    if sig is not None:
        return f"stopped by {_name(sig)} (exit {code})"
    return {
        OK: "finished (exit 0)",
        FAILED: "failed (exit 1)",
        CONFIG: "bad configuration (exit 2)",
        STOPPED: "stopped by the protocol (exit 3)",
    }.get(code, f"exit {code}")


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
