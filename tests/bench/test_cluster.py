"""The cluster bench runs end to end on a tiny workload (figures are not asserted)."""

from __future__ import annotations

import pytest

from flodl_bus.bench.cluster import main


@pytest.mark.slow
@pytest.mark.redis
def test_cluster_bench_prints_every_figure_beside_one_redis(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc = main(["--ranks", "3", "--messages", "40", "--upstream", "100"])
    out = capsys.readouterr().out
    assert rc == 0
    for needle in ("dispatch p50", "dispatch p99", "WAIT 1", "no WAIT", "upstream ingest"):
        assert needle in out and "(one Redis" in out
    assert "entries named lost" in out
