"""``flodl-bus bench train``: real training runs under the bus beside their references.

Contenders, each in fresh processes, on the same job, data, epochs and eval cadence:

1. ``plain``: one process, no bus (``baselines.plain_loop``), given one rank's share of
   the host's cores and the rank's data path;
2. ``bus MODE xN``: ``flodl-bus up`` with ``--workers N`` and each of ``--modes``;
3. ``ddp xN`` (``--ddp``): tuned ``DistributedDataParallel`` on as many ranks.

Each contender runs ``--repeats`` times (the order rotates per repeat so drift spreads
over all) and the table shows medians: training time to the fixed epochs (first step to
the end: process start, imports and data building are excluded on every side; the evals
of the cadence are inside every clock, as they are in a run), time to the target metric
(``--target``, default the job's ``target_metric``: the end of the first epoch whose eval
reached it, evals every ``--eval-every`` epochs), the final metric, the averaging rounds
(ours) or gradient all-reduces (DDP), ms per step per process, and the ratios to DDP and
to the plain loop.

``--slow-rank R --slow-factor F`` makes rank R of the bus and DDP runs about F times
slower per step (extra GPU work, or CPU work on a CPU; ``bench.slow``); the slowdown each
run really had is measured on that rank and printed, with the share of the batches each
bus rank trained (beside the share ElChe's counts planned) and the ideal time of a run
that shares work by speed (the plain loop's time over 1 + 1/F).

Below the table: where each contender's rank time went (``bench.breakdown``, from the
ranks' records) and how long each bus contender's averaging rounds took and where
(``bench.rounds``, from the coordinator's record).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flodl_bus import settings
from flodl_bus.bench import breakdown, rounds
from flodl_bus.bench.breakdown import mean_of, run_breakdowns
from flodl_bus.bench.idle import describe, idle_of_run
from flodl_bus.bench.rounds import RoundPhases, rounds_of_run
from flodl_bus.job import Job, load_job
from flodl_bus.record.dispatch import fresh_run_dir
from flodl_bus.record.log import read_records
from flodl_bus.worker.host import thread_share, usable_cores

_PLAIN = """
import json, sys, torch
from flodl_bus.bench.baselines import plain_loop
from flodl_bus.job import load_job
if int(sys.argv[4]):  # 0: as the environment says (OMP_NUM_THREADS set by the caller)
    torch.set_num_threads(int(sys.argv[4]))
job = load_job(sys.argv[1])
r = plain_loop(job, sys.argv[2], int(sys.argv[3]) or None, eval_every=int(sys.argv[5]))
print(json.dumps({"wall": r.wall_s, "samples": r.samples, "steps": r.steps,
                  "metric": r.metric, "evals": r.evals, "parts": r.parts,
                  "threads": None if r.threads is None else [r.threads]}))
"""

_DDP = """
import json, sys
from flodl_bus.bench.baselines import ddp_loop
r = ddp_loop(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "cuda", int(sys.argv[4]) or None,
             eval_every=int(sys.argv[5]))
print(json.dumps({"wall": r.wall_s, "samples": r.samples, "steps": r.steps,
                  "metric": r.metric, "collectives": r.collectives, "evals": r.evals,
                  "parts": r.parts, "threads": None if r.threads is None else [r.threads]}))
