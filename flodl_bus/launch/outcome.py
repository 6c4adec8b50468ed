"""How ``flodl-bus up`` takes a stop signal and reads its run's outcome: the stop
signals turned into one exception, the launcher's exit code from its children's, the
run's batches (the run bar's total) and an epoch row as record fields.

Pure helpers of ``launch.up``, kept apart so the launcher's loop stays readable.
"""

from __future__ import annotations

import contextlib
import math
import signal
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from flodl_bus.exits import CONFIG, FAILED, OK, STOP_SIGNALS, STOPPED, by_signal, signal_of
from flodl_bus.launch import run_lock
from flodl_bus.launch.view import EpochRow


class _Stop(BaseException):
    """A stop signal to the launcher (SIGINT, SIGTERM, SIGHUP): shut the run down in
    order. A BaseException, like KeyboardInterrupt, so no ``except Exception`` in the
    watch loop swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run_exit_code(
    coordinator_rc: int | None,
    worker_rcs: Sequence[int | None],
    *,
    signum: int | None = None,
    lingered: bool = False,
    target_missed: bool = False,
) -> int:
    """The launcher's exit code (``flodl_bus.exits``) from its children's outcomes.

    The coordinator speaks for the run; a worker that did not finish (killed, crashed,
    stopped by someone else's signal) makes a run that otherwise finished a failure, so
    a script notices. A child's negative status (killed by a signal) never leaks out.
    """
    if signum is not None:
        return by_signal(signum)
    if coordinator_rc == CONFIG or CONFIG in worker_rcs:
        return CONFIG
    if coordinator_rc is not None and signal_of(coordinator_rc) is not None:
        return coordinator_rc  # someone stopped the coordinator: the run was interrupted
    if coordinator_rc == STOPPED:
        # The protocol stopped the run; a rank's own failure (the job raised) is the
        # cause, and says more than the stop it led to.
        return FAILED if FAILED in worker_rcs else STOPPED
    if coordinator_rc != OK or lingered or any(rc != OK for rc in worker_rcs):
        return FAILED
    return FAILED if target_missed else OK


def run_batches(run_header: Mapping[str, Any]) -> int | None:
    """The run's batches, every rank's of every epoch (the run bar's total), from the
    ``run`` line of the coordinator's record."""
    try:
        cfg = run_header["config"]
        samples, batch = int(cfg["total_samples"]), int(cfg["batch_size"])
        epochs = int(cfg["num_epochs"])
    except (KeyError, TypeError, ValueError):
        return None
    if min(samples, batch, epochs) < 1:
        return None
    return math.ceil(samples / batch) * epochs


@contextlib.contextmanager
def _signals_as_stop() -> Iterator[None]:
    def on_stop(sig: int, _frame: FrameType | None) -> None:
        raise _Stop(sig)

    # Every stop signal explicitly, SIGINT included: started in the background from a
    # script, the launcher inherits SIGINT ignored and would not stop on Ctrl-C / kill
    # -INT. SIGHUP too: a closed terminal or ssh session must stop the children (they run
    # in their own sessions and would not get the hang-up themselves), not orphan them.
    previous = {sig: signal.signal(sig, on_stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _row_fields(row: EpochRow) -> dict[str, Any]:
    return {
        "epoch": row.epoch,
        "loss": row.loss,
        "metric": row.metric,
        "throughput": list(row.throughput),
        "syncs": row.syncs,
        "syncs_total": row.syncs_total,
        "anchor": row.anchor,
        "epoch_s": row.epoch_s,
        "at": row.at,
        "skipped": row.skipped,
    }


def run_files(run_dir: Path) -> tuple[str, ...]:
    """The files of the run's folder the summary lists (the run's lock is no output)."""
    return tuple(
        sorted(p.name for p in run_dir.iterdir() if p.is_file() and p.name != run_lock.LOCK_NAME)
    )
