"""A real rank process (``flodl-bus worker``) driven by a scripted coordinator over a real
redis-server, training the digits model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from flodl_bus.bus.connection import connect
from flodl_bus.bus.join import JoinStream
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.run_secret import publish_identity
from flodl_bus.bus.streams import RedisCoordinatorBus
from flodl_bus.examples import digits
from flodl_bus.protocol.messages import (
    Batch,
    Checkpoint,
    CheckpointResult,
    EpochPlan,
    Exiting,
    ExtendPartition,
    Heartbeat,
    Hello,
    LrUpdate,
    MetricsMsg,
    Shutdown,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
)
from flodl_bus.protocol.signing import CoordinatorIdentity, CoordinatorKeys, new_secret
from flodl_bus.worker.rank import EXIT_COORDINATOR_LOST

pytestmark = [pytest.mark.redis, pytest.mark.slow]

BS = digits.job.batch_size


class ScriptedCoordinator:
    """Plays the coordinator for rank 0: publishes its identity, and once the worker's
    Hello is there (``attach``), derives the rank key from it as a real one does."""

    def __init__(self, client: redis.Redis, run: str, secret: bytes) -> None:
        self.client = client
        self.keys = RunKeys(run)
        self.secret = secret
        self.identity = CoordinatorIdentity.generate()
        publish_identity(client, self.keys, self.identity, secret)
        self.received: list[object] = []
        self._bus: RedisCoordinatorBus | None = None

    def attach(self, timeout: float = 60.0) -> None:
        join = JoinStream(self.client, self.keys, self.secret, signer=self.identity.signing)
        cursor, deadline = "0", time.monotonic() + timeout
        while time.monotonic() < deadline:
            got, cursor = join.read(cursor, 200)
            for _, msg in got:
                if isinstance(msg, Hello) and msg.requested_rank == 0:
                    keys = CoordinatorKeys(
                        self.identity.signing,
                        {0: self.identity.rank_key(self.keys.run, 0, msg.kx_pub)},
                    )
                    self._bus = RedisCoordinatorBus(self.client, self.keys, keys, ranks=[0])
                    return
        raise AssertionError("the worker never said Hello")

    @property
    def bus(self) -> RedisCoordinatorBus:
        assert self._bus is not None, "attach() first: the rank key comes from its Hello"
        return self._bus

    def send(self, *msgs: object) -> None:
        for m in msgs:
            self.bus.send(0, m)  # type: ignore[arg-type]

    def read(self, seconds: float) -> list[object]:
        """Everything rank 0 published in the next ``seconds`` (heartbeats included)."""
        got: list[object] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            deliveries = self.bus.read_upstream(min(100, max(1, int(left * 1000))))
            self.bus.ack(deliveries)
            got += [d.msg for d in deliveries]
        self.received += got
        return got

    def wait_for(self, cls: type, timeout: float = 60.0) -> object:
        deadline = time.monotonic() + timeout
        seen = len(self.received)
        while time.monotonic() < deadline:
            for m in self.received[seen:]:
                if isinstance(m, cls):
                    return m
            seen = len(self.received)
            deliveries = self.bus.read_upstream(100)
            self.bus.ack(deliveries)
            # Keep the whole read: what follows the awaited message is part of the flow.
            self.received += [d.msg for d in deliveries]
        raise AssertionError(f"no {cls.__name__} within {timeout}s; got {self.received[-5:]}")

    def control_plane(self) -> list[object]:
        return [m for m in self.received if not isinstance(m, Heartbeat)]

    def close(self) -> None:
        if self._bus is not None:  # its trimmer thread would outlive the test's server
            self._bus.close()


@pytest.fixture
def run_id() -> str:
    return f"worker-it-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = connect(redis_url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def scripted(client: redis.Redis, run_id: str) -> Iterator[Callable[[bytes], ScriptedCoordinator]]:
    made: list[ScriptedCoordinator] = []

    def make(secret: bytes) -> ScriptedCoordinator:
        made.append(ScriptedCoordinator(client, run_id, secret))
        return made[-1]

    yield make
    for c in made:
        c.close()


def start_worker(
    redis_url: str,
    run: str,
    secret: bytes,
    *extra: str,
    job: str = "flodl_bus.examples.digits:job",
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    if env is None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
    env = dict(env, FLODL_RUN_SECRET=secret.hex())
    args = [
        sys.executable,
        "-m",
        "flodl_bus.cli",
        "worker",
        "--run",
        run,
        "--rank",
        "0",
        "--world-size",
        "1",
        "--job",
        job,
        "--redis-url",
        redis_url,
        "--log-level",
        "warning",
        *extra,
    ]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"worker did not exit:\n{out.decode()[-3000:]}") from None
    return proc.returncode, out.decode()


def test_a_rank_process_trains_through_throttle_sync_extend_checkpoint_and_shutdown(
    redis_url: str,
    client: redis.Redis,
    run_id: str,
    tmp_path: Path,
    scripted: Callable[[bytes], ScriptedCoordinator],
) -> None:
    secret = new_secret()
    coord = scripted(secret)
    stem = tmp_path / "ckpt"
    proc = start_worker(
        redis_url, run_id, secret, "--save-path", str(stem), "--heartbeat-interval", "0.2"
    )
    coord.attach()
    # Sent as the rank says Hello, long before it has built its model and reads: its
    # first read carries both, so it trains exactly one batch, then the Throttle parks it.
    coord.send(StartEpoch(EpochPlan(epoch=0, partition_offset=0, partition_size=4 * BS)))
    coord.send(Throttle())
    try:
        first = coord.wait_for(Batch)
        assert isinstance(first, Batch) and first.step_count == 1
        # Throttled: heartbeats keep coming, batches do not.
        quiet = coord.read(0.8)
        assert not any(isinstance(m, Batch) for m in quiet)
        assert any(isinstance(m, Heartbeat) for m in quiet)

        # Serviced while throttled, without releasing it.
        coord.send(ExtendPartition(partition_offset=4 * BS, partition_size=2 * BS))
        coord.send(Checkpoint(version=1, target_rank=0))
        result = coord.wait_for(CheckpointResult)
        assert result == CheckpointResult(
            rank=0,
            version=1,
            elapsed_ms=result.elapsed_ms,
            error=None,  # type: ignore[attr-defined]
        )
        assert (tmp_path / "ckpt.v1.pt").exists()
        assert not any(isinstance(m, Batch) for m in coord.read(0.3))

        coord.send(SyncNow())  # releases the throttle
        metrics = coord.wait_for(MetricsMsg)
        coord.send(Shutdown())
        coord.wait_for(Exiting)
    finally:
        rc, out = finish(proc)
    assert rc == 0, out

    flow = coord.control_plane()
    kinds = [type(m) for m in flow]
    # the LR is reported once: it never changed
    assert kinds == (
        [Batch, LrUpdate, CheckpointResult, SyncAck] + [Batch] * 5 + [MetricsMsg, Exiting]
    ), out
    sync_ack = flow[3]
    assert isinstance(sync_ack, SyncAck)
    assert sync_ack.step_count == 2 and sync_ack.divergence == 0.0
    assert [b.step_count for b in flow if isinstance(b, Batch)] == [1, 3, 4, 5, 6, 7]
    assert isinstance(metrics, MetricsMsg)
    # The extension was trained before the plan completed.
    assert (metrics.epoch, metrics.batches_processed, metrics.samples_processed) == (
        0,
        6,
        6 * BS,
    )
    assert 0.0 < metrics.avg_loss < 3.0


@pytest.mark.parametrize("launcher_threads", [None, 3], ids=["own-share", "launchers-omp"])
def test_a_rank_process_sees_torchruns_variables_takes_its_cores_and_trains_a_torch_dataset(
    launcher_threads: int | None,
    redis_url: str,
    client: redis.Redis,
    run_id: str,
    tmp_path: Path,
    scripted: Callable[[bytes], ScriptedCoordinator],
) -> None:
    seen_path = tmp_path / "seen.json"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    # The launcher says two ranks share this host: this one takes half of the cores.
    env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", FLODL_TEST_SEEN=str(seen_path))
    if launcher_threads is not None:
        # torch is told the launcher's count: from the environment alone it took MKL's
        # own (at most the cores), not the count the baselines give torch (issue 27).
        env["OMP_NUM_THREADS"] = str(launcher_threads)
    env["FLODL_DATA_WORKERS"] = "2"
    secret = new_secret()
    coord = scripted(secret)
    proc = start_worker(
        redis_url, run_id, secret, "--no-record", job="tests.worker.jobs:dataset_job", env=env
    )
    coord.attach()
    coord.send(StartEpoch(EpochPlan(epoch=0, partition_offset=0, partition_size=20 * BS)))
    try:
        metrics = coord.wait_for(MetricsMsg)
        coord.send(Shutdown())
        coord.wait_for(Exiting)
    finally:
        rc, out = finish(proc, timeout=60.0)
    assert rc == 0, out
    seen = json.loads(seen_path.read_text())
    cores = len(os.sched_getaffinity(0))
    assert seen == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "threads": str(launcher_threads or max(1, cores // 2)),
    }
    assert isinstance(metrics, MetricsMsg)
    assert (metrics.batches_processed, metrics.samples_processed) == (20, 20 * BS)
    losses = [b.batch_loss for b in coord.control_plane() if isinstance(b, Batch)]
    assert len(losses) == 20 and sum(losses[-5:]) < sum(losses[:5])


def test_a_rank_whose_coordinator_falls_silent_stops_within_the_timeout(
    redis_url: str,
    client: redis.Redis,
    run_id: str,
    scripted: Callable[[bytes], ScriptedCoordinator],
) -> None:
    secret = new_secret()
    coord = scripted(secret)
    proc = start_worker(
        redis_url,
        run_id,
        secret,
        "--coord-liveness-timeout",
        "1.5",
        "--heartbeat-interval",
        "0.2",
    )
    coord.attach()
    coord.send(StartEpoch(EpochPlan(epoch=0, partition_offset=0, partition_size=2 * BS)))
    try:
        coord.wait_for(MetricsMsg)
        silent_since = time.monotonic()
        # Exiting is published once the training loop has stopped, before the teardown.
        coord.wait_for(Exiting, timeout=10)
        stopped_after = time.monotonic() - silent_since
        rc, out = finish(proc, timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == EXIT_COORDINATOR_LOST, out
    assert "coordinator_lost" in out
    # The silence is counted from the rank's last control entry, which came before the
    # plan ran, so the loop stops at most 1.5 s after the Metrics (plus scheduling slack).
    assert stopped_after < 1.5 + 1.5, stopped_after
    # The heartbeat thread stopped with the process.
    beats = [m for m in coord.read(0.6) if isinstance(m, Heartbeat)]
    assert beats == []


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        (["--run", "r", "--rank", "3", "--world-size", "2"], "use a rank in 0..1"),
        (["--run", "bad run!", "--rank", "0", "--world-size", "1"], "--run"),
        (["--run", "r", "--rank", "0", "--world-size", "1", "--job", "nosuch:job"], "nosuch"),
        (
            [
                "--run",
                "r",
                "--rank",
                "0",
                "--world-size",
                "1",
                "--redis-url",
                "redis://127.0.0.1:1/0",
            ],
            "fix --redis-url",
        ),
    ],
)
def test_bad_config_exits_with_one_line_naming_the_fix(
    argv: list[str], fix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flodl_bus.worker.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flodl-bus worker: ") and fix in err


@pytest.mark.parametrize(
    ("name", "value", "fix"),
    [
        ("FLODL_PREFETCH", "maybe", "use auto (on for a GPU), 1 (on) or 0 (off)"),
        ("FLODL_DATA_WORKERS", "two", "0 or more"),
        ("FLODL_NUM_THREADS", "0", "1 or more"),
        ("LOCAL_RANK", "5", "0 <= LOCAL_RANK < LOCAL_WORLD_SIZE"),
    ],
)
def test_a_bad_data_or_thread_setting_exits_with_one_line_before_reaching_redis(
    name: str,
    value: str,
    fix: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flodl_bus.worker.cli import main

    monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    # A closed loopback port: had the setting not been refused first, this would be the error.
    argv = [
        "--run",
        "r",
        "--rank",
        "0",
        "--world-size",
        "1",
        "--redis-url",
        "redis://127.0.0.1:1/0",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flodl-bus worker: ")
    assert name in err and fix in err
