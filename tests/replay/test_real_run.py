"""A real 3-rank cpu-cadence run (redis-server, ``flodl-bus coordinator``, three
``flodl-bus worker`` processes training digits) records itself and replays identically."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_bus.replay import load_run, replay
from tests.replay.runs import record_run

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_a_real_cpu_cadence_run_replays_identically_for_every_process(
    redis_url: str, tmp_path: Path
) -> None:
    run_id, run_dir = record_run(redis_url, tmp_path / "run", mode="cpu-cadence", epochs=1)
    run = load_run(run_dir)
    assert sorted(run) == ["coordinator", "rank:0", "rank:1", "rank:2"]
    assert run["coordinator"].header["run"] == run_id
    for key, rec in run.items():
        result = replay(rec)
        assert result.identical, f"{key}: {result.summary()}"
        assert result.replayed == len(rec.core_events()) > 10
    # The rank records carry the CPU round's port answers and the in-process Update.
    calls = {c["call"] for e in run["rank:1"].core_events() for c in e.get("calls") or ()}
    assert {"snapshot", "load_averaged"} <= calls
    # No secret reaches any record.
    import os

    secret_hex = os.environ.get("FLODL_RUN_SECRET")
    for f in run_dir.iterdir():
        text = f.read_text(errors="replace")
        assert "secret" not in text.lower() or "***" in text
        if secret_hex:
            assert secret_hex not in text
