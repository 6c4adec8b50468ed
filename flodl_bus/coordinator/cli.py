"""``flodl-bus coordinator``: schedule one run over Redis.

    flodl-bus coordinator --run RUN --redis-url URL --job MODULE:NAME --mode MODE \\
        (--world-size N | --min-workers M [--join-timeout S]) [--epochs N] \\
        [--save-path STEM] [--resume STEM] [--run-dir DIR] [--heartbeat-timeout S] \\
        [--eval-every N] [--checkpoint-every N] [--config run.toml] [run settings]

Run settings (``flodl_bus.settings``: seed, epoch splits, max failure, anchor, overhead
target, max batch difference, max overshoot, callback rank, guard, meta-controller, LR
scaling, outer optimizer, EASGD alpha) come from their flags, else ``--config``, else
flodl's defaults; they are recorded in the run header, and the ranks' share is published
in the run's meta.

Workers join on the run's ``join`` stream (``flodl-bus worker`` with or without
``--rank``); the run's config goes into its ``meta`` hash so joining workers can read it.
The record goes to ``<run-dir>/coordinator.jsonl``, per-epoch metrics to
``<run-dir>/metrics.csv``.

Bad configuration exits with status 2 and one line naming the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from flodl_bus import settings
from flodl_bus.bus import cluster
from flodl_bus.bus.connection import (
    REFUSALS,
    RedisUnreachable,
    connect_pinged,
    describe_refusal,
    redact_url,
)
from flodl_bus.bus.ingest import auto_procs
from flodl_bus.bus.keys import RunKeys
from flodl_bus.coordinator.cli_args import (
    PROG,
    _check,
    _parser,
    _read_resume,
    asked_run_dir,
    config_knobs,
    default_save_stem,
    ignored_settings,
)
from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.exits import CONFIG, FAILED, STOPPED, by_signal
from flodl_bus.options import ConfigError
from flodl_bus.protocol.messages import ResourceSample
from flodl_bus.protocol.wire import resources_to_map
from flodl_bus.stop_signals import SignalStop, StopSignals, signal_name

Owners = list[tuple[Any, str]]


def _reset_run(client: Any, keys: RunKeys, owners: Owners | None = None) -> int:
    """Delete every key of the run (its hash-tagged streams, meta, store) and its secret
    (``owners``: a client per key prefix, on a cluster one per shard)."""
    deleted = 0
    for owner, prefix in owners or [(client, keys.prefix)]:
        doomed = list(owner.scan_iter(match=f"{prefix}*", count=1000))
        for i in range(0, len(doomed), 500):
            owner.unlink(*doomed[i : i + 500])
        deleted += len(doomed)
    client.unlink(keys.secret)
    return deleted


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: the table of ``flodl_bus.exits`` (README.md, "Exit codes")."""
    args = _parser().parse_args(argv)
    # Our own handlers first, whatever was inherited (an ignored SIGINT in a background
    # job, an ignored SIGTERM as PID 1): during setup a stop signal raises SignalStop;
    # once the run's state exists it stops the run in order (below).
    with StopSignals() as stop:
        try:
            return _main(args, stop)
        except ConfigError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return CONFIG
        except REFUSALS as exc:
            # A user whose ACL lacks a command or key, or whose password stopped working:
            # one line naming the user, not redis-py's traceback.
            print(f"{PROG}: {describe_refusal(exc, args.redis_url)}", file=sys.stderr)
            return CONFIG
        except SignalStop as exc:
            print(f"{PROG}: stopped by {signal_name(exc.signum)} during setup", file=sys.stderr)
            return by_signal(exc.signum)