"""


def _python(code: str, env: dict[str, str], *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], check=False, capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        raise SystemExit(
            f"bench train: a baseline failed ({out.returncode}):\n{out.stderr[-3000:]}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _to_target(evals: Sequence[Sequence[Any]], target: float | None) -> tuple[float, int] | None:
    """(training s, epoch) at the end of the first epoch whose eval reached ``target``."""
    if target is None:
        return None
    for epoch, at, metric in evals:
        if metric is not None and metric >= target:
            return float(at), int(epoch)
    return None


def _up_command(args: argparse.Namespace, job: str, mode: str, run_dir: Path) -> list[str]:
    """The ``up`` of one bus run; ``--up-args`` go last, so they win over ours."""
    cmd = [
        sys.executable, "-m", "flodl_bus.cli", "up", "--job", job,
        "--workers", str(args.workers), "--mode", mode, "--run-dir", str(run_dir),
        "--no-progress", "--no-plot", "--eval-every", str(args.eval_every),
    ]  # fmt: skip
    if args.lr_scale_ratio is not None:
        cmd += ["--lr-scale-ratio", repr(args.lr_scale_ratio)]
    if args.epochs:
        cmd += ["--epochs", str(args.epochs)]
    if args.device == "cpu":  # every contender on the CPU, on a GPU host too
        cmd += ["--device", "cpu"]
    return cmd + shlex.split(args.up_args)


def _bus(
    args: argparse.Namespace, job: str, mode: str, run_dir: Path, env: dict[str, str]
) -> dict[str, Any]:
    cmd = _up_command(args, job, mode, run_dir)
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(
            f"bench train: {mode} run failed ({out.returncode}); record in {run_dir}:\n"
            f"{out.stdout[-2000:]}{out.stderr[-2000:]}"
        )
    records = read_records(run_dir / "up.jsonl")
    first = next(r["after_s"] for r in records if r.get("event") == "first_step")
    rows = [r for r in records if r.get("event") == "epoch"]
    at_epoch = {int(r["epoch"]): float(r["at"]) - first for r in rows}
    metrics = {int(r["epoch"]): r.get("metric") for r in rows}
    for r in records:
        if r.get("event") == "late_eval":
            metrics[int(r["epoch"])] = r["metric"]
    evals = [(e, at_epoch[e], m) for e, m in sorted(metrics.items()) if m is not None]
    summary = next(r for r in records if r.get("event") == "summary")
    wall = rows[-1]["at"] - first
    idle = idle_of_run(run_dir, args.workers) if args.workers > 1 else None
    ranks = run_breakdowns(run_dir, args.workers)
    phases = rounds_of_run(run_dir)
    return {
        "parts": None if ranks is None else mean_of(ranks),
        "idle": None if idle is None else describe(idle, wall),
        "round_phases": None if phases is None else dataclasses.asdict(phases),
        "wall": wall,
        # every rank's batches: the run's samples, whatever its epochs
        "samples": summary["batches"] * load_job(args.job).batch_size,
        "steps": summary["batches"],
        "metric": summary["final_metric"],
        "collectives": summary["syncs"],
        "evals": evals,
        **_shares(run_dir, args.workers),
        "threads": _threads_kept(run_dir, args.workers),
    }


#: a rank's console line once it sized its threads (``worker.threads``)
_SIZED = re.compile(r"rank (\d+): torch threads (\d+) \(sized to the work")


def _threads_kept(run_dir: Path, workers: int) -> list[int | None] | None:
    """Per rank, the thread count it kept after sizing them to the work (its log); None
    where no rank sized them (a count asked for, a GPU, lockstep)."""
    kept: list[int | None] = [None] * workers
    for log in run_dir.rglob("rank*.log"):
        for m in _SIZED.finditer(log.read_text(errors="replace")):
            rank = int(m.group(1))
            if rank < workers:
                kept[rank] = int(m.group(2))
    return kept if any(k is not None for k in kept) else None


def _counts(kept: list[int | None]) -> str:
    return "/".join("-" if k is None else str(k) for k in kept)


def _shares(run_dir: Path, workers: int) -> dict[str, list[float] | None]:
    """Per rank: ``shares``, the share of the run's batches it trained (``samples_r*``
    summed over the epochs), and ``planned_shares``, the share ElChe's counts planned
    (``batch_share_r*``, the median over the epochs). They differ: counts lag a speed
    change and start equal, and a pool dispatch or a bridge lets the fast rank train
    beyond its count (``metrics.csv``; both None without one)."""
    found = sorted(run_dir.rglob("metrics.csv"))
    if not found:
        return {"shares": None, "planned_shares": None}
    with found[0].open() as f:
        rows = list(csv.DictReader(f))
    trained = [sum(float(row.get(f"samples_r{r}") or 0.0) for row in rows) for r in range(workers)]
    total = sum(trained)
    planned = []
    for r in range(workers):
        vals = [float(row[f"batch_share_r{r}"]) for row in rows if row.get(f"batch_share_r{r}")]
        planned.append(statistics.median(vals) if vals else float("nan"))
    shares = [t / total if total else float("nan") for t in trained]
    return {"shares": shares, "planned_shares": planned}


def _round_phases(per_run: Sequence[dict[str, Any] | None]) -> RoundPhases | None:
    """The runs' round phases, each the median over the runs."""
    got = [p for p in per_run if p is not None]
    if not got:
        return None
    snaps = [p["snapshots_s"] for p in got if p["snapshots_s"] is not None]
    closes = [p["close_s"] for p in got if p["close_s"] is not None]
    return RoundPhases(
        rounds=int(statistics.median(p["rounds"] for p in got)),
        round_s=statistics.median(p["round_s"] for p in got),
        snapshots_s=statistics.median(snaps) if snaps else None,
        reduce_s=statistics.median(p["reduce_s"] for p in got),
        close_s=statistics.median(closes) if closes else None,
    )


