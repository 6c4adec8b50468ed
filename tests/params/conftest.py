from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.params.procs import Ranks, start_ranks

Launch = Callable[[str, int, dict[str, Any]], Ranks]


@pytest.fixture
def launch(redis_url: str) -> Iterator[Launch]:
    """Start rank processes; whatever is still running at teardown is killed."""
    started: list[Ranks] = []

    def _launch(scenario: str, world: int, args: dict[str, Any]) -> Ranks:
        ranks = start_ranks(redis_url, scenario, world, args)
        started.append(ranks)
        return ranks

    yield _launch
    for ranks in started:
        ranks.kill()
