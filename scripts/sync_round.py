"""What one SyncNow costs a rank, collective and bookkeeping, on a job's real model.

    PYTHONPATH=TREE python scripts/sync_round.py [--job MODULE:NAME] [--rounds N]

A world of one (a one-rank NCCL group on a GPU, gloo on a CPU, formed through a
redis-server this script starts on a loopback port), so what is timed is the rank's own
work per round, with no peer to wait for: ``TorchParamPort.sync_now`` (the weighted
collective, the divergence norms, the pointer swap, the kept consensus) and, beside it,
``CollectiveSync.sync_now`` alone. Medians of ``--rounds`` rounds, the device synced
before and after each. Run it with two trees in turn (``PYTHONPATH``) to compare code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from flodl_bus.bus.server import RedisServer
from flodl_bus.job import load_job
from flodl_bus.params.hosts import pin_one_host
from flodl_bus.params.plane import ParamConfig, TorchParamPort


def _median_ms(fn: Callable[[], object], device: torch.device, rounds: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(5):
        fn()
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--job", default="flodl_bus.examples.cifar_resnet:job")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--eager", action="store_true", help="the eager norms, not params.fused")
    args = p.parse_args()
    if args.eager:
        from flodl_bus.params import fused

        fused.disable()
    job = load_job(args.job)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model = job.build_model().to(device)
    params, buffers = list(model.parameters()), list(model.buffers())
    pin_one_host(os.environ)
    with RedisServer() as server:
        port = TorchParamPort(
            params,
            buffers,
            redis_client=server.url,
            run_id="sync-round",
            rank=0,
            world_size=1,
            config=ParamConfig(backend="nccl"),
            inject=lambda *a: None,
            publish=lambda *a: None,
        )
        port.connect()
        whole = _median_ms(lambda: port.sync_now(1), device, args.rounds)
        assert port._sync is not None
        inner = port._sync
        alone = _median_ms(lambda: inner.sync_now(1), device, args.rounds)
    n = sum(t.numel() for t in params)
    print(
        f"{args.job}: {len(params)} params ({n / 1e6:.1f}M), {len(buffers)} buffers, "
        f"{device}, torch {torch.__version__}; median of {args.rounds} rounds"
        f"{' (eager norms)' if args.eager else ''}\n"
        f"  rank's SyncNow (TorchParamPort.sync_now)   {whole:7.3f} ms\n"
        f"  of which the collective (CollectiveSync)    {alone:7.3f} ms"
    )


if __name__ == "__main__":
    main()