def _parts(per_run: Sequence[dict[str, float] | None]) -> dict[str, float] | None:
    got = [p for p in per_run if p]
    return breakdown.median_of(got) if got else None


def _median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _median_each(per_run: Sequence[Sequence[float] | None]) -> list[float] | None:
    """Element-wise median of per-rank lists (runs without one are left out)."""
    got = [v for v in per_run if v]
    return [statistics.median(col) for col in zip(*got, strict=True)] if got else None


def _fmt(value: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flodl-bus bench train", description=__doc__)
    p.add_argument("--job", default="flodl_bus.examples.digits:job")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--modes",
        default="nccl-cadence",
        help="comma-separated bus modes (e.g. nccl-cadence,nccl-sync)",
    )
    p.add_argument("--mode", dest="modes", help="one bus mode (the same as --modes MODE)")
    p.add_argument("--epochs", type=int, default=0, help="override the job's epochs")
    p.add_argument("--eval-every", type=int, default=1, help="eval cadence in epochs")
    p.add_argument("--target", type=float, help="target metric (default: the job's)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each contender (medians)")
    p.add_argument(
        "--device",
        default="auto",
        help="auto (a GPU per rank, and cuda:0 for the plain loop, where CUDA is), "
        "or cpu: every contender on the CPU",
    )
    p.add_argument("--ddp", action="store_true", help="also run torch DDP on --workers ranks")
    p.add_argument("--no-plain", action="store_true", help="skip the plain loop")
    p.add_argument("--slow-rank", type=int, help="make this rank slower (bus and DDP runs)")
    p.add_argument("--slow-factor", type=float, default=2.0, help="how much slower (> 1)")
    p.add_argument(
        "--lr-scale-ratio",
        type=float,
        default=None,
        help="passed to the bus run (default: the job's Job.lr_scale_ratio, else flodl's 1.0)",
    )
    p.add_argument(
        "--up-args",
        default="",
        help="run settings for every bus run's up, e.g. --up-args='--bridges false'",
    )
    p.add_argument("--run-dir", help="keep the bus runs' records here")
    p.add_argument("--json", help="write every run and the medians here")
    return p


