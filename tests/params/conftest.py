"""Start real rank processes (``tests.params.rank_worker``) and collect what they saw."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Ranks:
    run_id: str
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def results(self, timeout: float = 60.0) -> list[Any]:
        out = []
        for rank, proc in enumerate(self.procs):
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
            if proc.returncode != 0:
                raise AssertionError(f"rank {rank} exited {proc.returncode}:\n{stderr[-3000:]}")
            line = stdout.strip().splitlines()[-1]
            out.append(json.loads(line)["result"])
        return out

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def launch(redis_url: str) -> Any:
    started: list[Ranks] = []

    def _launch(scenario: str, world: int, args: dict[str, Any]) -> Ranks:
        ranks = Ranks(run_id=f"params-{uuid.uuid4().hex[:8]}")
        for rank in range(world):
            cmd = [
                sys.executable,
                "-m",
                "tests.params.rank_worker",
                scenario,
                redis_url,
                ranks.run_id,
                str(rank),
                str(world),
                json.dumps(args),
            ]
            ranks.procs.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        started.append(ranks)
        return ranks

    yield _launch
    for ranks in started:
        ranks.kill()
