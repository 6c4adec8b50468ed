"""One rank made slower on purpose: the heterogeneous runs of ``bench train --slow-rank``.

``flodl_bus.bench.slow:job`` is the job named by ``FLODL_BENCH_JOB``, except that on the
rank ``FLODL_SLOW_RANK`` (read from ``RANK`` at the first step, as ranks and DDP processes
set it) every step also does extra work: on a GPU a spin kernel
(``torch.cuda._sleep``) queued before the forward, on a CPU a busy loop. The extra time is
``FLODL_SLOW_FACTOR - 1`` times the rank's own step time, measured over its first
``CALIBRATE`` steps (the median interval between steps), so the rank's step becomes about
``FLODL_SLOW_FACTOR`` times slower whatever the model and device.

What it measured is written to ``FLODL_SLOW_REPORT`` (JSON, rewritten every
``REPORT_EVERY`` steps: ranks end without the interpreter's teardown): the step interval
before and after the slowdown, hence the slowdown the run really had.
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

#: steps timed before the slowdown starts (the first few, warm-up, are left out)
CALIBRATE = 30
WARMUP = 5
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
        self._before: list[float] = []
        self._after: list[float] = []
        self._extra_s = 0.0
        self._cycles_per_s: float | None = None

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self._mine is None:
            self._mine = int(os.environ.get("RANK", "0")) == self.rank
        if not self._mine:
            return self.inner(model, batch)
        now = time.perf_counter()
        if self._last is not None:
            interval = now - self._last
            if len(self._before) < CALIBRATE + WARMUP:
                self._before.append(interval)
            else:
                self._after.append(interval)
        self._last = now
        if len(self._before) == CALIBRATE + WARMUP and not self._extra_s:
            base = statistics.median(self._before[WARMUP:])
            self._extra_s = max(0.0, (self.factor - 1.0) * base)
        if self._extra_s:
            self._burn(self._extra_s, model)
        if self.report is not None and self._after and len(self._after) % REPORT_EVERY == 0:
            self._write()
        return self.inner(model, batch)

    def _burn(self, seconds: float, model: nn.Module) -> None:
        device = next(model.parameters()).device
        if device.type != "cuda":
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
            return
        if self._cycles_per_s is None:
            self._cycles_per_s = _spin_rate(device)
        torch.cuda._sleep(max(1, int(seconds * self._cycles_per_s)))  # type: ignore[no-untyped-call]

    def _write(self) -> None:
        assert self.report is not None
        before = statistics.median(self._before[WARMUP:])
        after = statistics.median(self._after)
        self.report.write_text(
            json.dumps(
                {
                    "rank": self.rank,
                    "factor_asked": self.factor,
                    "step_s_before": before,
                    "step_s_after": after,
                    "slowdown": after / before if before > 0 else None,
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
