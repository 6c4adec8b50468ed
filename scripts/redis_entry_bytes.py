"""What ``MAXLEN ~ 100000`` trimming costs in Redis memory, per stream (ops/redis.conf).

Writes more than ``maxlen`` entries through the bus itself (a rank's publisher, the
coordinator's unicast and broadcast) into a throwaway redis-server, then reads each
stream's ``MEMORY USAGE`` (exact, SAMPLES 0) and entry count:

    python scripts/redis_entry_bytes.py            # 120,000 entries per stream
"""

from __future__ import annotations

import argparse
import time

from flodl_bus.bus.connection import connect
from flodl_bus.bus.server import RedisServer
from flodl_bus.bus.stream_ops import DEFAULT_MAXLEN
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.protocol import messages as m
from flodl_bus.protocol import signing

SEED = bytes(range(16))


def _buses(url: str) -> tuple[RedisCoordinatorBus, RedisRankBus]:
    keys = signing.fixed_keys(SEED)
    return (
        RedisCoordinatorBus(connect(url), "size", keys, ranks=[0]),
        RedisRankBus(connect(url), "size", 0, signing.rank_keys_for(keys, 0)),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=int(DEFAULT_MAXLEN * 1.2))
    args = ap.parse_args()
    with RedisServer() as server:
        admin = connect(server.url)
        coord, rank = _buses(server.url)
        t0 = time.monotonic()
        for i in range(args.entries):
            # A training step's Batch, with every optional field set (the largest).
            rank.publish(
                m.Batch(
                    rank=0,
                    batch_ms=12.345,
                    data_ms=1.25,
                    step_count=i,
                    batch_loss=0.4321,
                    param_norm=12.5,
                    sync_divergence=0.01,
                )
            )
        assert rank.flush(600)
        for i in range(args.entries):
            coord.send(0, m.SetGlobalStep(global_step=i))
            coord.broadcast(m.CoordHeartbeat())
        took = time.monotonic() - t0
        for stream, what in (
            (rank.keys.up(0), "up:<r>   Batch"),
            (rank.keys.ctl(0), "ctl:<r>  SetGlobalStep"),
            (rank.keys.ctl_all, "ctl:all  CoordHeartbeat"),
        ):
            n = int(admin.xlen(stream))
            usage = int(admin.memory_usage(stream, samples=0) or 0)
            print(
                f"{what:26s} {n:7d} entries kept  {usage / 2**20:6.1f} MiB  "
                f"{usage / max(n, 1):5.0f} B/entry"
            )
        print(f"({args.entries} entries per stream written in {took:.0f}s)")
        rank.close()
        coord.close()
        admin.close()


if __name__ == "__main__":
    main()
