"""``flodl-bus bench latency --rtt 0.5,2,10``: ranks behind a real network delay.

For each round-trip time: a server namespace (Redis and the coordinator) and ``--groups``
rank namespaces, each on its own veth link with half the RTT of delay at each end
(``tc netem``; where the kernel lacks it, a relay in user space adds the delay:
``bench.netns``). ``bench scale`` then runs inside the server namespace with its
simulated ranks spread over the rank namespaces, and prints dispatch latency (beside the
RTT it was given and PING from the server side), epoch time beside the ideal, and the
rest of its figures. ``--partition`` cuts the last group's link once its ranks trained an
epoch and reports how long the coordinator took to declare them dead, beside the
heartbeat timeout. Needs root (``ip netns``); says why and exits 2 where it cannot run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flodl_bus.bench.netns import Topology, netem_problem, netns_problem


def run_case(
    rtt_ms: float,
    *,
    ranks: int,
    groups: int,
    loss: float = 0.0,
    partition: bool = False,
    step_ms: float = 50.0,
    steps: int = 20,
    epochs: int = 3,
    heartbeat_timeout: float = 5.0,
    timeout: float = 180.0,
) -> dict[str, Any]:
    """One run of ``bench scale`` behind ``rtt_ms``; returns its figures."""
    netem = netem_problem() is None
    if loss and not netem:
        raise RuntimeError("packet loss needs tc netem, which this kernel lacks")
    groups = min(groups, ranks)
    with Topology(groups, delay_ms=rtt_ms, loss=loss, netem=netem) as topo:
        out = Path(tempfile.mkdtemp(prefix="flodl-latency-")) / "scale.json"
        how = "tc netem" if netem else "user-space relay (no sch_netem)"
        argv = [
            *topo.exec_prefix(topo.srv), sys.executable, "-m", "flodl_bus.bench.scale",
            "--ranks", str(ranks), "--procs", str(groups), "--step-ms", str(step_ms),
            "--steps", str(steps), "--epochs", str(epochs),
            "--heartbeat-timeout", str(heartbeat_timeout), "--timeout", str(timeout),
            "--rank-netns", ",".join(f"{ns}={h}" for ns, h in zip(topo.ranks, topo.hosts,
                                                                   strict=True)),
            "--network", f"{groups} namespaces, {rtt_ms:g} ms RTT, loss {loss:g} via {how}",
            "--json", str(out),
        ]  # fmt: skip
        if not netem and rtt_ms:
            argv += ["--relay-ms", str(rtt_ms / 2)]
        if partition:
            per = -(-ranks // groups)
            last = (len(range(0, ranks, per)) - 1) * per
            argv += ["--cut", " ".join(topo.cut_command(groups - 1)), "--cut-rank", str(last)]
        got = subprocess.run(argv, capture_output=True, text=True, check=False)
        sys.stdout.write(got.stdout)
        if got.returncode != 0:
            raise RuntimeError(f"bench scale failed behind {rtt_ms} ms: {got.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(out.read_text())[0]
        out.unlink()
        out.parent.rmdir()
        return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flodl-bus bench latency", description=__doc__.split("\n")[0])
    ap.add_argument("--rtt", default="0.5,2,10", help="round-trip times in ms")
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--groups", type=int, default=4, help="rank namespaces (one process each)")
    ap.add_argument("--loss", type=float, default=0.0, help="packet loss fraction (netem)")
    ap.add_argument(
        "--partition", action="store_true", help="one more run: the last group cut off mid-run"
    )
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if (why := netns_problem()) is not None:
        print(f"bench latency cannot run here: {why}", file=sys.stderr)
        return 2
    try:
        rtts = [float(x) for x in args.rtt.split(",") if x]
    except ValueError:
        print(f"--rtt: expected numbers like 0.5,2,10, got {args.rtt!r}", file=sys.stderr)
        return 2
    if (why := netem_problem()) is not None:
        print(f"note: {why}; the delay comes from a user-space relay", flush=True)
    results = []
    # the sweep, then (--partition) one more run at the largest RTT with a group cut off:
    # its epoch times hold the detection wait, so it is kept out of the sweep
    cases = [(rtt, False) for rtt in rtts] + ([(max(rtts), True)] if args.partition else [])
    for rtt, cut in cases:
        r = run_case(
            rtt,
            ranks=args.ranks,
            groups=args.groups,
            loss=args.loss,
            partition=cut,
            step_ms=args.step_ms,
            steps=args.steps,
            epochs=args.epochs,
            heartbeat_timeout=args.heartbeat_timeout,
        )
        results.append({"rtt_ms": rtt, **r})
    print("\n  RTT ms | dispatch p50 / p99 ms | epoch vs ideal | declared dead after cut")
    for r in results:
        dead = r["dead_after_cut_s"]
        print(
            f"  {r['rtt_ms']:6g} | {r['dispatch_p50_ms']:7.2f} / {r['dispatch_p99_ms']:7.2f}"
            f"    | {r['epoch_s']:.2f} / {r['ideal_s']:.2f} s  | "
            + (
                f"{dead:.2f} s (timeout {r['heartbeat_timeout_s']:g} s)"
                if dead is not None
                else "-"
            )
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
