"""A real rank process that records itself: ``python -m tests.replay.rank_proc``.

The same assembly as ``flodl-bus worker`` (``run_rank`` over ``RedisRankBus``) with the
record directory passed explicitly, so these tests do not depend on the worker CLI's flags.
"""

from __future__ import annotations

import argparse
import sys

from flodl_bus.bus.connection import connect
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.streams import RedisRankBus
from flodl_bus.job import load_job
from flodl_bus.protocol.signing import fixed_keys, rank_keys_for
from flodl_bus.worker.rank import RankOptions, run_rank
from flodl_bus.worker.runtime import RuntimeConfig


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--secret", required=True)
    p.add_argument("--record-dir", required=True)
    p.add_argument("--save-path")
    args = p.parse_args()
    client = connect(args.url, client_name="flodl-rank0")
    # the fixed keys of the test's seed: this scripted session has no join
    keys = rank_keys_for(fixed_keys(bytes.fromhex(args.secret)), 0)
    bus = RedisRankBus(client, RunKeys(args.run), 0, keys)
    options = RankOptions(
        world_size=1,
        runtime=RuntimeConfig(heartbeat_interval=0.2, coord_liveness_timeout=30.0),
        save_path=args.save_path,
        record_dir=args.record_dir,
        record_header={"run": args.run, "mode": "cpu-cadence", "job": "digits"},
    )
    try:
        return run_rank(load_job("flodl_bus.examples.digits:job"), bus, options)
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
