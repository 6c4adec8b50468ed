"""``flodl-bus bench allreduce``: our SyncNow path beside a bare all-reduce of the same bytes.

Each rank (one process per GPU, or per CPU share) forms its group through the Redis
store exactly as a rank does, then times, on the same process group and the same number
of parameters:

* ``floor``: one in-place ``allreduce`` of a flat fp32 tensor (what
  ``torch.distributed.all_reduce`` does), nothing else;
* ``sync_now``: ``CollectiveSync.sync_now`` — mass all-reduce, weighting, the parameter
  all-reduce, divergence triple and write-back.

``--ranks 1`` times SyncNow's own passes (scale, norms, pointer swap) with a collective
that moves nothing; ``--eager-norms`` turns off the fused divergence triple
(``params.fused``) to compare. Bus bandwidth follows the usual ring convention:
``bytes / t * 2 (n - 1) / n``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import torch
import torch.multiprocessing as mp

from flodl_bus.bus.server import RedisServer
from flodl_bus.params.collective import CollectiveSync
from flodl_bus.params.forming import backend_for, store_base
from flodl_bus.params.groups import SessionManager
from flodl_bus.params.hosts import pin_one_host


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(
    rank: int, world: int, url: str, run: str, numel: int, rounds: int, out_dir: str, eager: bool
) -> None:
    if eager:
        from flodl_bus.params import fused

        fused.disable()
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    sessions = SessionManager(
        url, store_base(run), rank, world, backend=backend_for(device), timeout=120.0
    )
    try:
        param = torch.full((numel,), float(rank + 1), device=device)
        sync = CollectiveSync([param], [], sessions, timeout=120.0)
        group = sessions.connect()
        flat = torch.ones(numel, device=device)
        times: dict[str, list[float]] = {"floor": [], "sync_now": []}
        for i in range(rounds + 1):  # round 0 warms up both paths
            _sync(device)
            t0 = time.perf_counter()
            group.all_reduce_sum_([flat], 120.0)
            _sync(device)
            t1 = time.perf_counter()
            sync.sync_now(steps_since_avg=rank + 1)
            _sync(device)
            t2 = time.perf_counter()
            if i:
                times["floor"].append(t1 - t0)
                times["sync_now"].append(t2 - t1)
        # The weighted mean of (1, 2, ...) with masses (1, 2, ...) is sum(k^2)/sum(k).
        expected = sum(k * k for k in range(1, world + 1)) / sum(range(1, world + 1))
        ok = abs(float(param[0]) - expected) < 1e-3
        if rank == 0:
            torch.save(
                {k: statistics.median(v) for k, v in times.items()} | {"ok": ok},
                os.path.join(out_dir, "r0.pt"),
            )
    finally:
        sessions.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flodl-bus bench allreduce", description=__doc__)
    p.add_argument("--params-m", type=float, default=100.0, help="million fp32 parameters")
    p.add_argument("--ranks", type=int, default=0, help="default: every GPU, else 2")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument(
        "--eager-norms", action="store_true", help="the divergence norms in eager passes, not fused"
    )
    args = p.parse_args(argv)
    world = args.ranks or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    if world < 1:
        print("flodl-bus bench allreduce: needs at least 1 rank", file=sys.stderr)
        return 2
    numel = int(args.params_m * 1e6)
    pin_one_host(os.environ)  # the spawned ranks inherit it: their groups stay on loopback
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    with RedisServer() as server, tempfile.TemporaryDirectory() as out:
        mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
            _rank,
            args=(world, server.url, "bench-allreduce", numel, args.rounds, out, args.eager_norms),
            nprocs=world,
            join=True,
        )
        r = torch.load(os.path.join(out, "r0.pt"))
    nbytes = numel * 4
    factor = 2 * (world - 1) / world
    print(
        f"flodl-bus bench allreduce: {args.params_m:g}M fp32 params ({nbytes / 1e9:.2f} GB), "
        f"{world} ranks, {backend}, median of {args.rounds}; torch {torch.__version__}"
    )
    for name in ("floor", "sync_now"):
        t = r[name]
        print(
            f"  {name:<9} {t * 1e3:9.2f} ms   algbw {nbytes / t / 1e9:7.1f} GB/s   "
            f"busbw {nbytes / t / 1e9 * factor:7.1f} GB/s"
        )
    ratio = r["sync_now"] / r["floor"]
    norms = "eager" if args.eager_norms else "fused where the device allows"
    print(f"  sync_now / floor {ratio:.2f}x (target at most 1.30x)   consensus exact: {r['ok']}"
          f"   divergence norms: {norms}")  # fmt: skip
    if world == 1:
        print("  (one rank: the all-reduce moves nothing; sync_now is SyncNow's own passes)")
    return 0 if r["ok"] else 1
