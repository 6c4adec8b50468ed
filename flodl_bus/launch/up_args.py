"""``flodl-bus up``'s command line: its parser, and the command lines it gives the
coordinator and each rank (what they are told alike, and what each alone).

Kept apart from ``launch.up`` so the launcher's supervision loop and the argument
surface each stay readable on their own.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from flodl_bus import settings
from flodl_bus.bus.keys import InvalidRunId, RunKeys
from flodl_bus.coordinator.cli_args import ingest_procs_type
from flodl_bus.launch.jobref import DEFAULT_JOB, check_job_ref
from flodl_bus.options import LOG_LEVELS, OneLineParser, log_level
from flodl_bus.worker.host import check_thread_env
from flodl_bus.worker.options import ENV_WORKER_ARGV

MODES = ("nccl-sync", "nccl-cadence", "cpu-sync", "cpu-cadence", "cpu-async")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="flodl-bus up",
        description="Start Redis (embedded unless --redis-url), a coordinator and N workers "
        "on this machine, and watch the run.",
    )
    p.add_argument("--job", help=f"MODULE:NAME (default {DEFAULT_JOB})")
    p.add_argument(
        "--script",
        metavar="PATH",
        help="instead of --job: start PATH as each rank, torchrun-like (a training script "
        "that keeps its own loop in a flodl_bus.Rank); what follows PATH is its own arguments",
    )
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
        "--ingest-procs",
        type=ingest_procs_type,
        default=None,
        metavar="K|auto",
        help="the coordinator reads the ranks' upstream in K reader processes (0: on its "
        "own thread; default auto: readers only for hundreds of ranks on a many-core host; "
        "see `flodl-bus coordinator --help`)",
    )
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


def split_script(given: Sequence[str]) -> tuple[list[str], list[str]]:
    """``up``'s own flags, and the script's arguments: everything after ``--script
    PATH`` belongs to the script, as everything after the script does for torchrun."""
    for i, tok in enumerate(given):
        if tok == "--script":
            return list(given[: i + 2]), list(given[i + 2 :])
        if tok.startswith("--script="):
            return list(given[: i + 1]), list(given[i + 1 :])
    return list(given), []


def check_script(args: argparse.Namespace) -> str | None:
    """Why ``--script`` (with ``--job``) cannot run, in one line; None when it can. The
    job's default is filled in here, once it is known that no script replaces it."""
    if args.script is None:
        if args.job is None:
            args.job = DEFAULT_JOB
        return None
    if args.job is not None:
        return "--job and --script exclude each other: train a Job or a script"
    if not Path(args.script).is_file():
        return f"--script {args.script!r}: no such file"
    # Absolute: the coordinator and the ranks find it whatever their working directory.
    args.script = str(Path(args.script).resolve())
    return None


def check_args(args: argparse.Namespace, given: Sequence[str]) -> str | None:
    """Why ``up`` cannot start with these arguments, in one line (without the command's
    prefix); None when it can. Everything a flag, the ``--config`` file or the job can
    get wrong fails here, before anything starts."""
    if args.config:
        try:
            _launch_keys_from_file(args, given)
        except (settings.SettingsError, ValueError) as exc:
            return str(exc)
    if args.workers < 1:
        return "--workers must be at least 1"
    try:
        # What every rank would refuse (a thread count or policy it cannot read): said
        # once here, not as each rank's failure after everything started.
        check_thread_env(os.environ)
    except ValueError as exc:
        return str(exc)
    if args.epochs is not None and args.epochs < 1:
        return "--epochs must be at least 1"
    if args.tensorboard:
        from flodl_bus.coordinator.metrics import TensorBoardScalars

        why = TensorBoardScalars.available()
        if why is not None:
            return why
    try:
        knobs = settings.resolve(args)
    except settings.SettingsError as exc:
        return str(exc)
    world_wrong = settings.world_mismatch(knobs, args.workers)
    if world_wrong is not None:
        return world_wrong
    bad_job = check_script(args) or (None if args.script else check_job_ref(args.job))
    if bad_job is not None:
        return bad_job
    if args.run is not None:
        try:
            RunKeys(args.run)
        except InvalidRunId as exc:
            return f"--run: {exc}"
    return None


def _launch_keys_from_file(args: argparse.Namespace, given: Sequence[str]) -> None:
    """``--config``'s launch keys (job or script and its arguments, mode, workers,
    epochs, eval_every, device) for the flags not given: a run can live in one file, and
    a flag still beats it; ``--job`` or ``--script`` beats the file's job or script."""
    flags = {tok.split("=", 1)[0] for tok in given if tok.startswith("--")}
    trains = {"job", "script", "script_args"}
    for key, value in settings.read_launch(args.config).items():
        if key in trains and flags & {"--job", "--script"}:
            continue
        if f"--{key.replace('_', '-')}" in flags:
            continue
        if key == "mode" and value not in MODES:
            choices = ", ".join(MODES)
            raise ValueError(f"--config {args.config}: mode {value!r}; use one of {choices}")
        setattr(args, key, value)


def job_label(args: argparse.Namespace) -> str:
    """What the console and the launcher's record call the run's training."""
    return str(args.job) if args.script is None else f"script {args.script}"


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
        "--mode", args.mode,
        "--world-size", str(args.workers),
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    if args.epochs is not None:
        argv += ["--epochs", str(args.epochs)]
    return argv


def coordinator_argv(args: argparse.Namespace, run: str, run_dir: Path) -> list[str]:
    """The coordinator's command line; a script's arguments go last, after
    ``script_tail``'s ``--``, so the caller appends its own flags before that."""
    argv = _cli("coordinator", *_shared_argv(args, run, run_dir))
    argv += ["--script", args.script] if args.script else ["--job", args.job]
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
    if args.ingest_procs is not None:
        argv += ["--ingest-procs", str(args.ingest_procs)]
    return argv


def script_tail(args: argparse.Namespace) -> list[str]:
    """The script's own arguments, for the coordinator's command line's end."""
    return ["--", *args.script_args] if args.script else []


def _worker_flags(args: argparse.Namespace, run: str, rank: int, run_dir: Path) -> list[str]:
    argv = _shared_argv(args, run, run_dir)
    if not args.script:
        argv += ["--job", args.job]
    argv += ["--rank", str(rank), "--log-level", args.log_level]
    if args.device != "auto":
        argv += ["--device", args.device]
    if args.save_path:
        argv += ["--save-path", args.save_path]
    return argv


def worker_argv(args: argparse.Namespace, run: str, rank: int, run_dir: Path) -> list[str]:
    """Rank ``rank``'s command line: ``flodl-bus worker``, or the script itself."""
    if args.script:
        return [sys.executable, args.script, *args.script_args]
    return _cli("worker", *_worker_flags(args, run, rank, run_dir))


def worker_env(args: argparse.Namespace, run: str, rank: int, run_dir: Path) -> dict[str, str]:
    """What a script started as rank ``rank`` finds in its environment: the flags its
    ``flodl_bus.Rank`` joins with (``flodl-bus worker``'s); nothing for a job's rank."""
    if not args.script:
        return {}
    return {ENV_WORKER_ARGV: json.dumps(_worker_flags(args, run, rank, run_dir))}
