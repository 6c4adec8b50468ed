"""``flodl-bus bench codec``: a real run prints a ratio per variant; bad input exits 2."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from flodl_bus.bench.codec import main
from flodl_bus.protocol.wire import CONTROL_TYPES, JOIN_TYPES, UPSTREAM_TYPES


def test_bench_codec_runs_and_prints_a_ratio_per_variant() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flodl_bus.cli",
            "bench",
            "codec",
            "--iterations",
            "50",
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows: dict[str, tuple[float, ...]] = {}
    timings: list[int] = []
    for line in proc.stdout.splitlines():
        cells = line.split()
        if len(cells) == 10 and all(cells[i].endswith("x") for i in (4, 7, 9)):
            rows[cells[0]] = tuple(float(cells[i][:-1]) for i in (4, 7, 9))
            timings += [int(cells[i]) for i in (2, 3, 5, 6, 8)]
    assert set(rows) == CONTROL_TYPES | UPSTREAM_TYPES | JOIN_TYPES
    # Every timing was taken; a ratio may print as 0.0x when a loaded host preempted the
    # floor's few iterations, so the ratios are only checked to be numbers.
    assert all(t > 0 for t in timings)
    assert all(r >= 0 and math.isfinite(r) for pair in rows.values() for r in pair)
    summary = re.search(
        r"summary: (\d+) variants; median ratio vs msgpack: encode ([\d.]+)x .* decode ([\d.]+)x",
        proc.stdout,
    )
    assert summary is not None, proc.stdout
    assert int(summary.group(1)) == len(rows)


def test_bench_codec_refuses_zero_iterations() -> None:
    with pytest.raises(SystemExit) as info:
        main(["--iterations", "0"])
    assert info.value.code == 2


def test_bench_codec_signing_prints_each_world_beside_its_reference(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # measure_signing asserts the vector equals the one-shot reference before timing it
    assert main(["--signing", "8,65", "--iterations", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(\d+) ranks\s+(.+?)\s+sign\s+(\S+) \(ref\s+(\S+)\)", out, re.M)
    assert [(int(n), kind.split()[0]) for n, kind, _, _ in rows] == [(8, "MAC"), (65, "Ed25519")]
    sign, ref = float(rows[0][2]), float(rows[0][3])
    assert sign > 0 and ref > 0
    assert math.isnan(float(rows[1][3]))  # no vector above 64 ranks: no reference