def _main(args: argparse.Namespace, stop: StopSignals) -> int:
    # the record's origin of time: `replay --until T` counts from the launch
    launched_wall, launched_at = time.time(), time.monotonic()
    from flodl_bus.bus.ids import format_id
    from flodl_bus.bus.join import JoinStream
    from flodl_bus.bus.run_secret import (
        SecretError,
        coordinator_identity,
        ensure_run_secret,
        publish_identity,
    )
    from flodl_bus.bus.stream_ops import stream_top
    from flodl_bus.bus.streams import RedisCoordinatorBus
    from flodl_bus.coordinator.checkpoint import read_meta
    from flodl_bus.coordinator.core import Coordinator
    from flodl_bus.coordinator.join_desk import Interrupted, JoinDesk, WorldNotFormed, form_world
    from flodl_bus.coordinator.membership import Admission
    from flodl_bus.coordinator.outputs import MetricsTable
    from flodl_bus.coordinator.runtime import EXIT_INTERRUPTED, CoordinatorLoop, LoopOptions
    from flodl_bus.job import (
        JobError,
        call_job,
        check_train_data,
        dataset_signature,
        describe_script,
        load_job,
        model_signature,
    )
    from flodl_bus.protocol.signing import BadKey, CoordinatorKeys
    from flodl_bus.record.dispatch import DispatchRecorder
    from flodl_bus.record.log import configure_console
    from flodl_bus.record.process import process_mode

    _check(args)
    try:
        knobs = settings.resolve(args)
    except settings.SettingsError as exc:
        raise ConfigError(str(exc)) from None
    # What the meta, the log and the record name the job by.
    job_ref = args.job or f"script:{args.script}"
    try:
        job = describe_script(args.script, args.script_args) if args.script else load_job(args.job)
        # The coordinator only needs the sizes, but a builder that raises is the job's
        # bug: one line naming it, not its traceback.
        train = check_train_data(call_job("train_data", job.train_data))
    except SystemExit as exc:  # load_job's and describe_script's one-line errors
        raise ConfigError(str(exc)) from None
    except JobError as exc:
        flag = f"--job {args.job!r}" if args.job else f"--script {args.script!r}"
        raise ConfigError(f"{flag}: {exc}") from None
    # Read again with the job's own asks (its LR scaling) under the run's: the flags
    # and the file were checked above, before the job was built.
    knobs = settings.resolve(args, job.knob_defaults())
    for flag, asked in (
        ("--checkpoint-every", args.checkpoint_every),
        ("--checkpoint-at-epoch", knobs["checkpoint_at_epoch"]),
    ):
        if asked and not (args.save_path or args.resume) and not job.checkpoint_fn:
            # The job's own checkpoint_fn decides where its checkpoints go.
            raise ConfigError(
                f"{flag} needs --save-path STEM (where checkpoints go) or a job "
                "with a checkpoint_fn"
            )
    epochs = job.num_epochs if args.epochs is None else args.epochs
    # Without --save-path the consensus still lands in the run directory at the end:
    # <run-dir>/consensus.model.pt beside consensus.meta.json (a --resume stem too).
    save_path = args.save_path or args.resume or str(default_save_stem(args))
    final_eval = not args.no_final_eval and job.eval_fn is not None and job.eval_data is not None

    def make_config(
        world_size: int, device_scores: tuple[float, ...] | None = None
    ) -> CoordinatorConfig:
        return CoordinatorConfig(
            mode=args.mode,
            world_size=world_size,
            device_scores=device_scores,
            total_samples=len(train),
            batch_size=job.batch_size,
            num_epochs=epochs,
            heartbeat_timeout=args.heartbeat_timeout,
            eval_every=args.eval_every,
            final_eval=final_eval,
            checkpoint_every=args.checkpoint_every,
            save_path=save_path,
            **config_knobs(knobs),
        )

    # Validate the config now, not after the world formed (a bad batch size or resume
    # meta must not cost the workers their wait).
    probe_ws = args.world_size if args.world_size is not None else args.min_workers
    try:
        probe = make_config(probe_ws)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    resume_meta: dict[str, Any] | None = None
    if args.resume:
        resume_meta = _read_resume(args.resume)
        try:
            read_meta(probe, resume_meta)
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--resume: {exc}") from None

    keys = RunKeys(args.run)
    try:
        client = connect_pinged(args.redis_url, client_name="flodl-coordinator", key=keys.meta)
        # On a Redis Cluster: a shard per master, the ranks spread over them.
        keys = RunKeys(args.run, cluster.plan_shards(args.redis_url, args.run))
        owners = cluster.key_owners(args.redis_url, keys, client, client_name="flodl-coordinator")
    except RedisUnreachable as exc:
        raise ConfigError(str(exc)) from None
    except (RedisError, cluster.ClusterUrlError) as exc:
        raise ConfigError(
            f"Redis Cluster at {redact_url(args.redis_url)}: {exc}; check that every "
            "node answers and the cluster is ok (CLUSTER INFO)"
        ) from None

    configure_console(args.log_level)
    import structlog

    log = structlog.get_logger("flodl_bus.coordinator")
    for key, why in ignored_settings(probe):
        log.warning("setting_ignored", setting=key, mode=args.mode, reason=why)
    sig = dataset_signature(train)
    model_sig = model_signature(job.build_model)
    run_fields: dict[str, str] = {
        "mode": args.mode,
        "job": job_ref,
        "batch_size": str(job.batch_size),
        "epochs": str(epochs),
        **settings.to_meta(knobs),
        "dataset_sig": sig,
        "model_sig": model_sig or "",
        "world_size": "" if args.world_size is None else str(args.world_size),
        "save_path": save_path or "",
        "resume": args.resume or "",
        "status": "joining",
        "shards": cluster.shards_field(keys.shards),
    }
    # An earlier run's streams under the same id would hand the new ranks its stale
    # control entries (and its secret); only workers ever read meta, so its presence
    # means a coordinator already ran this id.
    if args.reset_run:
        log.info("run_reset", run=args.run, keys_deleted=_reset_run(client, keys, owners))
    elif client.exists(keys.meta):
        raise ConfigError(
            f"run id {args.run!r} already has state in Redis from an earlier coordinator "
            f"({keys.meta}): pick a new --run, or pass --reset-run to delete it"
        )
    try:
        # The config first: a worker that sees the secret can rely on the config too.
        client.hset(keys.meta, mapping=run_fields)  # type: ignore[arg-type]
        secret = ensure_run_secret(client, keys)
        identity = coordinator_identity()
        # Where this run's Hellos start: the top *before* the identity is out. A worker
        # says Hello as soon as it reads the identity, which on a loaded machine can
        # come before our next command; a top read after publishing would skip it.
        join_start = format_id(stream_top(client, keys.join))
        # Before any Hello is read: a worker checks its secret against this first.
        publish_identity(client, keys, identity, secret)
    except SecretError as exc:
        raise ConfigError(str(exc)) from None

    # One event for both phases: the join wait and the loop (which gets it below). The
    # first stop signal stops the run in order (Shutdown, wait for Exiting); a second
    # one cuts the wait for Exiting short.
    stopping, hurry = threading.Event(), threading.Event()
    launcher_gone = threading.Event()

    def on_stop(_signum: int, nth: int) -> None:
        stopping.set()
        if nth > 1:
            hurry.set()

    stop.call_on_stop(on_stop)
    supervisor = None
    if args.supervisor_fd is not None:
        from flodl_bus.coordinator.supervisor import SupervisorFeed

        def on_launcher_gone() -> None:
            if not stopping.is_set():
                log.warning("launcher_gone", detail="stopping the run in order")
                launcher_gone.set()
                stopping.set()

        try:
            supervisor = SupervisorFeed(args.supervisor_fd, on_launcher_gone)
        except OSError as exc:
            raise ConfigError(f"--supervisor-fd {args.supervisor_fd}: {exc}") from None

    def stopped_code() -> int:
        if stop.signum is not None:
            return by_signal(stop.signum)
        return STOPPED if launcher_gone.is_set() else EXIT_INTERRUPTED

    join = JoinStream(
        client, keys, secret, signer=identity.signing, where=redact_url(args.redis_url)
    )
    admission = Admission(
        dataset_sig=sig,
        model_sig=model_sig,
        world_size=args.world_size,
        min_workers=args.min_workers,
        join_timeout=args.join_timeout,
    )
    desk = JoinDesk(join, admission, after=join_start)
    log.info(
        "coordinator_up",
        run=args.run,
        mode=args.mode,
        job=job_ref,
        world_size=args.world_size,
        min_workers=args.min_workers,
        epochs=epochs,
        dataset_sig=sig,
        model_sig=model_sig,
        resume=args.resume,
        redis=redact_url(args.redis_url),
    )
    try:
        form_world(desk, stop=stopping)
    except WorldNotFormed as exc:
        client.hset(keys.meta, "status", "not formed")
        if args.expire_after > 0:  # a run that never formed has ended too
            expire_run(client, keys, args.expire_after, owners)
        log.error("world_not_formed", reason=str(exc))
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except Interrupted:
        client.hset(keys.meta, "status", "interrupted")
        if args.expire_after > 0:
            expire_run(client, keys, args.expire_after, owners)
        return stopped_code()
    ws = admission.world_size
    assert ws is not None
    # The members' device spec scores (all or none) seed ElChe's cold-start anchor.
    config = make_config(ws, admission.device_scores)
    try:
        core = (
            Coordinator.from_meta(config, resume_meta)
            if resume_meta is not None
            else Coordinator(config)
        )
    except ValueError as exc:
        raise ConfigError(f"--resume: {exc}") from None
    client.hset(keys.meta, mapping={"world_size": str(ws), "status": "running"})

    run_dir = asked_run_dir(args)
    run_dir.mkdir(parents=True, exist_ok=True)
    # The line built off this thread (record.process) unless FLODL_RECORD_PROCESS=0; the
    # TensorBoard scalars come from the live events, which only an in-thread record has.
    mode = "thread" if args.tensorboard else process_mode()
    recorder: DispatchRecorder
    if mode == "shadow":
        from flodl_bus.coordinator.shadow import ShadowRecorder

        recorder = ShadowRecorder(run_dir, config=config, resume_meta=resume_meta)
    else:
        recorder = DispatchRecorder(run_dir, "coordinator", process=mode == "process")
    run_dir = recorder.run_dir  # a fresh sibling when run_dir holds an earlier run's record
    recorder.header(
        run=args.run,
        shards=list(keys.shards),
        config=dataclasses.asdict(config),
        settings=knobs,
        config_file=args.config,
        job=job_ref,
        # what `up` shows of the job, so the launcher never imports torch beside ranks
        job_name=job.name,
        target_metric=job.target_metric,
        dataset_sig=sig,
        model_sig=model_sig,
        resume_meta=resume_meta,
        members=[dataclasses.asdict(m) for m in admission.members],
        clock="time.monotonic",
        started_wall=time.time(),
        launched_wall=launched_wall,
        launched_at=launched_at,
        replay_note="core = Coordinator.from_meta(config, resume_meta) if resume_meta "
        "else Coordinator(config); then core.start(now) at the 'start' event",
    )
    try:
        rank_keys = CoordinatorKeys(
            identity.signing,
            {m.rank: identity.rank_key(args.run, m.rank, m.kx_pub) for m in admission.members},
        )
    except BadKey as exc:
        raise ConfigError(f"a worker's Hello carries no usable key: {exc}") from None
    bus: Any
    if keys.shards:
        from flodl_bus.bus.sharded import ShardedCoordinatorBus

        if args.ingest_procs:  # asked for (auto says nothing here)
            log.warning(
                "ingest_procs_ignored",
                ingest_procs=args.ingest_procs,
                why="a Redis Cluster run reads each shard's upstream on its own thread",
            )

        bus = ShardedCoordinatorBus(
            [c for c, _ in owners[1:]],
            keys,
            rank_keys,
            ranks=range(ws),
            where=redact_url(args.redis_url),
            wait_ms=cluster.DEFAULT_WAIT_MS,
        )
    else:
        bus = RedisCoordinatorBus(
            client,
            keys,
            rank_keys,
            ranks=range(ws),
            where=redact_url(args.redis_url),
            ingest_procs=_ingest_procs(args.ingest_procs, ws),
            # the reader processes log as this process does (``--log-level``)
            ingest_setup=functools.partial(configure_console, args.log_level),
        )

    metrics = MetricsTable(run_dir / "metrics.csv", ws)
    board: Any = None
    if args.tensorboard:
        from flodl_bus.coordinator.metrics import TensorBoardScalars

        board = TensorBoardScalars(args.tensorboard)

        class BoardedMetrics(MetricsTable):
            """metrics.csv, and the same figures as TensorBoard scalars."""

            def on_epoch(
                self, em: Any, *, version: int, syncs: int, step: int, anchor: int
            ) -> None:
                super().on_epoch(em, version=version, syncs=syncs, step=step, anchor=anchor)
                board.on_epoch(em, syncs=syncs, anchor=anchor)

            def on_end(self, syncs: int) -> None:
                super().on_end(syncs)
                if self.rows:
                    board.on_end(max(self.rows), syncs)

            def on_eval(self, scheduled_epoch: int, metric: float) -> None:
                super().on_eval(scheduled_epoch, metric)
                board.on_eval(scheduled_epoch - 1, metric)

        metrics = BoardedMetrics(run_dir / "metrics.csv", ws)
        recorder.on_events = board.on_events

    class PublishingLoop(CoordinatorLoop):
        """The loop, which also keeps the core's state in the run's ``meta`` about once a
        second for ``flodl-bus status`` (an observer cannot ask the core). On the loop's
        own thread: the core is read between two of its calls."""

        next_publish = 0.0

        def _tick(self) -> None:
            super()._tick()
            if time.monotonic() >= self.next_publish:
                self.next_publish = time.monotonic() + STATE_EVERY_S
                # Seconds since each rank's last verified entry: status shows these, not
                # the newest Heartbeat in ``up:<r>``, which anyone who can write the
                # stream could add (an observer cannot check a MAC).
                heard = self.core.live.heard_ago(self.clock())
                publish_state(
                    client,
                    keys.meta,
                    self.core.state_summary(),
                    heard=heard,
                    resources=self.core.resources,
                    behind_s=self.behind_for(),
                )

    loop = PublishingLoop(
        core,
        bus,
        recorder=recorder,
        metrics=metrics,
        options=LoopOptions(exit_grace=args.exit_grace),
        rank_of=keys.rank_of,
        join=desk,
    )
    loop.stop = stopping
    loop.hurry = hurry
    loop.supervisor = supervisor
    try:
        code = loop.run()
    finally:
        if board is not None:
            board.close()
        recorder.close()
        bus.close()
        join.close()
    status = {
        0: "finished",
        EXIT_INTERRUPTED: "interrupted",
        CONFIG: "refused",
        FAILED: "failed",
    }.get(code, "saved")
    if code == EXIT_INTERRUPTED:
        code = stopped_code()
    try:
        # The last state first (status reads its round count and epochs from it; the
        # once-a-second refresh may be a round or an epoch behind the end).
        publish_state(client, keys.meta, loop.core.state_summary(), resources=loop.core.resources)
        client.hset(keys.meta, "status", status)
        if args.expire_after > 0:
            expired = expire_run(client, keys, args.expire_after, owners)
            log.info("run_keys_expire", keys=expired, after_s=args.expire_after)
    finally:
        client.close()
    log.info("coordinator_exit", code=code, status=status, record=str(recorder.path))
    return code


