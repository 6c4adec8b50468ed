"""``flodl-bus bench agent --ranks N[,N...] --ranks-per-host K``: the coordinator's
upstream cost with host agents folding K ranks' messages into one stream
(``flodl_bus.agent``), beside the same messages on N streams of their own.

On a real ``redis-server`` (loopback), every rank's upstream pre-filled with ``--steps``
training steps (a ``Batch`` each, an ``LrUpdate`` with the first), once as today (each
rank its ``up:<r>``) and once folded (each host's ``up:host:<h>``, by default one entry
per host and step holding its K ranks' items; ``--fold-items`` sets fewer, as a live
agent's ticks hold):

* ``ingest``: ``RedisCoordinatorBus.read_upstream`` + ack per message (XREADGROUP, seq,
  MAC, decode; folded: unpack and one MAC per item);
* ``empty read``: one XREADGROUP that finds nothing (N streams, or N/K).

``--ingest-procs 0,2,4``: the ingest again with the streams read by that many reader
processes (``bus.ingest``; they unpack and check folded items as the coordinator's
thread does), with this process's CPU per message beside the wall time: what the
dispatching thread is left with.

Passes alternate (direct, folded, direct, ...) and each figure is the best of
``--repeats``. Reference from the same run: a PING round trip; the budget per message
of ``bench path`` (with ``--step-ms`` steps N ranks send 2N messages a step).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from flodl_bus.bench.bus import ingest_procs_list
from flodl_bus.bench.path import QUIET, SEED, _ping_us, _prefill
from flodl_bus.bench.scale import rank_counts
from flodl_bus.bench.scale_agents import hosts
from flodl_bus.bus import entries, fold
from flodl_bus.bus.connection import connect
from flodl_bus.bus.ids import IdClock, format_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer
from flodl_bus.bus.streams import RedisCoordinatorBus
from flodl_bus.protocol import messages as m
from flodl_bus.protocol.signing import fixed_keys


def _prefill_folded(url: str, keys: RunKeys, ranks: int, steps: int, k: int, per_entry: int) -> int:
    client = connect(url)
    signing = fixed_keys(SEED)
    clock = IdClock()
    seqs = [0] * ranks
    n = 0
    pipe = client.pipeline(transaction=False)
    for s in range(1, steps + 1):
        for j, group in enumerate(hosts(ranks, k)):
            items: list[list[Any]] = []
            for r in group:
                batch = m.Batch(rank=r, batch_ms=50.0, data_ms=0.1, step_count=s, batch_loss=0.5)
                lr = (m.LrUpdate(rank=r, lr=0.1),) if s == 1 else ()
                for msg in (batch, *lr):
                    seqs[r] += 1
                    encoded = entries.encode(msg)
                    items.append(fold.sign_item(signing.rank(r), keys.up(r), r, seqs[r], encoded))
                    n += 1
            stream = fold.host_stream(keys.prefix, f"h{j}")
            for i in range(0, len(items), per_entry):
                fields = fold.fold_fields(f"h{j}", s, items[i : i + per_entry])
                pipe.xadd(stream, fields, id=format_id(clock.next(1)))  # type: ignore[arg-type]
            if len(pipe) >= 500:
                pipe.execute()
    pipe.execute()
    client.close()
    return n


def _bus(url: str, ranks: int, k: int, procs: int = 0) -> tuple[RedisCoordinatorBus, RunKeys]:
    keys = RunKeys(f"agent-{uuid.uuid4().hex[:8]}")
    bus = RedisCoordinatorBus(
        connect(url), keys, fixed_keys(SEED), config=QUIET, ingest_procs=procs
    )
    if k > 1:
        for j, group in enumerate(hosts(ranks, k)):
            bus.add_fold(f"h{j}", group)
    for r in range(ranks):
        bus.add_rank(r)
    if bus.ingest is not None and not bus.ingest.wait_ready(120):
        raise RuntimeError("bench agent: the ingest reader processes did not start")
    for _ in range(3):
        bus.read_upstream(0)  # the first reads drain the (empty) pending lists: not timed
    return bus, keys


def _ingest(
    url: str, ranks: int, steps: int, k: int, per_entry: int = 0, procs: int = 0
) -> tuple[float, float]:
    """(µs per message, this process's CPU µs per message) of one pre-filled pass."""
    bus, keys = _bus(url, ranks, k, procs)
    if k > 1:
        total = _prefill_folded(url, keys, ranks, steps, k, per_entry or 2 * k)
    else:
        total = _prefill(url, keys, ranks, steps)
    got = 0
    c0 = time.process_time()
    t0 = time.perf_counter()
    while got < total:
        ds = bus.read_upstream(200 if procs == 0 else 2000)
        if not ds:
            raise RuntimeError(f"bench agent: stalled at {got}/{total} messages")
        got += len(ds)
        bus.ack(ds)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    if got != total:
        raise RuntimeError(f"bench agent: {got} messages delivered of {total}")
    bus.flush_acks()
    bus.close()
    return elapsed * 1e6 / got, cpu * 1e6 / got


def _empty_read(url: str, ranks: int, k: int) -> float:
    bus, _ = _bus(url, ranks, k)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            bus.read_upstream(0)
        best = min(best, (time.perf_counter() - t0) * 1e5)
    bus.close()
    return best


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flodl-bus bench agent", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,256,1024", help="comma-separated world sizes")
    ap.add_argument("--ranks-per-host", type=int, default=8, help="ranks an agent folds")
    ap.add_argument(
        "--fold-items",
        type=int,
        default=0,
        help="messages a folded entry holds (default: a whole step of its host's ranks; "
        "bench scale says how many a live agent folds)",
    )
    ap.add_argument(
        "--ingest-procs",
        default="0",
        help="reader processes of the coordinator's ingest, comma-separated counts to "
        "compare (0: its own thread)",
    )
    ap.add_argument("--steps", type=int, default=8, help="pre-filled steps per rank")
    ap.add_argument("--step-ms", type=float, default=50.0, help="step time of the budget")
    ap.add_argument("--repeats", type=int, default=3, help="passes per figure (best kept)")
    ap.add_argument("--redis-url", default=None, help="an existing server (default: start one)")
    args = ap.parse_args(argv)
    counts = rank_counts(args.ranks)
    if counts is None:
        return 2
    k = args.ranks_per_host
    procs = ingest_procs_list(args.ingest_procs)
    if procs is None:
        return 2
    if k < 2 or args.steps < 1 or args.repeats < 1 or not counts or min(counts) < 1:
        print("--ranks-per-host must be 2 or more; --ranks, --steps, --repeats positive",
              file=sys.stderr)  # fmt: skip
        return 2
    server = None
    url = args.redis_url
    if url is None:
        server = RedisServer(extra_args=["--maxclients", "10000"]).start()
        url = server.url
    try:
        ping = _ping_us(url)
        for n in counts:
            budget = args.step_ms * 1000 / (2 * n)
            print(
                f"ranks {n}, {k} a host agent ({-(-n // k)} fold streams, "
                f"{args.fold_items or 'a step of its ranks,'} messages an entry), "
                f"{args.steps} steps pre-filled; PING {ping:.1f} us, budget {budget:.1f} us/msg "
                f"(step {args.step_ms:g} ms)",
                flush=True,
            )
            for j in procs:
                inf = (float("inf"), float("inf"))
                direct, folded = inf, inf
                for _ in range(args.repeats):  # passes alternate: direct, folded, ...
                    direct = min(direct, _ingest(url, n, args.steps, 1, procs=j))
                    folded = min(folded, _ingest(url, n, args.steps, k, args.fold_items, j))
                where = "on the coordinator's thread" if j == 0 else f"{j} reader processes"
                print(
                    f"  ingest per message   direct {direct[0]:7.1f} us   folded "
                    f"{folded[0]:7.1f} us ({folded[0] / direct[0]:.2f}x)   this process's CPU "
                    f"{direct[1]:.1f} -> {folded[1]:.1f} us  ({where})",
                    flush=True,
                )
            read1, readk = _empty_read(url, n, 1), _empty_read(url, n, k)
            print(
                f"  empty read           direct {read1:7.1f} us   folded {readk:7.1f} us "
                f"({readk / read1:.2f}x)",
                flush=True,
            )
    finally:
        if server is not None:
            server.stop()
            server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
