"""``flodl-bus worker``: run one rank of a run over Redis.

    flodl-bus worker --run RUN --rank R --world-size N --job MODULE:NAME --redis-url URL

Bad configuration exits with status 2 and one line naming the fix.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from torch import nn

from flodl_bus.bus.connection import DEFAULT_URL, ENV_URL, BadRedisUrl, connect, redact_url
from flodl_bus.bus.keys import InvalidRunId, RunKeys
from flodl_bus.params.port import ParamPort
from flodl_bus.protocol.messages import ControlMsg, UpstreamMsg
from flodl_bus.worker.rank import ParamsFactory, RankOptions, run_rank
from flodl_bus.worker.runtime import RuntimeConfig

MODES = ("nccl-sync", "nccl-cadence", "cpu-sync", "cpu-cadence", "cpu-async")


class ConfigError(Exception):
    """A configuration mistake; the message names the fix."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flodl-bus worker", description="Run one rank of a run.")
    p.add_argument("--run", required=True, help="run id shared with the coordinator")
    p.add_argument("--rank", type=int, help="this rank (0..world_size-1)")
    p.add_argument("--world-size", type=int, required=True, help="number of ranks")
    p.add_argument(
        "--job",
        default="flodl_bus.examples.digits:job",
        help="MODULE:NAME of the flodl_bus Job to train (default: the digits example)",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get(ENV_URL, DEFAULT_URL),
        help=f"Redis URL (default: ${ENV_URL} or {DEFAULT_URL})",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="nccl-cadence",
        help="averaging mode; must match the coordinator's (default nccl-cadence)",
    )
    p.add_argument("--save-path", help="checkpoint stem (bundle, consensus and Checkpoint files)")
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
    p.add_argument("--log-level", default="info", help="console log level (default info)")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, got {args.world_size}")
    if args.rank is None:
        raise ConfigError(
            "--rank is required: dial-in membership (joining without a rank) is not "
            "available in this build"
        )
    if not 0 <= args.rank < args.world_size:
        raise ConfigError(
            f"--rank {args.rank} is outside --world-size {args.world_size}: "
            f"use a rank in 0..{args.world_size - 1}"
        )
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


def _params_factory(args: argparse.Namespace) -> ParamsFactory | None:
    if args.world_size == 1:
        return None  # a world of one: LocalParams is the exact average
    try:
        from flodl_bus.params.plane import ParamConfig, TorchParamPort
    except ImportError as exc:
        raise ConfigError(
            f"--world-size {args.world_size} needs the param plane (flodl_bus.params.plane), "
            f"which is not available here ({exc}); run with --world-size 1"
        ) from None
    config = ParamConfig.for_mode(args.mode)
    url, run, rank, world = args.redis_url, args.run, args.rank, args.world_size

    def build(
        model: nn.Module,
        inject: Callable[[ControlMsg], None],
        publish: Callable[[UpstreamMsg], None],
    ) -> ParamPort:
        return TorchParamPort(
            list(model.parameters()),
            list(model.buffers()),
            redis_client=connect(url, client_name=f"flodl-rank{rank}-params"),
            run_id=run,
            rank=rank,
            world_size=world,
            config=config,
            inject=inject,
            publish=publish,
        )

    return build


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from flodl_bus.bus.run_secret import SecretError, fetch_run_secret
    from flodl_bus.bus.streams import RedisRankBus
    from flodl_bus.job import load_job
    from flodl_bus.record.log import configure_console

    try:
        _check(args)
        job = load_job(args.job)
        factory = _params_factory(args)
        keys = RunKeys(args.run)
        try:
            client = connect(args.redis_url, client_name=f"flodl-rank{args.rank}")
            client.ping()
        except BadRedisUrl as exc:
            raise ConfigError(f"--redis-url: {exc}") from None
        except Exception as exc:
            raise ConfigError(
                f"cannot reach Redis at {redact_url(args.redis_url)} ({type(exc).__name__}): "
                "start it or fix --redis-url"
            ) from None
        try:
            secret = fetch_run_secret(client, keys, timeout=args.secret_timeout)
        except SecretError as exc:
            raise ConfigError(str(exc)) from None
    except ConfigError as exc:
        print(f"flodl-bus worker: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # load_job's one-line errors
        print(f"flodl-bus worker: {exc}", file=sys.stderr)
        return 2

    configure_console(args.log_level)
    bus = RedisRankBus(client, keys, args.rank, secret, where=f"rank{args.rank}")
    options = RankOptions(
        world_size=args.world_size,
        runtime=RuntimeConfig(
            heartbeat_interval=args.heartbeat_interval,
            coord_liveness_timeout=args.coord_liveness_timeout,
        ),
        save_path=args.save_path,
    )
    try:
        return run_rank(job, bus, options, factory)
    finally:
        client.close()
