"""``flodl-bus coordinator``: a bad configuration exits 2 with one line naming the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from flodl_bus.bus import run_secret
from flodl_bus.bus.join import JoinStream
from flodl_bus.bus.keys import RunKeys
from flodl_bus.coordinator import join_desk
from flodl_bus.coordinator.cli import _reset_run, main
from flodl_bus.coordinator.cli_args import ignored_settings
from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.runtime import EXIT_INTERRUPTED
from flodl_bus.protocol.messages import Assign, Hello
from flodl_bus.protocol.signing import CoordinatorIdentity

BASE = ["--run", "r1", "--job", "flodl_bus.examples.digits:job", "--world-size", "2"]
DEAD_REDIS = "redis://127.0.0.1:1/0"
HOOKS = ["--run", "r1", "--job", "tests.e2e.jobs:hooks_job", "--world-size", "2"]


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        ([*BASE, "--mode", "nccl-async"], "use cpu-async, or nccl-cadence"),
        ([*BASE, "--mode", "gpu-sync"], "expected one of"),
        (["--run", "r1", "--world-size", "2"], "one of the arguments --job --script is required"),
        ([*BASE, "--script", "train.py"], "argument --script: not allowed with argument --job"),
        ([*BASE, "--log-level", "LOUD"], "invalid choice: 'loud'"),
        (["--run", "r1", "--job", "flodl_bus.examples.digits:job"], "give --world-size N"),
        (["--run", "bad run!", *BASE[2:]], "--run"),
        ([*BASE, "--min-workers", "3"], "exceeds --world-size"),
        ([*BASE, "--checkpoint-every", "1"], "needs --save-path"),
        ([*BASE, "--checkpoint-at-epoch", "2"], "--checkpoint-at-epoch needs --save-path"),
        ([*BASE, "--save-path", "s", "--checkpoint-at-epoch", "0"], "must be >= 1"),
        ([*BASE, "--epochs", "3", "--save-path", "s", "--checkpoint-at-epoch", "3"], "use 1..2"),
        # A job with its own checkpoint_fn needs no --save-path: past that check
        ([*HOOKS, "--checkpoint-every", "1", "--redis-url", DEAD_REDIS], "fix --redis-url"),
        ([*BASE, "--heartbeat-timeout", "0"], "--heartbeat-timeout must be positive"),
        ([*BASE, "--bogus"], "unrecognized arguments: --bogus"),
        (["--run", "r1", "--job", "nosuch.module:job", "--world-size", "2"], "nosuch"),
        ([*BASE, "--redis-url", DEAD_REDIS], "start it or fix --redis-url"),
    ],
)
def test_bad_config_exits_2_with_one_line_naming_the_fix(
    argv: list[str], fix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flodl-bus coordinator: "), err
    assert fix in err, err


def test_resume_from_a_missing_or_foreign_meta_is_refused_before_redis_is_touched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stem = tmp_path / "ckpt"
    argv = [*BASE, "--redis-url", DEAD_REDIS, "--resume", str(stem)]
    assert main(argv) == 2
    assert "no checkpoint meta at" in capsys.readouterr().err
    Path(f"{stem}.meta.json").write_text('{"schema": 5, "coverage": {"batch_size": 64}}')
    # A meta whose model was never written (a save cut short) is no resume point.
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no consensus model at {stem}.model.pt" in err, err
    Path(f"{stem}.model.pt").write_bytes(b"")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "resume with the same" in err, err


@pytest.mark.redis
def test_a_run_id_an_earlier_coordinator_used_is_refused_unless_reset(
    real_redis: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = RunKeys("used")
    real_redis.hset(keys.meta, mapping={"status": "finished"})
    real_redis.xadd(keys.ctl(0), {"type": "StartEpoch"})
    real_redis.set(keys.secret, "ab" * 16)
    argv = [
        "--run", "used", "--job", "flodl_bus.examples.digits:job", "--world-size", "1",
        "--redis-url", redis_url, "--join-timeout", "0.5",
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --reset-run" in err, err
    assert real_redis.xlen(keys.ctl(0)) == 1  # refused: nothing touched

    # --reset-run deletes every key of the run, its streams and its secret included.
    assert _reset_run(real_redis, keys) == 2
    assert not real_redis.exists(keys.meta, keys.ctl(0), keys.secret)


@pytest.mark.redis
def test_a_run_whose_world_never_formed_still_expires_its_keys_and_secret(
    real_redis: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = RunKeys("never-formed")
    argv = [
        "--run", "never-formed", "--job", "flodl_bus.examples.digits:job", "--world-size",
        "1", "--redis-url", redis_url, "--join-timeout", "0.5", "--expire-after", "300",
    ]  # fmt: skip
    assert main(argv) == 2
    assert "did not form" in capsys.readouterr().err
    assert real_redis.hget(keys.meta, "status") == b"not formed"
    for name in (keys.meta, keys.secret, keys.identity):
        assert 0 < real_redis.ttl(name) <= 300, name


@pytest.mark.redis
def test_a_hello_said_the_moment_the_identity_is_published_is_admitted(
    real_redis: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker polls for the identity and says Hello as soon as it sees it; on a loaded
    machine that can land before the coordinator's next command. Such a Hello is this
    run's and must take a rank (it once went unread: the world never formed)."""
    said: list[str] = []
    workers: list[JoinStream] = []
    real_publish = run_secret.publish_identity

    def publish_then_hello(
        client: redis.Redis, k: RunKeys, identity: CoordinatorIdentity, secret: bytes
    ) -> None:
        real_publish(client, k, identity, secret)
        # The worker's side, before the coordinator runs another line.
        sig = client.hget(k.meta, "dataset_sig")
        assert isinstance(sig, bytes)
        workers.append(JoinStream(client, k, secret, answers=identity.signing.public))
        said.append(workers[0].post(Hello("quick", "h", sig.decode())))

    formed: list[int | None] = []
    real_form = join_desk.form_world

    def form_then_stop(desk: join_desk.JoinDesk, **kw: Any) -> None:
        real_form(desk, **kw)
        formed.append(desk.admission.world_size)
        raise join_desk.Interrupted("the test stops here: no rank runs")

    monkeypatch.setattr(run_secret, "publish_identity", publish_then_hello)
    monkeypatch.setattr(join_desk, "form_world", form_then_stop)
    argv = [
        "--run", "quick-hello", "--job", "flodl_bus.examples.digits:job", "--world-size",
        "1", "--redis-url", redis_url, "--join-timeout", "0.5", "--expire-after", "300",
    ]  # fmt: skip
    assert main(argv) == EXIT_INTERRUPTED
    assert len(said) == 1 and formed == [1]
    answers = [m for _, m in workers[0].read(said[0], None)[0] if isinstance(m, Assign)]
    assert [(a.worker_id, a.rank) for a in answers] == [("quick", 0)]


def test_async_only_settings_given_to_another_mode_are_named_for_a_warning() -> None:
    def cfg(mode: str, **kw: object) -> CoordinatorConfig:
        return CoordinatorConfig(
            mode=mode, world_size=2, total_samples=100, batch_size=1, num_epochs=1, **kw
        )

    both = {"max_overshoot": 5, "relax_up": True}
    assert [k for k, _ in ignored_settings(cfg("cpu-cadence", **both))] == [
        "max_overshoot",
        "relax_up",
    ]
    assert ignored_settings(cfg("cpu-async", **both)) == []
    assert ignored_settings(cfg("nccl-cadence")) == []
