"""``flodl-bus bench gpu``: the host<->device copies the cpu backend lives on.

Three figures, each beside its reference from the same run:

1. pinned vs pageable bandwidth, device-to-host and host-to-device (1 GiB by default);
2. a snapshot of a ~100M-parameter model into the reused pinned staging buffers (the
   ``RequestParams`` cost) vs a pageable snapshot and vs the pinned-bandwidth floor;
3. overlap: training step time alone vs with a snapshot running on a side stream.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from flodl_bus.params.flat import FlatBuffers, FlatLayout

GIB = 1 << 30


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    times: list[float] = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _bandwidth(nbytes: int, repeats: int) -> dict[str, float]:
    n = nbytes // 4
    dev = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.float32)
    out: dict[str, float] = {}
    for name, host in (("pinned", pinned), ("pageable", pageable)):

        def d2h_copy(h: torch.Tensor = host) -> None:
            h.copy_(dev, non_blocking=True)

        def h2d_copy(h: torch.Tensor = host) -> None:
            dev.copy_(h, non_blocking=True)

        d2h = _median_ms(d2h_copy, repeats)
        h2d = _median_ms(h2d_copy, repeats)
        out[f"{name}_d2h_gbs"] = nbytes / d2h / 1e6
        out[f"{name}_h2d_gbs"] = nbytes / h2d / 1e6
    return out


def _model(params_m: int) -> nn.Module:
    width = 4096
    layers = max(1, round(params_m * 1_000_000 / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).cuda()


def _snapshot_ms(model: nn.Module, repeats: int) -> dict[str, float]:
    params = [p.detach() for p in model.parameters()]
    layout = FlatLayout(params)
    pinned = FlatBuffers(layout, torch.device("cpu"), pin=True)
    pageable = FlatBuffers(layout, torch.device("cpu"), pin=False)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    before = FlatBuffers.allocations

    def snap(buffers: FlatBuffers) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            buffers.load_from(params, non_blocking=True)
        side.synchronize()

    out = {
        "nbytes": float(layout.nbytes),
        "pinned_ms": _median_ms(lambda: snap(pinned), repeats),
        "pageable_ms": _median_ms(lambda: snap(pageable), repeats),
        "new_allocations": float(FlatBuffers.allocations - before),
    }
    return out


def _overlap(params_m: int, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    trainee = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096)).cuda()
    opt = torch.optim.SGD(trainee.parameters(), lr=1e-3)
    x = torch.randn(2048, 4096, device="cuda")
    snap_model = _model(params_m)
    params = [p.detach() for p in snap_model.parameters()]
    staging = FlatBuffers(FlatLayout(params), torch.device("cpu"), pin=True)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        trainee(x).square().mean().backward()
        opt.step()

    def run(with_snapshot: bool) -> float:
        times: list[float] = []
        for _ in range(steps):
            if with_snapshot:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    staging.load_from(params, non_blocking=True)
            t0 = time.perf_counter()
            step()
            torch.cuda.current_stream().synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            if with_snapshot:
                side.synchronize()
        return statistics.median(times)

    run(False)  # warm-up (kernels, allocator)
    alone = run(False)
    together = run(True)
    return {"step_ms": alone, "step_with_snapshot_ms": together}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flodl-bus bench gpu", description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0, help="bandwidth transfer size")
    parser.add_argument("--params-m", type=int, default=100, help="snapshot model, M params")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("flodl-bus bench gpu: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    print(
        f"flodl-bus bench gpu  torch {torch.__version__}  CUDA {torch.version.cuda}  "
        f"{props.name} ({props.total_memory / GIB:.0f} GiB)"
    )
    bw = _bandwidth(int(args.gib * GIB), args.repeats)
    print(f"\nhost<->device bandwidth, {args.gib:g} GiB, median of {args.repeats}")
    for direction in ("d2h", "h2d"):
        p, q = bw[f"pinned_{direction}_gbs"], bw[f"pageable_{direction}_gbs"]
        print(f"  {direction}  pinned {p:7.1f} GB/s   pageable {q:7.1f} GB/s   ratio {p / q:5.2f}x")

    snap = _snapshot_ms(_model(args.params_m), args.repeats)
    floor_ms = snap["nbytes"] / (bw["pinned_d2h_gbs"] * 1e6)
    print(f"\nsnapshot of a {args.params_m}M-param model ({snap['nbytes'] / 1e9:.2f} GB)")
    print(
        f"  pinned staging {snap['pinned_ms']:8.2f} ms   pageable {snap['pageable_ms']:8.2f} ms"
        f"   bandwidth floor {floor_ms:7.2f} ms   pinned/floor {snap['pinned_ms'] / floor_ms:5.2f}x"
    )
    print(f"  staging allocations after setup: {snap['new_allocations']:.0f} (reused)")

    ov = _overlap(args.params_m, args.steps)
    ratio = ov["step_with_snapshot_ms"] / ov["step_ms"]
    print(f"\noverlap: training step, median of {args.steps}")
    print(
        f"  alone {ov['step_ms']:7.2f} ms   with side-stream snapshot "
        f"{ov['step_with_snapshot_ms']:7.2f} ms   ratio {ratio:5.3f}x"
    )
    return 0
