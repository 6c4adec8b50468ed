"""One rank made slower on purpose: the heterogeneous runs of ``bench train --slow-rank``.

``flodl_bus.bench.slow:job`` is the job named by ``FLODL_BENCH_JOB``, except that on the
rank ``FLODL_SLOW_RANK`` (read from ``RANK`` at the first step, as ranks and DDP processes
set it) every step also does extra work: on a GPU a spin kernel
(``torch.cuda._sleep``) queued before the forward, on a CPU a busy loop. The extra time is
``FLODL_SLOW_FACTOR - 1`` times the rank's own step time, so the rank's step becomes about
``FLODL_SLOW_FACTOR`` times slower whatever the model and device.

The rank is slowed from its ``WARMUP + 1``-th step on, not after a calibration run at full
speed: a scheduler that learns speeds from the first windows (ElChe) must see the slow rank
as slow from the start, as it would a slower GPU. The rank's own step is measured while it
is slowed: each step interval less the extra work it held (timed: CUDA events around the
spin, the clock around the busy loop; every rank reads its loss each step, so one interval
is one step). The extra follows the running median of those until ``CALIBRATE`` samples,
then stays fixed.

What it measured is written to ``FLODL_SLOW_REPORT`` (JSON, rewritten each step of the
first ``REPORT_EVERY`` once the extra is fixed, then every ``REPORT_EVERY``: ranks end
without the interpreter's teardown): the rank's own step, the slowed step, hence the
slowdown the run really had.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flodl_bus.job import Job, load_job

#: samples of the rank's own step before the extra work is fixed
CALIBRATE = 30
#: first steps left alone (start-up: allocation, kernel selection) and not sampled
WARMUP = 3
REPORT_EVERY = 25

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class Slowed:
    """``loss_fn`` with extra work on one rank."""

    def __init__(self, inner: LossFn, rank: int, factor: float, report: str | None) -> None:
        self.inner = inner
        self.rank = rank
        self.factor = factor
        self.report = Path(report) if report else None
        self._mine: bool | None = None
        self._last: float | None = None
        self._calls = 0
        #: the rank's own step: an interval less the extra work done in it
        self._own: list[float] = []
        #: whole slowed steps, once the extra is fixed
        self._after: list[float] = []
        self._extra_s = 0.0
        self._fixed = False
        #: the extra work of the step under way: CUDA events, or seconds on a CPU
        self._pending: tuple[Any, Any] | float | None = None
        self._cycles_per_s: float | None = None

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self._mine is None:
            self._mine = int(os.environ.get("RANK", "0")) == self.rank
        if not self._mine:
            return self.inner(model, batch)
        now = time.perf_counter()
        if self._last is not None and self._calls > WARMUP:
            interval = now - self._last
            if self._fixed:
                self._after.append(interval)
            else:
                self._own.append(max(interval - self._spent(), 0.0))
                self._extra_s = max(0.0, (self.factor - 1.0) * statistics.median(self._own))
                self._fixed = len(self._own) >= CALIBRATE
        self._last = now
        self._calls += 1
        self._pending = None
        if self._extra_s:
            self._pending = self._burn(self._extra_s, model)
        n = len(self._after)
        # every step at first (a short run still reports), then every REPORT_EVERY
        if self.report is not None and n and (n < REPORT_EVERY or n % REPORT_EVERY == 0):
            self._write()
        return self.inner(model, batch)

    def _spent(self) -> float:
        """Seconds of extra work the last step really held (its spin, timed on the GPU)."""
        pending = self._pending
        if pending is None:
            return 0.0
        if isinstance(pending, float):
            return pending
        start, end = pending
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0

    def _burn(self, seconds: float, model: nn.Module) -> tuple[Any, Any] | float:
        device = next(model.parameters()).device
        if device.type != "cuda":
            t0 = time.perf_counter()
            end_at = t0 + seconds
            while time.perf_counter() < end_at:
                pass
            return time.perf_counter() - t0
        if self._cycles_per_s is None:
            self._cycles_per_s = _spin_rate(device)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        torch.cuda._sleep(max(1, int(seconds * self._cycles_per_s)))  # type: ignore[no-untyped-call]
        end.record()
        return start, end

    def _write(self) -> None:
        assert self.report is not None
        own = statistics.median(self._own)
        after = statistics.median(self._after)
        self.report.write_text(
            json.dumps(
                {
                    "rank": self.rank,
                    "factor_asked": self.factor,
                    "step_s_before": own,
                    "step_s_after": after,
                    "slowdown": after / own if own > 0 else None,
                    "steps_after": len(self._after),
                }
            )
        )


def _spin_rate(device: torch.device) -> float:
    """Cycles of ``torch.cuda._sleep`` per second on ``device`` (timed with events)."""
    cycles = 10_000_000
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]  # warm
    start.record()
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
    end.record()
    end.synchronize()
    return float(cycles / (start.elapsed_time(end) / 1000.0))


def job() -> Job:
    ref = os.environ.get("FLODL_BENCH_JOB")
    if not ref:
        raise SystemExit("flodl_bus.bench.slow:job needs FLODL_BENCH_JOB=MODULE:NAME")
    inner = load_job(ref)
    rank = int(os.environ.get("FLODL_SLOW_RANK", "-1"))
    factor = float(os.environ.get("FLODL_SLOW_FACTOR", "1"))
    if rank < 0 or factor <= 1.0:
        return inner
    return replace(
        inner,
        loss_fn=Slowed(inner.loss_fn, rank, factor, os.environ.get("FLODL_SLOW_REPORT")),
    )
