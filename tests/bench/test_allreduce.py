"""``flodl-bus bench allreduce``: SyncNow beside a bare all-reduce on real process groups
(gloo here), the weighted consensus exact, one rank timing SyncNow's own passes."""

from __future__ import annotations

import pytest

from flodl_bus.bench.allreduce import main


@pytest.mark.redis
@pytest.mark.parametrize("ranks", [1, 2])
def test_bench_allreduce_times_both_paths_and_the_consensus_is_exact(
    ranks: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--params-m", "0.05", "--ranks", str(ranks), "--rounds", "2", "--eager-norms"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "floor" in out and "sync_now" in out and "consensus exact: True" in out
    assert ("moves nothing" in out) == (ranks == 1)
