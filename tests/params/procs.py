"""Start real rank processes (``tests.params.rank_worker``) and collect what they saw."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Ranks:
    run_id: str
    redis_url: str
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def result(self, rank: int, timeout: float = 60.0) -> Any:
        proc = self.procs[rank]
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        if proc.returncode != 0:
            raise AssertionError(f"rank {rank} exited {proc.returncode}:\n{stderr[-3000:]}")
        return json.loads(stdout.strip().splitlines()[-1])["result"]

    def results(self, timeout: float = 60.0) -> list[Any]:
        return [self.result(rank, timeout) for rank in range(len(self.procs))]

    def control(self, rank: int, cmd: dict[str, Any]) -> None:
        """What the coordinator would send the rank (NewNcclSession, DeclareDead)."""
        with redis.Redis.from_url(self.redis_url, socket_timeout=5) as r:
            r.rpush(f"test:{self.run_id}:ctl:{rank}", json.dumps(cmd))

    def progress(self, rank: int) -> int:
        with redis.Redis.from_url(self.redis_url, socket_timeout=5) as r:
            return int(r.get(f"test:{self.run_id}:progress:{rank}") or 0)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def start_ranks(redis_url: str, scenario: str, world: int, args: dict[str, Any]) -> Ranks:
    ranks = Ranks(run_id=f"params-{uuid.uuid4().hex[:8]}", redis_url=redis_url)
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
    return ranks
