"""``flodl-bus bench path`` measures every stage of the coordinator's per-message path at
a small N on its own redis-server and prints each figure beside its budget.

The figures are measurements (BENCHMARKS.md); this pins that every stage runs the real
bus, loop, core and recorder to the end and that nothing it reports is missing."""

from __future__ import annotations

import math
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from flodl_bus.bench.path import main, measure
from flodl_bus.bus.server import RedisServer
from flodl_bus.cli import BENCHES


def test_bench_path_is_a_registered_bench() -> None:
    assert BENCHES["path"][0] == "flodl_bus.bench.path:main"


def test_every_stage_of_the_path_is_measured_over_every_prefilled_message(
    tmp_path: Path,
) -> None:
    with RedisServer() as server:
        costs = measure(server.url, ranks=8, steps=3, step_ms=50.0, work=tmp_path, repeats=1)
    assert costs.messages == 8 * 3 + 8  # a Batch per rank and step, one LrUpdate per rank
    for name, value in asdict(costs).items():
        assert math.isfinite(value) and value > 0, (name, value)
    assert costs.budget_us == pytest.approx(50_000 / 16)


def test_the_report_prints_each_stage_and_bad_arguments_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--ranks", "4", "--steps", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for label in ("ingest", "ingest + core", "ingest+core+record", "send (batched)", "per read"):
        assert re.search(rf"^  {re.escape(label)} +\d", out, re.M), label
    assert main(["--ranks", "four"]) == 2
    assert main(["--ranks", "4", "--repeats", "0"]) == 2
