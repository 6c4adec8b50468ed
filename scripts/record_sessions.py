"""Record the golden runs of tests/sessions again (after a change of the record format).

    PYTHONPATH=. python scripts/record_sessions.py [MODE...]

Each is a real 3-rank run of the digits job for one epoch: a redis-server on a free
loopback port, ``flodl-bus coordinator`` and three ``flodl-bus worker`` processes
(``tests/replay/runs.py``), recorded compressed. A run that does not replay identically
is not kept.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from flodl_bus.bus.server import RedisServer
from flodl_bus.replay import load_run, replay, verify_run
from tests.replay.runs import record_run

MODES = ("cpu-cadence", "cpu-sync", "cpu-async", "nccl-cadence", "nccl-sync")
SESSIONS = Path(__file__).resolve().parents[1] / "tests" / "sessions"


def main(argv: list[str]) -> int:
    modes = argv or list(MODES)
    server = RedisServer().start()
    try:
        for mode in modes:
            with tempfile.TemporaryDirectory() as tmp:
                _, run_dir = record_run(server.url, Path(tmp) / "run", mode=mode)
                run = load_run(run_dir)
                verify_run(run)
                for key, rec in run.items():
                    result = replay(rec, keep_actual=False)
                    if not result.identical:
                        print(f"{mode} {key}: {result.summary()}", file=sys.stderr)
                        return 1
                dest = SESSIONS / mode
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir(parents=True)
                for f in run_dir.iterdir():
                    if f.name.startswith(("coordinator.", "rank")):
                        shutil.copy(f, dest / f.name)
                size = sum(f.stat().st_size for f in dest.iterdir())
                print(f"{mode}: {', '.join(sorted(run))} ({size} bytes)")
    finally:
        server.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
