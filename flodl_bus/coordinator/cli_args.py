"""``flodl-bus coordinator``'s command line: its parser, the checks that turn a bad
flag into one line naming the fix (``ConfigError``), and the translation of the run
settings and the resume meta into what the coordinator is built from.

Kept apart from ``coordinator.cli`` (which runs the coordinator) so each stays readable;
imports stay light so ``--help`` loads no torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flodl_bus import settings
from flodl_bus.bus.connection import add_url_argument
from flodl_bus.bus.ingest import AUTO_MIN_CORES, AUTO_MIN_RANKS, AUTO_PROCS, procs_arg
from flodl_bus.bus.keys import InvalidRunId, RunKeys
from flodl_bus.coordinator.config import MODES, CoordinatorConfig, MaxFailure, Policy, parse_mode
from flodl_bus.options import LOG_LEVELS, ConfigError, OneLineParser, log_level

PROG = "flodl-bus coordinator"


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG,
        description="Run the coordinator of a run.",
        epilog="Give --world-size N, or --min-workers M (with --join-timeout S). "
        "Credentials: in the URL, or FLODL_REDIS_USERNAME / FLODL_REDIS_PASSWORD.",
    )
    required = p.add_argument_group("required")
    required.add_argument("--run", required=True, help="run id shared with the workers")
    # One of the two, said by argparse in one line (and both listed as required).
    training = required.add_mutually_exclusive_group(required=True)
    training.add_argument(
        "--job",
        help="MODULE:NAME of the flodl_bus Job (e.g. flodl_bus.examples.digits:job); the "
        "current directory is importable",
    )
    training.add_argument(
        "--script",
        metavar="PATH",
        help="instead of --job: a training script with its own loop (flodl_bus.Rank); the "
        "coordinator runs it up to its Rank(...) to learn the run's sizes. Its arguments "
        "follow a --",
    )
    p.add_argument("script_args", nargs="*", help=argparse.SUPPRESS)
    add_url_argument(p)
    # Not argparse choices: parse_mode's refusal names the fix (nccl-async -> cpu-async).
    p.add_argument(
        "--mode",
        default="nccl-cadence",
        metavar="{" + ",".join(MODES) + "}",
        help="averaging mode (default %(default)s)",
    )
    p.add_argument("--world-size", type=int, help="form the world when this many workers joined")
    p.add_argument(
        "--min-workers",
        type=int,
        help="form the world with at least this many workers once --join-timeout passed",
    )
    p.add_argument("--join-timeout", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--epochs", type=int, help="epochs to train (default: the job's)")
    p.add_argument(
        "--save-path",
        help="checkpoint stem: <stem>.meta.json, <stem>.model.pt (default: the final "
        "consensus goes to <run-dir>/consensus)",
    )
    p.add_argument("--resume", help="resume from <STEM>.meta.json, training only uncovered samples")
    p.add_argument("--run-dir", help="record and metrics directory (default runs/<run>)")
    p.add_argument("--heartbeat-timeout", type=float, default=30.0, help="seconds (default 30)")
    p.add_argument(
        "--ingest-procs",
        type=ingest_procs_type,
        default=None,
        metavar="K|auto",
        help="read, verify and dead-letter the ranks' upstream in K reader processes, each "
        "owning a fixed share of the ranks; 0: on the coordinator's own thread; default "
        f"auto: {AUTO_PROCS} from {AUTO_MIN_RANKS} ranks on a host of {AUTO_MIN_CORES}+ "
        "cores, else 0 (`flodl-bus bench path --ingest-procs`); a Redis Cluster run reads "
        "in-thread per shard",
    )
    p.add_argument("--eval-every", type=int, help="evaluate every N epochs")
    p.add_argument("--checkpoint-every", type=int, help="checkpoint every N epochs")
    p.add_argument(
        "--no-final-eval", action="store_true", help="skip the final eval before Shutdown"
    )
    p.add_argument(
        "--exit-grace",
        type=float,
        default=30.0,
        help="seconds to wait for every rank's Exiting after Shutdown (default 30)",
    )
    p.add_argument(
        "--reset-run",
        action="store_true",
        help="delete what an earlier run with this id left in Redis (streams, meta, secret) "
        "before starting; without it such a run id is refused",
    )
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also write TensorBoard event files to DIR: loss, eval metric, samples/s per "
        "rank, anchor and syncs per epoch (needs the tensorboard extra)",
    )
    p.add_argument(
        "--expire-after",
        type=float,
        default=7 * 24 * 3600.0,
        help="seconds after the run ends that its keys and secret expire in Redis "
        "(default 604800, a week; 0 keeps them); the records on disk stay",
    )
    p.add_argument(
        "--log-level",
        default="info",
        type=log_level,
        choices=LOG_LEVELS,
        help="console log level (default info)",
    )
    p.add_argument(
        "--supervisor-fd",
        type=int,
        help="an inherited pipe on which the launcher (flodl-bus up) reports ranks whose "
        "process exited; its end of file stops the run in order",
    )
    settings.add_arguments(p)
    return p


def ingest_procs_type(text: str) -> int | None:
    try:
        return procs_arg(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[1]) from None


def _positive(name: str, value: int | float | None, *, zero_ok: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{name} must be {'>= 0' if zero_ok else 'positive'}, got {value}")


def _check(args: argparse.Namespace) -> None:
    try:
        RunKeys(args.run)
    except InvalidRunId as exc:
        raise ConfigError(f"--run: {exc}") from None
    if args.script_args and not args.script:
        raise ConfigError(f"unexpected arguments {args.script_args}: only --script takes them")
    try:
        parse_mode(args.mode)
    except ValueError as exc:
        raise ConfigError(f"--mode: {exc}") from None
    if args.world_size is None and args.min_workers is None:
        raise ConfigError("give --world-size N (or --min-workers M with --join-timeout S)")
    _positive("--world-size", args.world_size)
    _positive("--min-workers", args.min_workers)
    if (
        args.world_size is not None
        and args.min_workers is not None
        and args.min_workers > args.world_size
    ):
        raise ConfigError(
            f"--min-workers {args.min_workers} exceeds --world-size {args.world_size}"
        )
    _positive("--join-timeout", args.join_timeout, zero_ok=True)
    _positive("--epochs", args.epochs, zero_ok=True)
    _positive("--heartbeat-timeout", args.heartbeat_timeout)
    _positive("--eval-every", args.eval_every)
    _positive("--checkpoint-every", args.checkpoint_every)
    _positive("--exit-grace", args.exit_grace, zero_ok=True)
    _positive("--expire-after", args.expire_after, zero_ok=True)
    if args.tensorboard:
        from flodl_bus.coordinator.metrics import TensorBoardScalars

        why = TensorBoardScalars.available()
        if why is not None:
            raise ConfigError(why)


def asked_run_dir(args: argparse.Namespace) -> Path:
    return Path(args.run_dir or Path("runs") / args.run)


def default_save_stem(args: argparse.Namespace) -> Path:
    """Where the final consensus goes without --save-path; every rank reads it from
    the run's meta. Load it with ``model.load_state_dict(torch.load(STEM.model.pt))``."""
    from flodl_bus.record.dispatch import fresh_run_dir

    # The directory the record will go to (a fresh sibling when the asked one holds an
    # earlier run's record), so a reused run id never overwrites an earlier run's model.
    return fresh_run_dir(asked_run_dir(args), "coordinator") / "consensus"


