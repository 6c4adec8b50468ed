"""``flodl-bus up``: Redis (embedded unless given), a coordinator and N workers, watched.

    flodl-bus up [--job MODULE:NAME] [--workers N] [--mode MODE] [--redis-url URL]
                 [--epochs N] [--run RUN] [--run-dir DIR] [--save-path STEM] [--resume STEM]
                 [--script PATH [ARGS...]]   (instead of --job: a script with its own loop)

The launcher is an observer: it reads the run's streams with plain XREAD (it never
takes an entry from the coordinator or a rank) and draws progress, the epoch table and
the summary from what crosses the control plane. The processes write their own records
under the run directory; the launcher adds ``up.jsonl`` (what it saw and did), the logs
of each child, ``plot.png`` and, when the coordinator left none, ``metrics.csv``.

Exit status: the table of ``flodl_bus.exits`` (README.md, "Exit codes"), computed from
the children's outcomes by ``run_exit_code``; never a child's raw status.

The launcher supervises: when a rank's process exits without the run having told it to
(a kill, a crash), it tells the coordinator at once on a pipe the coordinator inherits
(``--supervisor-fd``, ``coordinator.supervisor``), so the survivors re-form now instead
of after the heartbeat timeout. If the launcher itself dies, the coordinator reads end
of file there and stops the run in order.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import os
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import redis

from flodl_bus.bus.connection import ENV_URL, connect, redact_url
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.run_secret import ENV_COORD_SEED, ENV_SECRET
from flodl_bus.bus.server import free_fixed_port
from flodl_bus.coordinator.supervisor import notice as supervisor_notice
from flodl_bus.exits import (
    CONFIG,
    by_signal,
    describe,
    signal_of,
)
from flodl_bus.launch import run_lock
from flodl_bus.launch.display import Progress, Summary, terminal_width
from flodl_bus.launch.outcome import (
    _row_fields,
    _signals_as_stop,
    _Stop,
    run_batches,
    run_exit_code,
    run_files,
)
from flodl_bus.launch.procs import Child, spawn, stop_all, thread_env, threads_per_worker
from flodl_bus.launch.up_args import (
    _default_run_id,
    _parser,
    check_args,
    coordinator_argv,
    job_label,
    script_tail,
    split_script,
    worker_argv,
    worker_env,
)
from flodl_bus.launch.view import EpochRow, RunView
from flodl_bus.launch.watch import Seen, StreamWatcher
from flodl_bus.params.hosts import pin_one_host
from flodl_bus.protocol.signing import KEY_BYTES, CoordinatorIdentity, new_secret
from flodl_bus.record.chain import raw_lines
from flodl_bus.record.dispatch import fresh_run_dir
from flodl_bus.record.log import Recorder
from flodl_bus.stop_signals import signal_name
from flodl_bus.worker.host import ENV_TUNE, tunes_threads

#: how long ranks may take to exit on their own once the coordinator is done
WORKER_EXIT_GRACE_S = 10.0
EXIT_INTERRUPTED = by_signal(signal.SIGINT)


class Launcher:
    """One ``flodl-bus up`` run: its processes, its observer, its record."""

    def __init__(
        self, args: argparse.Namespace, run: str, started: float, started_wall: float
    ) -> None:
        self.args = args
        self.run = run
        self.keys = RunKeys(run)
        self.started = started
        self.started_wall = started_wall
        asked = Path(args.run_dir or os.path.join("runs", run))
        # A reused run id must not write into the earlier run's directory: its records,
        # logs, metrics, plot and consensus model all move to one fresh sibling, chosen
        # here once and handed to every process (they then have nothing to rotate).
        self.run_dir = fresh_run_dir(asked, "coordinator")
        self.rotated_from = asked if self.run_dir != asked else None
        #: this launch made the directory: a refusal may remove it whole
        self.made_run_dir = not self.run_dir.exists()
        # Held for the whole run: a second launch with this run id refuses before it
        # writes or removes anything here (run_lock.RunDirBusy, raised to main).
        self.run_lock = run_lock.take(self.run_dir)
        self.record = Recorder(self.run_dir / "up.jsonl", role="up")
        self.secret = new_secret()
        # The coordinator's keys come from up: its console checks the ranks' entries as
        # the coordinator does. Only the coordinator's environment carries the seed.
        self.coordinator_seed = secrets.token_bytes(KEY_BYTES)
        self.view = RunView(args.workers, started, eval_every=args.eval_every)
        self.rows: list[EpochRow] = []
        self.children: list[Child] = []
        self.coordinator: Child | None = None
        self.progress: Progress | None = None
        self.watcher: StreamWatcher | None = None
        self.server: Any = None
        self.client: Any = None
        #: ``--dashboard``: the page's server and its own Redis client
        self.dashboard: Any = None
        self._dashboard_client: Any = None
        self.interrupted = False
        #: the stop signal the launcher got, if any
        self.stop_signum: int | None = None
        #: the children outlived the others by WORKER_EXIT_GRACE_S and had to be stopped
        self.lingered = False
        #: the write end of the coordinator's ``--supervisor-fd`` pipe
        self._supervisor_w: int | None = None
        self._reported: set[str] = set()
        #: children's exit lines for refusals before any step, said by ``_finish``
        self._refusals: list[str] = []
        self._csv_mtime = -1
        #: the coordinator's record header, once read (the job's name and target)
        self._header: dict[str, Any] | None = None
        #: why ``_start`` gave up (one line), for the record's summary
        self.start_error: str | None = None

    # ------------------------------------------------------------------ run
    def run_all(self) -> int:
        try:
            with _signals_as_stop():
                rc = self._start()
                if rc is not None:
                    # The record still ends in a summary, so a reader of up.jsonl can
                    # tell a run that never started from one that was cut off.
                    self.record.record(
                        "summary", started=False, error=self.start_error, exit_code=rc
                    )
                    return rc
                self._watch()
        except (KeyboardInterrupt, _Stop) as exc:
            self.interrupted = True
            self.stop_signum = exc.signum if isinstance(exc, _Stop) else int(signal.SIGINT)
            self.record.record(
                "interrupted",
                at=time.monotonic() - self.started,
                signal=signal_name(self.stop_signum),
            )
        finally:
            # A second Ctrl-C must not cut the shutdown short and leave orphans; the
            # stop stages are bounded, so nothing hangs here.
            stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
            previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stopping}
            try:
                self._stop()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        try:
            return self._finish(time.monotonic() - self.started)
        finally:
            self.run_lock.release()

    def _start(self) -> int | None:
        args = self.args
        url = args.redis_url
        if url is None:
            from flodl_bus.bus.server import RedisServer, RedisServerError

            try:
                # Its own session: a Ctrl-C at the terminal reaches this process's
                # group, and Redis must outlive the in-order stop that follows (the
                # coordinator's Shutdown, the ranks' saves go through it).
                self.server = RedisServer(own_session=True).start()
            except RedisServerError as exc:
                self.start_error = str(exc)
                print(f"flodl-bus up: {exc}", file=sys.stderr)
                return 2
            url = self.server.url
        self.record.record(
            "up",
            run=self.run,
            job=job_label(args),
            mode=args.mode,
            workers=args.workers,
            epochs=args.epochs,
            redis_url=redact_url(url),
            embedded=self.server is not None,
            redis_binary=None if self.server is None else self.server.binary,
            started_at=self.started_wall,
        )
        try:
            self.client = connect(url, client_name="flodl-up")
            self.client.ping()
        except Exception as exc:
            self.start_error = (
                f"cannot reach Redis at {redact_url(url)} ({type(exc).__name__}: {exc})"
            )
            print(f"flodl-bus up: {self.start_error}", file=sys.stderr)
            return 2
        dashboard_line = ""
        if args.dashboard:
            from flodl_bus.launch.dashboard import Dashboard

            self._dashboard_client = connect(url, client_name="flodl-dashboard")
            self.dashboard = Dashboard(self._dashboard_client, self.run, port=args.dashboard_port)
            try:
                dashboard_line = f"\n  dashboard: {self.dashboard.start()}"
            except OSError as exc:
                self.dashboard = None
                self.start_error = (
                    f"--dashboard: cannot bind 127.0.0.1:{args.dashboard_port} "
                    f"({exc.strerror or exc}); another --dashboard-port, or 0 for any free one"
                )
                print(f"flodl-bus up: {self.start_error}", file=sys.stderr)
                return 2
        self.watcher = StreamWatcher(
            self.client,
            self.keys,
            args.workers,
            CoordinatorIdentity.from_seed(self.coordinator_seed),
        )
        # The URL (it may carry a password) and the secret reach the children through
        # their environment, never their command line (visible in ps and /proc).
        base_env = {
            **os.environ,
            ENV_SECRET: self.secret.hex(),
            ENV_URL: url,
            "PYTHONUNBUFFERED": "1",
        }
        pin_one_host(base_env)  # every rank is on this host: its groups stay on loopback
        # torchrun's rendezvous, for the job's own torch.distributed (a default process
        # group from init_process_group, a metric's all_reduce...); the bus's own groups
        # never use it. Set by the caller, the caller's wins.
        base_env.setdefault("MASTER_ADDR", "127.0.0.1")
        # Below the ephemeral range: no socket of the ranks (gloo pairs, stores) can be
        # handed it between now and rank 0's bind (EADDRINUSE under load).
        base_env.setdefault("MASTER_PORT", str(free_fixed_port()))
        threads = threads_per_worker(args.workers, env=os.environ)
        # The split above is a default unless the caller asked for a count: each rank
        # then sizes its threads to the work from it (``worker.threads``).
        tune = {ENV_TUNE: "1" if tunes_threads(os.environ) else "0"}
        # The supervisor pipe: only the coordinator inherits its read end (pipes are
        # not inheritable by default; pass_fds makes this one so for that child alone).
        read_end, self._supervisor_w = os.pipe()
        try:
            self.coordinator = spawn(
                "coordinator",
                [
                    *coordinator_argv(args, self.run, self.run_dir),
                    "--supervisor-fd",
                    str(read_end),
                    *script_tail(args),
                ],
                {**thread_env(base_env, 1), ENV_COORD_SEED: self.coordinator_seed.hex()},
                self.run_dir / "coordinator.log",
                pass_fds=(read_end,),
            )
        finally:
            os.close(read_end)
        self.children.append(self.coordinator)
        for r in range(args.workers):
            self.children.append(
                spawn(
                    f"rank{r}",
                    worker_argv(args, self.run, r, self.run_dir),
                    {
                        **thread_env(base_env, threads),
                        **tune,
                        **worker_env(args, self.run, r, self.run_dir),
                        # Every rank of ``up`` is on this host, rank r of the workers: a
                        # LOCAL_* inherited from the caller's environment (a shell under
                        # another launcher) would give every rank the same local rank.
                        "LOCAL_RANK": str(r),
                        "LOCAL_WORLD_SIZE": str(args.workers),
                    },
                    self.run_dir / f"rank{r}.log",
                )
            )
        where = f"embedded at {redact_url(url)}" if self.server else redact_url(url)
        epochs = args.epochs or "the job's"
        if args.mode.startswith("nccl") and not _gpu_likely(args.device):
            print(
                f"flodl-bus up: {args.mode} without a GPU: the ranks average over gloo on "
                "the CPU (each rank's log says what it found)",
                flush=True,
            )
        print(
            f"flodl-bus up: run {self.run}: {job_label(args)}, {args.workers} workers x "
            f"{threads} thread(s), {args.mode}, {epochs} epochs, Redis {where}\n"
            f"  record: {self.run_dir}/   watch: flodl-bus tail --run {self.run} "
            f"--redis-url {redact_url(url)}{dashboard_line}"
            + (
                f"\n  {self.rotated_from}/ holds an earlier run of this id: it is left as it "
                f"is, this run goes to {self.run_dir}/"
                if self.rotated_from is not None
                else ""
            ),
            flush=True,
        )
        bars = not args.no_progress and sys.stderr.isatty()
        self.progress = Progress(args.workers, None, bars=bars, width=terminal_width(sys.stdout))
        return None

    def _after_first_step(self) -> None:
        header = self._read_header()
        if header is not None and self.progress is not None:
            self.progress.set_total(run_batches(header))

    def _read_header(self) -> dict[str, Any] | None:
        """The coordinator's record header, read once it is on disk: the view learns the
        run's last epoch from it, whose row waits for the rounds after it."""
        if self._header is None:
            header = self._coordinator_header()
            if header is not None:
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    self.view.set_epochs(int(header["config"]["num_epochs"]))
                self._header = header
        return self._header

    def _coordinator_header(self) -> dict[str, Any] | None:
        try:
            # plain or zstd (readable while it is written): record.chain reads both
            first = next(raw_lines(self.run_dir / "coordinator.jsonl"), b"")
            header = orjson.loads(first)
        except (OSError, ValueError, orjson.JSONDecodeError):
            return None
        return header if isinstance(header, dict) and header.get("event") == "run" else None

    def _job_facts(self) -> tuple[str, float | None]:
        """The job's name and target metric, from the coordinator's record header. The
        launcher never imports the job itself: importing torch takes seconds of a core,
        and done beside the ranks' first steps it stalled them (a rank's intra-op
        threads wait at every barrier for the one the scheduler took away)."""
        header = self._header or self._coordinator_header() or {}
        name = header.get("job_name")
        target = header.get("target_metric")
        return (
            name if isinstance(name, str) else job_label(self.args),
            float(target) if isinstance(target, int | float) else None,
        )

    def _say(self, line: str) -> None:
        if self.progress is not None:
            self.progress.write(line)
        else:
            print(line, flush=True)

    def _apply(self, seen: Seen) -> None:
        # An entry id is the writer's wall clock in ms: when the step happened, not
        # when this poll saw it. Mapped onto the launch's monotonic clock (and never
        # later than now, should the writer's clock run ahead).
        now = min(time.monotonic(), self.started + seen.entry_id[0] / 1000 - self.started_wall)
        if seen.upstream:
            assert seen.rank is not None
            self.view.on_upstream(seen.rank, seen.msg, now)
        else:
            self.view.on_control(seen.rank, seen.msg, now)

    def _read_anchors(self) -> None:
        """The coordinator's anchor per epoch, from its metrics.csv (when it changed)."""
        path = self.run_dir / "metrics.csv"
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            return
        if mtime == self._csv_mtime:
            return
        self._csv_mtime = mtime
        try:
            with open(path, newline="") as f:
                for line in csv.DictReader(f):
                    epoch, anchor = line.get("epoch"), line.get("anchor")
                    if epoch and anchor:
                        self.view.note_anchor(int(epoch), int(anchor))
        except (OSError, ValueError, csv.Error):
            return  # a half-written file; the next change brings a whole one

    def _show_rows(self, final: bool) -> None:
        assert self.progress is not None
        if self.view.rows_pending():
            self._read_anchors()
        for row in self.view.rows_ready(final=final):
            self.progress.rows([row])
            self.rows.append(row)
            self.record.record("epoch", **_row_fields(row))
        late = self.view.take_late_evals()
        if late:
            self.progress.late_evals(late)
            for epoch, metric in late:
                self.record.record("late_eval", epoch=epoch, metric=metric)

    def _note_exits(self) -> None:
        for c in self.children:
            rc = c.returncode
            if rc is None or c.name in self._reported:
                continue
            self._reported.add(c.name)
            self.record.record("exit", child=c.name, rc=rc, at=time.monotonic() - self.started)
            if rc != 0 and self.interrupted and signal_of(rc) is not None:
                # the stop this launcher passed on: expected, not a failure
                self._say(f"  {c.name} {describe(rc)}")
            elif rc != 0:
                line = f"  {c.name} {describe(rc)} (log: {c.log_path})"
                if rc == CONFIG and self.view.first_step_at is None:
                    # a refusal before any step: said at the end, once (``_finish``)
                    self._refusals.append(line)
                else:
                    self._say(line)
                rank = self._rank_of_child(c)
                if rank is not None:
                    self._tell_coordinator(rank, rc)

    def _rank_of_child(self, c: Child) -> int | None:
        if c is self.coordinator or not c.name.startswith("rank"):
            return None
        return int(c.name[len("rank") :])

    def _tell_coordinator(self, rank: int, rc: int) -> None:
        """A rank's process is gone: the coordinator re-forms the survivors now rather
        than after the heartbeat timeout (a no-op there if the rank said Exiting)."""
        w = self._supervisor_w
        if w is None:
            return
        try:
            os.write(w, supervisor_notice(rank, rc))
        except OSError:  # the coordinator is gone itself; its exit is noted on its own
            return
        self.record.record("told_coordinator", rank=rank, rc=rc, at=time.monotonic() - self.started)

    def _close_supervisor(self) -> None:
        w, self._supervisor_w = self._supervisor_w, None
        if w is not None:
            with contextlib.suppress(OSError):
                os.close(w)

    def _watch(self) -> None:
        """Follow the run until every child exited (or the survivors lingered)."""
        assert self.watcher is not None and self.progress is not None
        assert self.coordinator is not None
        coordinator, view, progress = self.coordinator, self.view, self.progress
        workers = [c for c in self.children if c is not coordinator]
        first_step_logged = False
        quiet_since: float | None = None
        redis_down = False
        # A full Redis (noeviction) stalls the run without an error: say it, once.
        from flodl_bus.launch.redis_memory import RedisMemoryWatch

        memory = RedisMemoryWatch(self.client)
        while True:
            try:
                for seen in self.watcher.poll(block_ms=200):
                    self._apply(seen)
                redis_down = False
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                # The watcher only observes: a Redis hiccup must not stop a healthy run.
                # Its cursors survive, so nothing is missed once Redis answers again.
                if not redis_down:
                    progress.write(f"  Redis unreachable ({type(exc).__name__}); still watching")
                    redis_down = True
                time.sleep(0.5)
            if (memory_line := memory.poll()) is not None:
                progress.write(memory_line)
            if not first_step_logged and view.first_step_at is not None:
                first_step_logged = True
                t = view.time_to_first_step()
                self.record.record("first_step", after_s=t)
                progress.write(f"  first training step after {t:.2f}s")
                self._after_first_step()
            elif first_step_logged and self._header is None:
                # The record's writer gathers lines: its header may reach the disk after
                # the first step. Without it the last epoch's row went out at its
                # aggregate, short of the final averaging's rounds (seen once in CI).
                self._read_header()
            progress.update(view)
            self._show_rows(final=False)
            self._note_exits()
            now = time.monotonic()
            coord_rc = coordinator.returncode
            if coord_rc is not None and coord_rc != 0:
                return
            if coord_rc == 0 and all(c.returncode is not None for c in workers):
                return
            if coord_rc is None and any(c.returncode is None for c in workers):
                quiet_since = None
                continue
            # Either the coordinator finished and ranks linger, or every rank is gone
            # and the coordinator waits for heartbeats that will not come.
            if quiet_since is None:
                quiet_since = now
            elif now - quiet_since > WORKER_EXIT_GRACE_S:
                who = "workers" if coord_rc == 0 else "the coordinator"
                progress.write(f"  {who} still running after the others finished: stopping")
                self.lingered = True
                return

    def _stop(self) -> None:
        if self.children:
            stages = stop_all(self.children, self.coordinator)
            if stages:
                self.record.record("stopped", stages=stages, at=time.monotonic() - self.started)
            # Every child is gone: nothing more to tell the coordinator (exits noted
            # below happened while the run was being stopped).
            self._close_supervisor()
            self._note_exits()
        if self.watcher is not None:
            with contextlib.suppress(Exception):
                self.watcher.drain(self._apply)
        if self.progress is not None:
            self.progress.update(self.view)
            self.progress.close()
            self._read_header()
            self._show_rows(final=True)
        if self.dashboard is not None:
            self.dashboard.close()
        if self._dashboard_client is not None:
            with contextlib.suppress(Exception):
                self._dashboard_client.close()
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        if self.server is not None:
            self.server.cleanup()

    # -------------------------------------------------------------- closing
    def _refused(self) -> str | None:
        """The coordinator's one-line refusal, when it exited with bad configuration
        before any training step (a --job that is no Job, a bad resume point...)."""
        c = self.coordinator
        if c is None or c.returncode != CONFIG or self.view.first_step_at is not None:
            return None
        try:
            lines = [ln for ln in c.log_path.read_text(errors="replace").splitlines() if ln]
        except OSError:
            return None
        last = lines[-1] if lines else ""
        return last.removeprefix("flodl-bus coordinator: ") or None

    def _finish(self, wall: float) -> int:
        args, view, run_dir = self.args, self.view, self.run_dir
        refused = self._refused()
        if refused is not None and not self.interrupted:
            # Refused before anything ran: one line, and no run directory left behind
            # (it would hold nothing but that line).
            self.record.close()
            if self.made_run_dir:
                shutil.rmtree(run_dir, ignore_errors=True)
                with contextlib.suppress(OSError):
                    run_dir.parent.rmdir()  # runs/, when this run made it and it is empty
            else:
                # A directory that was there before: only what this launch wrote goes.
                mine = [run_dir / "up.jsonl", run_dir / run_lock.LOCK_NAME]
                mine += [c.log_path for c in self.children]
                for path in mine:
                    with contextlib.suppress(OSError):
                        path.unlink()
            print(f"flodl-bus up: {refused}", file=sys.stderr, flush=True)
            return CONFIG
        for line in self._refusals:
            print(line, flush=True)
        # Evals that came after their row was shown belong in the files all the same.
        self.rows = [
            dataclasses.replace(row, metric=view.evals.get(row.epoch + 1, row.metric))
            for row in self.rows
        ]
        job_name, target_metric = self._job_facts()
        if self.rows or view.total_batches:
            from flodl_bus.launch.plot import write_outputs

            title = f"{self.run}: {job_label(args)} ({args.mode})"
            write_outputs(run_dir, view, self.rows, title, plot=not args.no_plot)
        workers = [c for c in self.children if c is not self.coordinator]
        summary = Summary(
            run=self.run,
            run_dir=str(run_dir),
            job=job_name,
            mode=args.mode,
            workers=args.workers,
            interrupted=self.interrupted,
            coordinator_rc=None if self.coordinator is None else self.coordinator.returncode,
            worker_rcs=tuple(c.returncode for c in workers),
            final_metric=view.final_metric,
            target_metric=target_metric,
            wall_s=wall,
            first_step_s=view.time_to_first_step(),
            syncs=view.syncs,
            batches=view.total_batches,
            skipped=view.skipped,
            files=run_files(run_dir),
        )
        code = run_exit_code(
            summary.coordinator_rc,
            summary.worker_rcs,
            signum=self.stop_signum,
            lingered=self.lingered,
            target_missed=bool(args.require_target and summary.reached_target is False),
        )
        self.record.record(
            "summary",
            exit_code=code,
            interrupted=self.interrupted,
            final_metric=summary.final_metric,
            target_metric=summary.target_metric,
            reached_target=summary.reached_target,
            wall_s=wall,
            first_step_s=summary.first_step_s,
            syncs=summary.syncs,
            batches=summary.batches,
            skipped=summary.skipped,
            coordinator_rc=summary.coordinator_rc,
            worker_rcs=list(summary.worker_rcs),
            rejected_entries=0 if self.watcher is None else self.watcher.rejected,
        )
        self.record.close()
        print("\n".join(summary.lines(terminal_width(sys.stdout))), flush=True)
        return code


def main(argv: Sequence[str] | None = None) -> int:
    given, script_args = split_script(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_args(given)
    args.script_args = script_args
    started, started_wall = time.monotonic(), time.time()
    wrong = check_args(args, given)
    if wrong is not None:
        print(f"flodl-bus up: {wrong}", file=sys.stderr)
        return 2
    run = args.run or _default_run_id()
    try:
        launcher = Launcher(args, run, started, started_wall)
    except run_lock.RunDirBusy as exc:
        print(f"flodl-bus up: {exc}", file=sys.stderr)
        return CONFIG
    return launcher.run_all()


def _gpu_likely(device: str) -> bool:
    """Whether the ranks will see a GPU, told without importing torch (``up`` never
    does): ``--device``, ``CUDA_VISIBLE_DEVICES`` hiding every device, or no NVIDIA
    driver node. The ranks' own logs say what they found."""
    if device == "cpu":
        return False
    if device.startswith("cuda"):
        return True
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl")