def lr_line(job: Job, flag: float | None, workers: int) -> str:
    """The LR each contender trains at, for the header: the bus ranks scale the job's by
    flodl's rule at the ratio a run resolves (``settings.resolve``: the flag, else the
    job's, else flodl's) where DDP and the plain loop do not, and a comparison of their
    times to target reads that way."""
    asks = job.knob_defaults()
    ratio = settings.resolve(argparse.Namespace(knob_lr_scale_ratio=flag), asks)["lr_scale_ratio"]
    scale = settings.lr_scale(ratio, workers)
    if scale == 1.0:
        return "LR: every contender at the job's"
    whose = (
        "--lr-scale-ratio"
        if flag is not None
        else "the job's ratio"
        if "lr_scale_ratio" in asks
        else "flodl's ratio"
    )
    return (
        f"LR: the bus ranks at the job's x{scale:g} ({whose} {ratio:g}, unless --up-args "
        "gives another); the plain loop and DDP at the job's"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.workers < 1 or args.repeats < 1 or args.eval_every < 1:
        p.error("--workers, --repeats and --eval-every must be at least 1")
    if args.slow_rank is not None and not (0 <= args.slow_rank < args.workers):
        p.error(f"--slow-rank must be a rank of 0..{args.workers - 1}")
    if args.slow_rank is not None and args.slow_factor <= 1.0:
        p.error("--slow-factor must be above 1")
    if args.lr_scale_ratio is not None and not args.lr_scale_ratio >= 0.0:
        p.error("--lr-scale-ratio must be 0 or more")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    import torch

    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda and torch.cuda.device_count() < args.workers:
        p.error(f"{args.workers} workers need {args.workers} GPUs; this host has "
                f"{torch.cuda.device_count()}")  # fmt: skip
    device = ("cuda:0" if cuda else "cpu") if args.device == "auto" else args.device
    job = load_job(args.job)
    target = args.target if args.target is not None else job.target_metric
    epochs = args.epochs or job.num_epochs
    root = Path(args.run_dir or tempfile.mkdtemp(prefix="flodl-bench-train-"))
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared hosts)
    env.pop("FLODL_RUN_SECRET", None)
    slow_env = dict(env)
    run_job = args.job
    if args.slow_rank is not None:
        run_job = "flodl_bus.bench.slow:job"
        slow_env.update(
            FLODL_BENCH_JOB=args.job,
            FLODL_SLOW_RANK=str(args.slow_rank),
            FLODL_SLOW_FACTOR=repr(args.slow_factor),
        )
    cores = usable_cores()
    # One rank's share, by the rule every rank follows (FLODL_NUM_THREADS, else the
    # launcher's OMP_NUM_THREADS, else the cores over the ranks of the host).
    threads = thread_share({**env, "LOCAL_WORLD_SIZE": str(args.workers)}, cores) or 0
    where = f"{torch.cuda.device_count()} GPU(s), CUDA {torch.version.cuda}" if cuda else "CPU"
    print(
        f"flodl-bus bench train: {args.job}, {args.workers} worker(s), {epochs} epochs, "
        f"eval every {args.eval_every}, target {target}; {where}, {cores} cores, "
        f"{threads or os.environ.get('OMP_NUM_THREADS')} torch threads per rank, "
        f"torch {torch.__version__}"
    )
    if args.slow_rank is not None:
        print(f"rank {args.slow_rank} slowed about {args.slow_factor:g}x (bus and DDP runs)")
    print(lr_line(job, args.lr_scale_ratio, args.workers))
    print("command: flodl-bus bench train " + shlex.join(list(argv or sys.argv[1:])))

    contenders: list[str] = [] if args.no_plain else ["plain"]
    contenders += [f"bus {m}" for m in modes]
    if args.ddp and args.workers > 1:
        contenders.append("ddp")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    for rep in range(args.repeats):
        order = contenders[rep % len(contenders) :] + contenders[: rep % len(contenders)]
        for c in order:
            report = root / f"slow-{c.replace(' ', '-')}-{rep}.json"
            senv = dict(slow_env, FLODL_SLOW_REPORT=str(report))
            if c == "plain":
                r = _python(_PLAIN, env, args.job, device, str(epochs), str(threads),
                            str(args.eval_every))  # fmt: skip
            elif c == "ddp":
                r = _python(_DDP, senv, run_job, str(args.workers), "cuda" if cuda else "cpu",
                            str(epochs), str(args.eval_every))  # fmt: skip
            else:
                mode = c.split(" ", 1)[1]
                # A run dir that holds an earlier run (the same --run-dir again) would
                # send ``up`` to a sibling and this bench to the old records.
                bus_dir = fresh_run_dir(root / f"{mode}-{rep}", "coordinator")
                r = _bus(args, run_job, mode, bus_dir, senv)
            if report.exists():
                r["slowdown"] = json.loads(report.read_text()).get("slowdown")
            r["to_target"] = _to_target(r.get("evals", ()), target)
            runs[c].append(r)
            tt = r["to_target"]
            print(
                f"  run {rep + 1}/{args.repeats} {c:<18} train {r['wall']:7.2f} s  "
                f"to target {'-' if tt is None else f'{tt[0]:.2f} s (epoch {tt[1]})'}  "
                f"metric {r['metric']}"
                + (f"  threads {_counts(r['threads'])}" if r.get("threads") else ""),
                flush=True,
            )

    names = {c: ("plain x1" if c == "plain" else f"{c} x{args.workers}") for c in contenders}
    med: dict[str, dict[str, Any]] = {}
    for c, rs in runs.items():
        per_proc_steps = (
            rs[0]["steps"] if c == "plain" else rs[0]["steps"] / (1 if c == "ddp" else args.workers)
        )
        wall = _median([r["wall"] for r in rs])
        reached = [r["to_target"] for r in rs]
        med[c] = {
            "wall": wall,
            "to_target": _median([t[0] if t else None for t in reached]),
            "reached": sum(t is not None for t in reached),
            "metric": _median([r["metric"] for r in rs]),
            "rounds": _median([r.get("collectives", 0) for r in rs]),
            "ms_step": None if wall is None else wall / max(per_proc_steps, 1) * 1000.0,
            "slowdown": _median([r.get("slowdown") for r in rs]),
            "shares": _median_each([r.get("shares") for r in rs]),
            "planned_shares": _median_each([r.get("planned_shares") for r in rs]),
        }
    ddp = med.get("ddp")
    plain = med.get("plain")
    print(f"\nmedians of {args.repeats} run(s) each")
    print(
        f"{'run':<24}{'train s':>9}{'to target s':>13}{'reached':>9}{'metric':>8}"
        f"{'rounds':>8}{'ms/step':>9}{'vs ddp':>8}{'vs plain':>9}"
    )
    for c, m in med.items():
        vs_ddp = None
        if ddp is not None:
            a, b = m["to_target"], ddp["to_target"]
            vs_ddp = a / b if a is not None and b else None
        vs_plain = m["wall"] / plain["wall"] if plain and plain["wall"] else None
        print(
            f"{names[c]:<24}{_fmt(m['wall'], '.2f', 9)}{_fmt(m['to_target'], '.2f', 13)}"
            f"{m['reached']:>6}/{args.repeats:<2}{_fmt(m['metric'], '.4f', 8)}"
            f"{_fmt(m['rounds'], '.0f', 8)}{_fmt(m['ms_step'], '.2f', 9)}"
            f"{_fmt(vs_ddp, '.3f', 7)}x{_fmt(vs_plain, '.3f', 8)}x"
        )
    print("(vs ddp: time to target over DDP's; vs plain: training time over the plain loop's)")
    if args.slow_rank is not None:
        for c, m in med.items():
            if c == "plain":
                continue
            share_s = "".join(
                f" {label} " + " / ".join(f"{s:.2f}" for s in m[key])
                for key, label in (("shares", "work shares"), ("planned_shares", "(ElChe's counts"))
                if m.get(key)
            )
            share_s += ")" if m.get("planned_shares") else ""
            print(f"  {names[c]}: measured slowdown of rank {args.slow_rank} "
                  f"{_fmt(m['slowdown'], '.2f', 4)}x{share_s}")  # fmt: skip
        f = next((m["slowdown"] for m in med.values() if m["slowdown"]), args.slow_factor)
        if plain is not None and args.workers == 2:
            ideal = plain["wall"] / (1.0 + 1.0 / f)
            print(f"  ideal two-rank time with one rank {f:.2f}x slower (shares by speed): "
                  f"{ideal:.2f} s = plain {plain['wall']:.2f} s / (1 + 1/{f:.2f})")  # fmt: skip
    plain_parts = _parts([r.get("parts") for r in runs.get("plain", ())])
    print(
        "\nwhere a rank's time goes (seconds, medians of the runs, mean of the ranks; "
        "bench.breakdown):"
    )
    for c, rs in runs.items():
        parts = _parts([r.get("parts") for r in rs])
        if parts is not None and c != "plain":
            print(breakdown.describe(names[c], parts, plain_parts))
        elif parts is not None and c == "plain" and len(runs) == 1:
            print(breakdown.describe(names[c], parts, None))
    phased = {c: _round_phases([r.get("round_phases") for r in rs]) for c, rs in runs.items()}
    if any(p is not None for p in phased.values()):
        print("\nhow long a round takes, and where (bench.rounds):")
    for c, phases in phased.items():
        if phases is not None:
            print(rounds.describe(names[c], phases))
    for c, rs in runs.items():
        if rs and rs[0].get("idle"):
            print(f"  {names[c]}, run 1: " + "\n".join(rs[0]["idle"]))
    print(f"records in {root}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "target": target, "runs": runs, "medians": med}, indent=1
            )
        )
    return 0