def expire_run(client: Any, keys: RunKeys, seconds: float, owners: Owners | None = None) -> int:
    """Let every key of the run and its secret expire ``seconds`` from now (a finished
    run's streams would otherwise stay in Redis for good). Returns how many were set.
    ``owners``: a client per key prefix (on a cluster, one per shard)."""
    ttl = max(1, int(seconds))
    set_ = 0
    for owner, prefix in owners or [(client, keys.prefix)]:
        names = list(owner.scan_iter(match=f"{prefix}*", count=1000))
        if owner is client:
            names.append(keys.secret)
        pipe = owner.pipeline(transaction=False)
        for name in names:
            pipe.expire(name, ttl)
        set_ += sum(1 for ok in pipe.execute() if ok)
    return set_


#: how often the coordinator refreshes its state in ``meta``
STATE_EVERY_S = 1.0


def publish_state(
    client: Any,
    meta_key: str,
    summary: dict[str, Any],
    *,
    heard: list[float] | None = None,
    resources: Sequence[ResourceSample | None] | None = None,
    behind_s: float | None = None,
) -> None:
    """The fields of ``meta`` that ``flodl-bus status`` reads (launch/status.py).
    ``heard``: per rank, seconds since the coordinator last took a verified entry from it;
    ``resources``: per rank, its newest resource sample (None: none yet); ``behind_s``:
    how long the loop has been behind its input (None: it keeps up; written empty)."""
    gate = summary.get("gate") or {}
    fields = {
        "dead": json.dumps(list(summary.get("dead", []))),
        "exited": json.dumps(list(summary.get("exited", []))),
        "state_at": repr(time.time()),
        "phase": str(summary.get("phase", "")),
        "rank_epoch": json.dumps(list(summary.get("rank_epoch", []))),
        "anchor": str(summary.get("anchor", "")),
        # ElChe's window per rank (batches before the next averaging), for the dashboard
        "counts": json.dumps(list(summary.get("counts", []))),
        "gate_open": "1" if gate.get("open") else "0",
        "gate_why": str(gate.get("why", "")),
        "syncs": str(summary.get("version", "")),
        "behind_s": "" if behind_s is None else f"{behind_s:.1f}",
    }
    if heard is not None:
        fields["heard_s"] = json.dumps(heard)
    if resources is not None:
        fields["resources"] = json.dumps([resources_to_map(r) for r in resources])
    try:
        client.hset(meta_key, mapping=fields)
    except RedisError as exc:  # a status line must never stop the run
        import structlog

        structlog.get_logger("flodl_bus.coordinator").warning(
            "state_not_published", error=repr(exc)[:200]
        )


def _ingest_procs(asked: int | None, world_size: int) -> int:
    """``--ingest-procs``: as asked, or ``auto``'s choice for this world and host."""
    if asked is not None:
        return asked
    k = auto_procs(world_size, os.cpu_count())
    if k:
        import structlog

        structlog.get_logger("flodl_bus.coordinator").info(
            "ingest_procs_auto", ingest_procs=k, world_size=world_size
        )
    return k
