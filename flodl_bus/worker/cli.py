"""``flodl-bus worker``: run one rank of a run over Redis.

    flodl-bus worker --run RUN --rank R --world-size N --job MODULE:NAME --redis-url URL
    flodl-bus worker --run RUN --redis-url URL          (dial in: the coordinator assigns)

Without ``--rank`` the worker joins: it says a signed ``Hello`` (its id, host, device and
the signature of its training data) on the run's ``join`` stream and waits for its
``Assign`` (rank and world size); mode, job, save path and shuffle seed default to what
the coordinator put in the run's ``meta`` hash. A ``Reject`` (e.g. a dataset signature
mismatch) exits with status 2 and the coordinator's reason. With ``--rank`` the worker
still says Hello (so the coordinator knows it is up) but does not wait for an answer.

Bad configuration exits with status 2 and one line naming the fix.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from torch import nn

from flodl_bus import settings
from flodl_bus.agent.rank_io import RankIoBus
from flodl_bus.bus import cluster
from flodl_bus.bus.connection import (
    REFUSALS,
    RedisUnreachable,
    connect,
    connect_pinged,
    describe_refusal,
    redact_url,
)
from flodl_bus.bus.join import JoinStream
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.stream_ops import BusError, rank_streams_config
from flodl_bus.bus.streams import RedisRankBus
from flodl_bus.exits import CONFIG, FAILED, by_signal, describe
from flodl_bus.job import (
    Job,
    JobError,
    call_job,
    check_train_data,
    dataset_signature,
    model_signature,
)
from flodl_bus.options import ConfigError
from flodl_bus.params.port import ParamPort
from flodl_bus.protocol.messages import (
    Assign,
    ControlMsg,
    Hello,
    MetricsMsg,
    Reject,
    UpstreamMsg,
)
from flodl_bus.stop_signals import SignalStop, StopSignals, signal_name
from flodl_bus.worker.device_spec import hello_spec_score
from flodl_bus.worker.feed import FeedOptions
from flodl_bus.worker.host import check_thread_env, rank_env
from flodl_bus.worker.options import (
    DEFAULT_JOB,
    DEFAULT_MODE,
    check,
    parser,
)
from flodl_bus.worker.rank import ParamsFactory, RankOptions, UserGroupFactory, run_rank
from flodl_bus.worker.runtime import RuntimeConfig
from flodl_bus.worker.warm import start_warming

if TYPE_CHECKING:
    from flodl_bus.params.user_group import UserGroup

_T = TypeVar("_T")


def _overlaps_rounds(mode: str, knobs: Mapping[str, Any]) -> bool:
    """cpu-cadence keeps the steps taken during a round (``ParamConfig.keep_round_steps``);
    a meta without the knob (a coordinator before it) means the default, on."""
    return mode == "cpu-cadence" and bool(knobs.get("overlap_rounds", True))


def _params_factory(
    url: str, run: str, rank: int, world: int, mode: str, knobs: Mapping[str, Any]
) -> ParamsFactory | None:
    if world == 1:
        return None  # a world of one: LocalParams is the exact average
    try:
        from flodl_bus.params.plane import ParamConfig, TorchParamPort
    except ImportError as exc:
        raise ConfigError(
            f"--world-size {world} needs the param plane (flodl_bus.params.plane), "
            f"which is not available here ({exc}); run with --world-size 1"
        ) from None
    overrides: dict[str, Any] = {
        k: knobs[k] for k in ("easgd_alpha", "outer_lr", "outer_momentum") if knobs[k] is not None
    }
    if knobs["outer"] != "none":
        overrides["outer"] = knobs["outer"]
    if knobs["bf16_wire"]:
        overrides["bf16_wire"] = True
    if _overlaps_rounds(mode, knobs):
        overrides["keep_round_steps"] = True
    config = ParamConfig.for_mode(mode, **overrides)

    def build(
        model: nn.Module,
        inject: Callable[[ControlMsg], None],
        publish: Callable[[UpstreamMsg], None],
    ) -> ParamPort:
        return TorchParamPort(
            list(model.parameters()),
            list(model.buffers()),
            redis_client=connect(
                url, client_name=f"flodl-rank{rank}-params", key=RunKeys(run).meta
            ),
            run_id=run,
            rank=rank,
            world_size=world,
            config=config,
            inject=inject,
            publish=publish,
        )

    return build


def _user_group_factory(url: str, run: str, rank: int, device: str) -> UserGroupFactory:
    """The rank's default group for the job's code, on a connection of its own (its
    rendezvous blocks on Redis while the rank's other clients go on)."""

    def build() -> UserGroup:
        import torch

        from flodl_bus.params.user_group import UserGroup

        client = connect(url, client_name=f"flodl-rank{rank}-user-group", key=RunKeys(run).meta)
        return UserGroup(client, run, rank, torch.device(device))

    return build


def _load_job(ref: str) -> Job:
    from flodl_bus.job import load_job

    try:
        return load_job(ref)
    except SystemExit as exc:  # load_job's one-line errors
        raise ConfigError(str(exc)) from None


def _run_meta(raw: Mapping[bytes, bytes]) -> dict[str, str]:
    out = {}
    for k, v in raw.items():
        key = k.decode(errors="replace")
        if key != "secret":  # never carried around, never logged
            out[key] = v.decode(errors="replace")
    return out


def _meta_int(meta: Mapping[str, str], key: str) -> int | None:
    try:
        return int(meta[key])
    except (KeyError, ValueError):
        return None


def _resolve_mode(given: str | None, meta: Mapping[str, str]) -> str:
    theirs = meta.get("mode") or None
    if given is not None and theirs is not None and given != theirs:
        raise ConfigError(
            f"--mode {given} does not match the coordinator's mode {theirs}: "
            "drop --mode or pass the same one"
        )
    return given or theirs or DEFAULT_MODE


def _check_resume(stem: str) -> None:
    """The saved consensus is there (whether it fits the job's model is the rank's to
    say, when it loads it: ``worker.resume.restore_model``)."""
    path = Path(f"{stem}.model.pt")
    if not path.exists():
        raise ConfigError(
            f"no consensus model at {path} to resume from: pass the --save-path stem of "
            "a run that checkpointed"
        )


def _check_data_env() -> None:
    """The environment's data and thread settings, refused before anything starts."""
    try:
        FeedOptions.from_env()
        rank_env(0, 1, os.environ)
        check_thread_env(os.environ)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_device(wanted: str, rank: int) -> str:
    """The torch device of this rank (``rank``: its local rank on this host); a GPU asked
    for where none exists is a config error."""
    import torch

    if wanted == "auto":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return f"cuda:{rank % count}" if count else "cpu"
    try:
        device = torch.device(wanted)
    except RuntimeError:
        raise ConfigError(f"--device {wanted!r}: use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index if device.index is not None else rank % max(count, 1)
        if index >= count:
            raise ConfigError(
                f"--device {wanted}: this host has {count} CUDA device(s); "
                "use --device cpu or a present GPU"
            )
        return f"cuda:{index}"
    if device.type != "cpu":
        raise ConfigError(f"--device {wanted!r}: use cpu, cuda, cuda:N or auto")
    return "cpu"


def _spec_candidates(wanted: str, local_rank: int | None) -> list[int]:
    """The CUDA devices this rank may train on, told before the join: the one its local
    rank resolves to where that is known already (a launcher's ``LOCAL_RANK``, or
    ``--rank``), else any of this host's (its rank, hence its device, is assigned at the
    join). Empty on CPU, or where ``--device`` is wrong (that is said after the join)."""
    import torch

    if wanted == "cpu" or not torch.cuda.is_available():
        return []
    if local_rank is not None:
        try:
            device = torch.device(_resolve_device(wanted, local_rank))
        except ConfigError:
            return []
        return [device.index] if device.type == "cuda" and device.index is not None else []
    if wanted != "auto":
        try:
            device = torch.device(wanted)
        except RuntimeError:
            return []
        if device.type != "cuda":
            return []
        if device.index is not None:
            return [device.index]
    return list(range(torch.cuda.device_count()))


def _local_rank_before_join(rank: int | None, env: Mapping[str, str]) -> int | None:
    """This rank's local rank where it is known before the join (``rank_env``'s rule)."""
    local, local_world = env.get("LOCAL_RANK"), env.get("LOCAL_WORLD_SIZE")
    if local is not None and local_world is not None:
        return int(local) if local.isdigit() else None
    return rank


def _join(join: JoinStream, hello: Hello, run: str, timeout: float) -> Assign:
    """Say Hello and wait for the coordinator's Assign (or its Reject)."""
    cursor = join.post(hello)
    deadline = time.monotonic() + timeout
    while True:
        got, cursor = join.read(cursor, 1000)
        for _, msg in got:
            if isinstance(msg, Assign) and msg.worker_id == hello.worker_id:
                return msg
            if isinstance(msg, Reject) and msg.worker_id == hello.worker_id:
                raise ConfigError(f"refused by the coordinator of run {run!r}: {msg.reason}")
        if time.monotonic() > deadline:
            raise ConfigError(
                f"no answer to Hello within {timeout:.0f}s: is the coordinator of run "
                f"{run!r} up and still admitting workers? (or raise --join-timeout)"
            )


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: the table of ``flodl_bus.exits`` (README.md, "Exit codes")."""
    return run(parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """The rank of a parsed command line (``worker.options.main`` parsed it without torch)."""
    # Our own handlers first, whatever was inherited (an ignored SIGINT in a background
    # job, an ignored SIGTERM as PID 1 in a container): during setup a stop signal
    # raises SignalStop; once the rank runs, it leaves in order (``run_rank``).
    with StopSignals() as stop:
        return guarded(args, lambda: _main(args, stop))


def guarded(args: argparse.Namespace, body: Callable[[], _T]) -> _T | int:
    """``body()``, or the exit code of a rank stopped before it trained: a stop signal
    during setup, or Redis refusing the worker's user (each said in one line)."""
    try:
        return body()
    except SignalStop as exc:
        print(
            f"flodl-bus worker: stopped by {signal_name(exc.signum)} before training",
            file=sys.stderr,
        )
        return by_signal(exc.signum)
    except REFUSALS as exc:
        # An ACL that lacks a command or key, a password that stopped working: one
        # line naming the user and where its credentials came from.
        print(f"flodl-bus worker: {describe_refusal(exc, args.redis_url)}", file=sys.stderr)
        return CONFIG


@dataclass(frozen=True)
class Joined:
    """A rank that joined its run: what ``run_rank`` (or a script's ``Rank``) needs."""

    job: Job
    bus: RedisRankBus | RankIoBus
    options: RankOptions
    factory: ParamsFactory | None
    #: the connection that joined; the caller closes it after the rank ends
    client: redis.Redis


def _main(args: argparse.Namespace, stop: StopSignals) -> int:
    joined = join_run(args)
    if isinstance(joined, int):
        return joined
    code: int | None = None
    try:
        code = run_rank(joined.job, joined.bus, joined.options, joined.factory, stop)
        return code
    finally:
        finish(joined, code)


def finish(joined: Joined, code: int | None) -> None:
    """After the rank: its connection closed, and one line of how it ended."""
    joined.client.close()
    _say(f"rank {joined.bus.rank} {'raised (above)' if code is None else describe(code)}")


def join_run(args: argparse.Namespace, job: Job | None = None) -> Joined | int:
    """Join the run as the parsed command line says (meet the coordinator, say Hello,
    be given a rank) and build the rank's bus and options; an exit code when that fails
    (its one line said). ``job``: the job to train (a script's); None: ``--job``, else
    the coordinator's."""
    from flodl_bus.bus.run_secret import (
        ENV_SECRET,
        AuthenticationFailed,
        SecretError,
        fetch_identity,
        fetch_run_secret,
        secret_from_env,
    )
    from flodl_bus.protocol.signing import RankKeys, RankKx
    from flodl_bus.record.log import configure_console

    # Beside the join's waits: it must be done before the Hello below (worker.warm).
    warmed = start_warming()
    try:
        check(args)
        _check_data_env()
        # An explicit job is checked before Redis is reached: its error is the useful one.
        if job is None and args.job:
            job = _load_job(args.job)
        keys = RunKeys(args.run)
        who = f"rank{args.rank}" if args.rank is not None else "joiner"
        try:
            client = connect_pinged(args.redis_url, client_name=f"flodl-{who}", key=keys.meta)
        except RedisUnreachable as exc:
            raise ConfigError(str(exc)) from None
        if secret_from_env() is None and not _secret_there(client, keys):
            _say(
                f"waiting up to {args.secret_timeout:.0f}s for the coordinator of run "
                f"{args.run!r} at {redact_url(args.redis_url)} to start (it publishes the "
                f"run secret; or give it in {ENV_SECRET})"
            )
        try:
            secret = fetch_run_secret(client, keys, timeout=args.secret_timeout)
        except SecretError as exc:
            raise ConfigError(str(exc)) from None
        kx = RankKx.generate()
        worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        try:
            # The identity is published after meta: once it is there, meta is too.
            ident = fetch_identity(client, keys, secret, timeout=args.secret_timeout)
        except AuthenticationFailed as exc:
            # Say Hello anyway, so the coordinator names the failure in its log too.
            JoinStream(client, keys, secret, where=redact_url(args.redis_url)).post(
                Hello(worker_id, socket.gethostname(), "", kx_pub=kx.pub)
            )
            raise ConfigError(str(exc)) from None
        except SecretError as exc:
            raise ConfigError(str(exc)) from None
        meta = _run_meta(client.hgetall(keys.meta))  # type: ignore[arg-type]
        try:
            # On a Redis Cluster the coordinator spread the ranks over shards.
            keys = RunKeys(args.run, cluster.parse_shards(meta.get("shards")))
            cluster.check_layout(args.redis_url, keys)
        except cluster.ClusterUrlError as exc:
            raise ConfigError(str(exc)) from None
        mode = _resolve_mode(args.mode, meta)
        if job is None:
            job = _load_job(meta.get("job") or DEFAULT_JOB)
        save_path = args.save_path or meta.get("save_path") or None
        resume = args.resume or meta.get("resume") or None
        if resume:
            _check_resume(resume)
        try:
            knobs = settings.from_meta(meta)
        except settings.SettingsError as exc:
            raise ConfigError(f"the run's meta: {exc}") from None
        seed = knobs["seed"]
        lr_scale_ratio = (
            args.lr_scale_ratio if args.lr_scale_ratio is not None else knobs["lr_scale_ratio"]
        )
        splits = knobs["epoch_splits"]
        epochs = args.epochs if args.epochs is not None else _meta_int(meta, "epochs")
        # Before the Hello: the world forms once every rank is ready to train (warm.py).
        warmed()
        hello = Hello(
            worker_id=worker_id,
            host=socket.gethostname(),
            dataset_sig=dataset_signature(check_train_data(call_job("train_data", job.train_data))),
            model_sig=model_signature(job.build_model),
            device=_device() if args.device == "auto" else args.device,
            requested_rank=args.rank,
            kx_pub=kx.pub,
            # the cold-start anchor's prior (flodl's with_device_indices): None on CPU
            device_score=hello_spec_score(
                _spec_candidates(args.device, _local_rank_before_join(args.rank, os.environ))
            ),
        )
        join = JoinStream(
            client, keys, secret, answers=ident.sign_pub, where=redact_url(args.redis_url)
        )
        if args.rank is None:
            _say(
                f"joining run {args.run!r}: waiting up to {args.join_timeout:.0f}s for the "
                "coordinator to assign a rank"
            )
            assign = _join(join, hello, args.run, args.join_timeout)
            rank, world = assign.rank, assign.world_size
        else:
            join.post(hello)  # no wait: a scripted coordinator need not answer
            rank, world = args.rank, args.world_size
        join.close()
        # A GPU per rank of this host: torchrun's LOCAL_RANK (the launcher's, else the rank).
        device = _resolve_device(args.device, int(rank_env(rank, world, os.environ)["LOCAL_RANK"]))
        factory = _params_factory(args.redis_url, args.run, rank, world, mode, knobs)
        user_group = (
            _user_group_factory(args.redis_url, args.run, rank, device)
            if knobs["user_group"]
            else None
        )
    except JobError as exc:
        # The job's bug, met before the rank reached the run: one line (the same job
        # fails the coordinator the same way, so the run does not start either).
        print(f"flodl-bus worker: --job: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"flodl-bus worker: {exc}", file=sys.stderr)
        return CONFIG

    configure_console(args.log_level)
    how = "assigned" if args.rank is None else "given"
    _say(f"rank {rank} of {world} ({how}) in run {args.run!r}: {mode}, {job.name}, {device}")
    if mode.startswith("nccl") and not device.startswith("cuda"):
        # The mode still runs (its in-place averaging over gloo), but never silently.
        _say(f"rank {rank}: {mode} on {device}: no CUDA here, so it averages over gloo")
    rank_keys = RankKeys(kx.rank_key(ident, args.run, rank), ident.sign_pub)
    bus: RedisRankBus | RankIoBus
    if args.rank_io == "process":
        try:
            bus = _ConsoleRankIoBus(
                args.redis_url,
                keys,
                rank,
                rank_keys,
                config=rank_streams_config(world),
                where=f"rank{rank}",
            )
        except BusError as exc:
            print(f"flodl-bus worker: --rank-io process: {exc}", file=sys.stderr)
            return FAILED
        _say(f"rank {rank}: its Redis work in process {bus.pid} (--rank-io process)")
    else:
        bus_client = client
        if keys.shards:
            bus_client = connect(
                args.redis_url, client_name=f"flodl-rank{rank}", key=keys.ctl(rank)
            )
        bus = _ConsoleRankBus(
            bus_client,
            keys,
            rank,
            rank_keys,
            config=rank_streams_config(world),
            where=f"rank{rank}",
        )
    options = RankOptions(
        world_size=world,
        runtime=RuntimeConfig(
            heartbeat_interval=args.heartbeat_interval,
            coord_liveness_timeout=args.coord_liveness_timeout,
        ),
        save_path=save_path,
        shuffle_seed=seed,
        epoch_splits=splits,
        record_dir=None if args.no_record else (args.run_dir or os.path.join("runs", args.run)),
        record_header={
            "run": args.run,
            # a coordinator drives this rank: a run directory without its record is not
            # whole (``replay.load.missing_roles``)
            "coordinated": True,
            "shards": list(keys.shards),
            "mode": mode,
            "job": args.job or meta.get("job"),
            "settings": knobs,
        },
        device=device,
        lr_scale=settings.lr_scale(lr_scale_ratio, world),
        announce=_say,
        epochs=epochs,
        resume=resume,
        # the coordinator sends cpu-cadence plans behind RequestParams (issue 27): the
        # rank trains through the round, or waits for its Update where steps taken
        # meanwhile would be overwritten
        plans_wait_for_update=mode == "cpu-cadence" and not _overlaps_rounds(mode, knobs),
        user_group=user_group,
        # lockstep promises a repeatable run: its threads are not chosen by timing
        tune_threads=not knobs["lockstep"],
    )
    return Joined(job=job, bus=bus, options=options, factory=factory, client=client)


def _secret_there(client: redis.Redis, keys: RunKeys) -> bool:
    """Whether the run's secret is in Redis yet (GET, the one command a worker user may
    have on it; a user that may not read it is fetch_run_secret's to name)."""
    try:
        return client.get(keys.secret) is not None
    except redis.exceptions.NoPermissionError:
        return True


def _say(line: str) -> None:
    """The worker's own console lines (its logs stay structured): what it waits for,
    its rank, its progress per chunk of work, how it ended."""
    print(f"flodl-bus worker: {line}", file=sys.stderr, flush=True)


def _say_chunk(msg: UpstreamMsg) -> None:
    """A finished chunk of work on the console (the rank's Metrics, as it goes upstream).
    Said before the Metrics goes: it wakes the publisher, whose write would take the GIL
    the console write gives up, and the training thread would wait it out (a world of
    one's epoch end, 2 cores: 0.69 ms a line, now 32 µs)."""
    if isinstance(msg, MetricsMsg) and msg.batches_processed:
        rate = msg.samples_processed / (msg.epoch_ms / 1000) if msg.epoch_ms > 0 else 0.0
        _say(
            f"rank {msg.rank}: epoch {msg.epoch}: {msg.batches_processed} batches, "
            f"loss {msg.avg_loss:.4f}, {rate:.0f} samples/s"
        )


class _ConsoleRankBus(RedisRankBus):
    """The rank's bus, which also says each finished chunk of work on the console."""

    def publish(self, msg: UpstreamMsg) -> None:
        _say_chunk(msg)
        super().publish(msg)


class _ConsoleRankIoBus(RankIoBus):
    """The rank's bus in a process of its own (``--rank-io process``), which also says
    each finished chunk of work on the console."""

    def publish(self, msg: UpstreamMsg) -> None:
        _say_chunk(msg)
        super().publish(msg)
