"""The bus bench runs end to end on a tiny workload (figures are not asserted)."""

from __future__ import annotations

import pytest

from flodl_bus.bench.bus import main


@pytest.mark.redis
def test_bus_bench_prints_every_figure_beside_ping(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        ["--redis-url", redis_url, "--ranks", "1,2", "--ingest-ranks", "2", "--messages", "40",
         "--ingest", "400", "--publishes", "400", "--repeats", "1"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    for needle in ("raw PING", "2 rank(s)", "x PING", "pre-filled", "live publishers", "burst"):
        assert needle in out