def config_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    """The coordinator's share of the run settings, as ``CoordinatorConfig`` fields."""
    mf = knobs["max_failure"]
    max_failure = None
    if mf is not None:
        max_failure = (
            MaxFailure(percent=float(mf[:-1]) / 100.0)
            if mf.endswith("%")
            else MaxFailure(absolute=int(mf))
        )
    return {
        "seed": knobs["seed"],
        "epoch_splits": knobs["epoch_splits"],
        "anchor": knobs["anchor"],
        "min_anchor": knobs["min_anchor"],
        "max_anchor": knobs["max_anchor"],
        "overhead_target": knobs["overhead_target"],
        "max_batch_diff": knobs["max_batch_diff"],
        "max_overshoot": knobs["max_overshoot"],
        "relax_up": knobs["relax_up"],
        "epoch_callback_rank": knobs["callback_rank"],
        "checkpoint_at_epoch": knobs["checkpoint_at_epoch"] or (),
        "max_failure": max_failure,
        "guard": knobs["guard"],
        "meta_controller": knobs["meta_controller"],
        "callback_slack": knobs["callback_slack"],
        "speed_hints": knobs["speed_hints"],
        "stage_advisories": knobs["stage_advisories"],
        "lockstep": knobs["lockstep"],
        # A bridge's steps after the rank's snapshot survive the round only where the
        # ranks keep their round steps.
        "cpu_bridges": knobs["bridges"] and knobs["overlap_rounds"],
    }


def ignored_settings(config: CoordinatorConfig) -> list[tuple[str, str]]:
    """Settings the run's mode does not use: (key, why), for a warning (flodl warns and
    ignores them too)."""
    if config.policy is Policy.ASYNC:
        return []
    out: list[tuple[str, str]] = []
    if config.max_overshoot is not None:
        out.append(("max_overshoot", "only cpu-async ranks run past their window"))
    if config.relax_up:
        out.append(("relax_up", "the anchor relaxes up on cpu-async only"))
    return out


def _read_resume(stem: str) -> dict[str, Any]:
    path = Path(f"{stem}.meta.json")
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"--resume: no checkpoint meta at {path}; pass the --save-path stem of the run "
            "to resume"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume: cannot read {path} ({exc})") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"--resume: {path} is not a checkpoint meta object")
    model = Path(f"{stem}.model.pt")
    if not model.exists():
        raise ConfigError(
            f"--resume: no consensus model at {model} beside its meta; pass the "
            "--save-path stem of a run whose save finished"
        )
    return meta
