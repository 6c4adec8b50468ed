"""``flodl-bus bench params``: the CPU averaging round beside the memcpy floor.

For each model size and rank count, real rank processes run the ``cpu`` backend over
gloo on loopback, rendezvousing through a redis-server this bench starts itself. A round
is timed on every rank from ``snapshot()`` (the ``RequestParams`` handler) to the moment
the ``Update`` is injected (``update``) and to the ``SyncAck`` being ready (``ack``:
the divergence triple computed); each figure is the median over rounds of the slowest
rank. ``reduce`` is the two all-reduces alone; ``snapshot`` is what the training thread
pays (the copy into staging).
The floor is one ``memcpy`` of the same bytes (``dst.copy_(src)``), measured in this same
run, median of several.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import redis
import torch

from flodl_bus.bus.server import RedisServer
from flodl_bus.params.hosts import pin_one_host

#: Tensors the synthetic model is cut into (a model is many tensors, not one).
TENSORS = 16


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def human(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 10**6 else str(n)


def memcpy_floor_s(numel: int, repeats: int) -> float:
    src = torch.ones(numel, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    del src, dst
    return statistics.median(times)


# ----------------------------------------------------------------------------- a rank


def _barrier(r: redis.Redis, key: str, world: int, timeout: float = 120.0) -> None:
    r.incr(key)
    deadline = time.monotonic() + timeout
    while int(r.get(key) or 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench barrier {key} timed out")
        time.sleep(0.001)


def run_rank(args: argparse.Namespace) -> int:
    from flodl_bus.params.plane import ParamConfig, TorchParamPort
    from flodl_bus.protocol.messages import Update

    torch.set_num_threads(1)
    per = args.size // TENSORS
    sizes = [per] * (TENSORS - 1) + [args.size - per * (TENSORS - 1)]
    params = [torch.full((n,), float(args.rank + 1)) for n in sizes]
    control: queue.Queue[Any] = queue.Queue()
    port = TorchParamPort(
        params,
        [],
        redis_client=args.url,
        run_id=args.run,
        rank=args.rank,
        world_size=args.world,
        config=ParamConfig(backend="cpu", timeout=args.timeout),
        inject=control.put,
        publish=lambda _msg: None,
    )
    r = redis.Redis.from_url(args.url, socket_timeout=10)
    totals, acks, snaps, reduces = [], [], [], []
    try:
        port.connect()
        for rnd in range(args.warmup + args.rounds):
            _barrier(r, f"bench:{args.run}:barrier:{rnd}", args.world)
            t0 = time.perf_counter()
            port.snapshot(1)
            snap_s = time.perf_counter() - t0
            msg = control.get(timeout=args.timeout * 4)
            total_s = time.perf_counter() - t0
            if not isinstance(msg, Update):
                raise RuntimeError(f"round failed: {msg!r}")
            port.load_averaged(msg.avg)
            cpu = port.cpu
            if cpu is None or not cpu.wait_idle(args.timeout):
                raise RuntimeError("the round's SyncAck never came")
            if rnd >= args.warmup and cpu.last is not None:
                totals.append(total_s)
                acks.append(cpu.last.ack_s)
                snaps.append(snap_s)
                reduces.append(cpu.last.reduce_s)
        expected = (args.world + 1) / 2  # mean of 1..world
        if abs(params[0][0].item() - expected) > 1e-4:
            raise RuntimeError(f"wrong consensus {params[0][0].item()} != {expected}")
    finally:
        port.close()
    out = {"total": totals, "ack": acks, "snapshot": snaps, "reduce": reduces}
    print(json.dumps(out), flush=True)
    return 0


# ----------------------------------------------------------------------------- driver


def run_config(url: str, size: int, world: int, args: argparse.Namespace) -> list[Any]:
    run = f"bench-{uuid.uuid4().hex[:8]}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flodl_bus.bench.params",
                "--child",
                "--url",
                url,
                "--run",
                run,
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--size",
                str(size),
                "--rounds",
                str(args.rounds),
                "--warmup",
                str(args.warmup),
                "--timeout",
                str(args.timeout),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    results = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=args.timeout * (args.rounds + args.warmup + 4))
            if proc.returncode != 0:
                raise RuntimeError(f"rank {rank} failed ({proc.returncode}):\n{err[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flodl-bus bench params", description=__doc__)
    parser.add_argument("--sizes", default="10M,100M", help="parameter counts (10M,100M)")
    parser.add_argument("--ranks", default="2,4", help="rank counts (2,4)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per config")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--timeout", type=float, default=60.0, help="collective bound (s)")
    parser.add_argument("--redis-url", default=None, help="use this server instead")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.child:
        return run_rank(args)
    pin_one_host(os.environ)  # the rank processes inherit it: their groups stay on loopback

    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    worlds = [int(w) for w in args.ranks.split(",") if w]
    server = None if args.redis_url else RedisServer().start()
    url = args.redis_url or (server.url if server else "")
    print(
        f"CPU averaging round (snapshot -> Update) vs one memcpy of the same bytes; "
        f"{args.rounds} rounds, medians; {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    header = (
        f"{'params':>7} {'ranks':>5} {'MB':>7} {'update ms':>9} {'ack ms':>8} "
        f"{'reduce ms':>9} {'snapshot ms':>11} {'memcpy ms':>9} {'update/memcpy':>13}"
    )
    print(header)
    try:
        for size in sizes:
            for world in worlds:
                results = run_config(url, size, world, args)
                floor = memcpy_floor_s(size, repeats=max(5, args.rounds))
                # a round is done when the slowest rank has its Update
                rounds = [max(r["total"][i] for r in results) for i in range(args.rounds)]
                reduce = [max(r["reduce"][i] for r in results) for i in range(args.rounds)]
                ack = [max(r["ack"][i] for r in results) for i in range(args.rounds)]
                snaps = [s for r in results for s in r["snapshot"]]
                round_s = statistics.median(rounds)
                print(
                    f"{human(size):>7} {world:>5} {size * 4 / 1e6:>7.0f} "
                    f"{round_s * 1e3:>9.1f} {statistics.median(ack) * 1e3:>8.1f} "
                    f"{statistics.median(reduce) * 1e3:>9.1f} "
                    f"{statistics.median(snaps) * 1e3:>11.1f} {floor * 1e3:>9.1f} "
                    f"{round_s / floor:>13.1f}",
                    flush=True,
                )
    finally:
        if server is not None:
            server.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
