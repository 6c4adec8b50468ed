"""``flodl-bus bench worker`` runs end to end (numbers are printed, never asserted)."""

from __future__ import annotations

import pytest
import torch

from flodl_bus.bench.worker import main


def test_the_worker_bench_prints_the_bus_cost_next_to_a_plain_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = torch.get_num_threads()
    assert main(["--steps", "100", "--repeats", "1", "--no-redis", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "plain PyTorch step" in out and "[memory] bus block per step" in out
    assert torch.get_num_threads() == before  # the caller's count is given back


def test_the_worker_bench_refuses_too_few_steps() -> None:
    assert main(["--steps", "5", "--no-redis"]) == 2


@pytest.mark.redis
def test_the_worker_bench_prints_the_rank_bus_on_threads_and_in_its_own_process(
    capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    assert main(["--steps", "100", "--repeats", "1", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    for name in ("redis", "redis, own process", "memory"):
        assert f"[{name}] bus block per step" in out, out
        assert f"[{name}]   training thread blocked" in out, out
