"""``flodl-bus up``'s command line: its parser, and the command lines it gives the
coordinator and each rank (what they are told alike, and what each alone).

Kept apart from ``launch.up`` so the launcher's supervision loop and the argument
surface each stay readable on their own.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from datetime import datetime
from pathlib import Path

from flodl_bus import settings
from flodl_bus.launch.jobref import DEFAULT_JOB
from flodl_bus.options import LOG_LEVELS, OneLineParser, log_level

MODES = ("nccl-sync", "nccl-cadence", "cpu-sync", "cpu-cadence", "cpu-async")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="flodl-bus up",
        description="Start Redis (embedded unless --redis-url), a coordinator and N workers "
        "on this machine, and watch the run.",
    )
    p.add_argument("--job", default=DEFAULT_JOB, help=f"MODULE:NAME (default {DEFAULT_JOB})")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--mode", choices=MODES, default="cpu-cadence", help="default cpu-cadence")
    p.add_argument("--redis-url", help="use this Redis instead of starting one")
    p.add_argument("--epochs", type=int, help="override the job's number of epochs")
    p.add_argument("--run", help="run id (default up-<date>-<time>-<random>)")
    p.add_argument("--run-dir", help="where the record goes (default runs/<run>)")
    p.add_argument("--save-path", help="checkpoint stem (a Ctrl-C then leaves a resumable one)")
    p.add_argument("--resume", help="resume from this checkpoint stem")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=1,
        help="with --save-path: checkpoint every N epochs (default 1), so a Ctrl-C "
        "leaves one to --resume from",
    )
    p.add_argument("--eval-every", type=int, default=1, help="eval every N epochs (default 1)")
    p.add_argument(
        "--device",
        default="auto",
        help="the workers' device: cpu, cuda, cuda:N or auto (default: cuda:<rank mod GPUs> "
        "when CUDA is available, else cpu)",
    )
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="TensorBoard event files in DIR (the coordinator writes them; needs the "
        "tensorboard extra)",
    )
    p.add_argument(
        "--dashboard",
        action="store_true",
        help="serve a live web page of the run on 127.0.0.1 (its URL is printed; "
        "what flodl-bus dashboard serves, for as long as up runs)",
    )
    p.add_argument(
        "--dashboard-port",
        type=int,
        default=0,
        help="with --dashboard: the port (default 0: any free one)",
    )
    p.add_argument("--no-progress", action="store_true", help="no bars (the table still shows)")
    p.add_argument("--no-plot", action="store_true", help="skip plot.png")
    p.add_argument(
        "--require-target",
        action="store_true",
        help="exit 1 when the final metric misses the job's target_metric",
    )
    p.add_argument(
        "--log-level",
        default="info",
        type=log_level,
        choices=LOG_LEVELS,
        help="children's console log level (default info)",
    )
    settings.add_arguments(p)
    return p


def _default_run_id() -> str:
    return f"up-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flodl_bus.cli", *args]


def _shared_argv(args: argparse.Namespace, run: str, run_dir: Path) -> list[str]:
    """What the coordinator and every rank are told alike. Every process records into
    the same run directory, so replay finds all the records side by side; ranks get the
    epochs as a flag because they may read meta before the coordinator writes it."""
    argv = [
        "--run", run,
        "--job", args.job,
        "--mode", args.mode,
        "--world-size", str(args.workers),
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    if args.epochs is not None:
        argv += ["--epochs", str(args.epochs)]
    return argv


def coordinator_argv(args: argparse.Namespace, run: str, run_dir: Path) -> list[str]:
    argv = _cli("coordinator", *_shared_argv(args, run, run_dir))
    # The run settings go to the coordinator alone: it publishes the ranks' share in
    # the run's meta, where every rank reads it.
    argv += settings.argv(args)
    argv += ["--eval-every", str(args.eval_every)]
    if args.save_path:
        argv += ["--save-path", args.save_path]
        if args.checkpoint_every > 0:
            argv += ["--checkpoint-every", str(args.checkpoint_every)]
    if args.resume:
        argv += ["--resume", args.resume]
    if args.tensorboard:
        argv += ["--tensorboard", args.tensorboard]
    return argv


def worker_argv(args: argparse.Namespace, run: str, rank: int, run_dir: Path) -> list[str]:
    argv = _cli("worker", *_shared_argv(args, run, run_dir))
    argv += ["--rank", str(rank), "--log-level", args.log_level]
    if args.device != "auto":
        argv += ["--device", args.device]
    if args.save_path:
        argv += ["--save-path", args.save_path]
    return argv
