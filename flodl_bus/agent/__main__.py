"""``python -m flodl_bus.agent --url URL --run RUN --host NAME --ranks 0,1,... --socket PATH``:
run one host agent until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

import structlog

from flodl_bus.agent.host import HostAgent
from flodl_bus.bus import cluster
from flodl_bus.bus.connection import connect
from flodl_bus.bus.keys import RunKeys


def parse_ranks(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flodl_bus.agent", description=__doc__)
    ap.add_argument("--url", required=True, help="the run's Redis (redis:// or rediss://)")
    ap.add_argument("--run", required=True)
    ap.add_argument("--host", required=True, help="this host's name in the run's keys")
    ap.add_argument("--ranks", required=True, help="the ranks on this host: 0,1,2 or 0-7")
    ap.add_argument("--socket", required=True, help="the Unix socket the ranks connect to")
    args = ap.parse_args(argv)
    try:
        ranks = parse_ranks(args.ranks)
    except ValueError:
        print(f"--ranks: expected 0,1,2 or 0-7, got {args.ranks!r}", file=sys.stderr)
        return 2
    # stdout says when the socket is ready (a supervisor waits for that line); logs go
    # to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    client = connect(args.url)
    meta: Any = client.hgetall(RunKeys(args.run).meta)
    shards = meta.get(b"shards") if isinstance(meta, dict) else None
    text = shards.decode() if isinstance(shards, bytes) else None
    keys = RunKeys(args.run, cluster.parse_shards(text))
    agent = HostAgent(client, keys, args.host, ranks, args.socket).start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"agent {args.host} ready: ranks {ranks} on {args.socket}", flush=True)
    done.wait()
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
