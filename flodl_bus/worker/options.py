"""``flodl-bus worker``'s command line: parsed and checked before torch is imported.

``flodl-bus worker --help`` and every refusal of a flag answer at once; only a command
line that passes here imports the rank (and torch, seconds on a loaded machine).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from flodl_bus.bus.connection import add_url_argument
from flodl_bus.bus.keys import InvalidRunId, RunKeys
from flodl_bus.options import LOG_LEVELS, ConfigError, OneLineParser, log_level

PROG = "flodl-bus worker"
MODES = ("nccl-sync", "nccl-cadence", "cpu-sync", "cpu-cadence", "cpu-async")
DEFAULT_MODE = "nccl-cadence"
DEFAULT_JOB = "flodl_bus.examples.digits:job"
#: A training script started as a rank (``flodl-bus up --script``) finds its worker
#: command line here, as a JSON list of flags: its ``flodl_bus.Rank`` joins the run with
#: them exactly as ``flodl-bus worker`` would (the script's own argv stays its own).
ENV_WORKER_ARGV = "FLODL_BUS_WORKER_ARGV"
#: ``--rank-io``'s choices: the rank's Redis work on threads of the training process, or
#: in a process of its own (``agent.rank_io``: the training process then runs one busy
#: Python thread; issue 27)
RANK_IO = ("threads", "process")
#: ``--rank-io``'s default when the flag is not given (``up`` and ``bench`` pass the
#: environment on to every rank)
ENV_RANK_IO = "FLODL_RANK_IO"


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG,
        description="Run one rank of a run.",
        epilog="Credentials: in the URL, or FLODL_REDIS_USERNAME / FLODL_REDIS_PASSWORD; "
        "the run secret from FLODL_RUN_SECRET, else from Redis.",
    )
    required = p.add_argument_group("required")
    required.add_argument("--run", required=True, help="run id shared with the coordinator")
    p.add_argument(
        "--rank", type=int, help="this rank (0..world_size-1); omit to dial in and be assigned"
    )
    p.add_argument("--world-size", type=int, help="number of ranks (required with --rank)")
    p.add_argument(
        "--job",
        help="MODULE:NAME of the flodl_bus Job to train (default: the coordinator's job, "
        "else the digits example)",
    )
    add_url_argument(p)
    p.add_argument(
        "--mode",
        choices=MODES,
        help=f"averaging mode; must match the coordinator's (default: the coordinator's, "
        f"else {DEFAULT_MODE})",
    )
    p.add_argument(
        "--save-path",
        help="checkpoint stem (bundle, consensus and Checkpoint files; default: the coordinator's)",
    )
    p.add_argument(
        "--resume",
        help="start from the consensus model <STEM>.model.pt (default: the coordinator's --resume)",
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the coordinator's answer when dialing in (default 300)",
    )
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds (default 1)")
    p.add_argument(
        "--coord-liveness-timeout",
        type=float,
        default=30.0,
        help="stop when the coordinator is silent this many seconds (default 30)",
    )
    p.add_argument(
        "--secret-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the coordinator to publish the run secret (default 30)",
    )
    p.add_argument(
        "--run-dir",
        help="record every dispatch to RUN_DIR/rank<r>.jsonl (default runs/<run>, "
        "beside the coordinator's record when they share a disk)",
    )
    p.add_argument(
        "--lr-scale-ratio",
        type=float,
        help="LR x (1 + (world_size - 1) x RATIO) (default: the coordinator's, else 0)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        help="the run's epochs, which size the job's LR schedule (default: the "
        "coordinator's, else the job's)",
    )
    p.add_argument("--no-record", action="store_true", help="do not record dispatches")
    p.add_argument(
        "--rank-io",
        choices=RANK_IO,
        default=os.environ.get(ENV_RANK_IO) or "threads",
        help="where the rank's Redis work runs: threads of the training process, or "
        f"process, a process of its own (default {ENV_RANK_IO}, else threads)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, cuda:N, or auto (default: cuda:<rank mod GPUs> when CUDA is "
        "available, else cpu)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        type=log_level,
        choices=LOG_LEVELS,
        help="console log level (default info)",
    )
    return p


def check(args: argparse.Namespace) -> None:
    if args.world_size is not None and args.world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, got {args.world_size}")
    if args.rank is not None and args.world_size is None:
        raise ConfigError("--rank needs --world-size N (or omit --rank to dial in)")
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        raise ConfigError(
            f"--rank {args.rank} is outside --world-size {args.world_size}: "
            f"use a rank in 0..{args.world_size - 1}"
        )
    if args.join_timeout <= 0:
        raise ConfigError("--join-timeout must be positive")
    if args.rank_io not in RANK_IO:
        # argparse checks a flag's choices, not a default taken from the environment
        raise ConfigError(
            f"--rank-io (or {ENV_RANK_IO}) must be one of {', '.join(RANK_IO)}, "
            f"got {args.rank_io!r}"
        )
    if args.epochs is not None and args.epochs < 0:
        raise ConfigError(f"--epochs must be 0 or more, got {args.epochs}")
    if args.heartbeat_interval <= 0:
        raise ConfigError("--heartbeat-interval must be positive")
    if args.coord_liveness_timeout <= args.heartbeat_interval:
        raise ConfigError(
            "--coord-liveness-timeout must exceed --heartbeat-interval, or a healthy "
            "coordinator would look dead"
        )
    try:
        RunKeys(args.run)
    except InvalidRunId as exc:
        raise ConfigError(f"--run: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """``flodl-bus worker``: the command line first (no torch), then the rank."""
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        check(args)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    from flodl_bus.worker import cli

    return cli.run(args)
