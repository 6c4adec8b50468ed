"""Dial-in membership with real processes: workers started without ``--rank`` join on
the run's join stream, are given ranks in admission order, and train; a worker whose
training data differs is refused with both signatures named."""

from __future__ import annotations

import time

import msgpack
import pytest
import redis

from flodl_bus.bus.keys import RunKeys
from flodl_bus.examples import digits
from flodl_bus.job import model_signature
from flodl_bus.protocol import wire
from flodl_bus.replay import replay_run
from tests.e2e.harness import (
    Cluster,
    epoch_samples,
    final_metric,
    header,
    metrics_rows,
    new_run_id,
    received,
    records,
)
from tests.e2e.jobs import other_data_job, other_model_job

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def test_three_workers_without_ranks_dial_in_are_ranked_in_arrival_order_and_train(
    cluster: Cluster,
) -> None:
    run = new_run_id("dial")
    coord = cluster.coordinator(run, "--mode", "cpu-cadence", "--world-size", "3", "--epochs", "8")
    # No --mode, --job or --world-size: a joiner takes them from the coordinator.
    joiners = []
    for i in range(3):
        joiners.append(cluster.worker(run, f"joiner{i}"))
        time.sleep(0.3)
    codes = cluster.wait([coord, *joiners], timeout=120)
    assert codes == [0, 0, 0, 0], cluster.tails()

    run_dir = cluster.run_dir(run)
    recs = records(run_dir)
    members = header(recs)["members"]
    assert [m["rank"] for m in members] == [0, 1, 2]
    assert not any(m["requested"] for m in members)
    # Admission order is arrival order on the join stream.
    client = redis.Redis.from_url(cluster.redis_url, socket_timeout=10)
    try:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(RunKeys(run).join)  # type: ignore[assignment]
    finally:
        client.close()
    hellos = [wire.decode(f[b"body"]).worker_id for _, f in entries if f[b"type"] == b"Hello"]
    assert hellos == [m["worker_id"] for m in members]
    assert sorted(m["rank"] for m in received(recs, "Exiting")) == [0, 1, 2]
    rows = metrics_rows(run_dir)
    assert len(rows) == 8
    size = (len(digits.train_data()) // digits.job.batch_size) * digits.job.batch_size
    assert all(sum(epoch_samples(r, 3)) == size for r in rows)
    assert final_metric(run_dir) >= 0.9


def test_the_world_forms_at_min_workers_once_the_join_timeout_passed(cluster: Cluster) -> None:
    run = new_run_id("minw")
    # A join timeout the workers' start (torch's import) fits in on a loaded machine: at
    # 1 s the coordinator gave up before either had said Hello, and they waited on.
    coord = cluster.coordinator(
        run, "--mode", "nccl-cadence", "--min-workers", "2", "--join-timeout", "8", "--epochs", "2"
    )
    joiners = [cluster.worker(run, f"joiner{i}") for i in range(2)]
    codes = cluster.wait([coord, *joiners], timeout=120)
    assert codes == [0, 0, 0], cluster.tails()
    recs = records(cluster.run_dir(run))
    assert header(recs)["config"]["world_size"] == 2
    assert sorted(m["rank"] for m in received(recs, "Exiting")) == [0, 1]


def test_a_worker_with_other_training_data_is_refused_naming_both_signatures(
    cluster: Cluster,
) -> None:
    run = new_run_id("sig")
    coord = cluster.coordinator(run, "--mode", "cpu-sync", "--world-size", "2")
    bad = cluster.worker(run, "stranger", "--job", "tests.e2e.jobs:other_data_job")
    (code,) = cluster.wait([bad], timeout=60)
    err = bad.output().strip()
    assert code == 2, cluster.tails()
    theirs = digits.job.train_data().signature()
    mine = other_data_job.train_data().signature()
    # Progress lines (waiting, joining) come first; the refusal is one line, and the last.
    *progress, refusal = err.splitlines()
    assert all(line.startswith("flodl-bus worker: ") for line in progress), err
    assert not any("refused" in line for line in progress), err
    assert refusal.startswith("flodl-bus worker: refused by the coordinator"), err
    assert mine in refusal and theirs in refusal and "does not match" in refusal
    # The coordinator keeps waiting for a proper world; a stop ends it cleanly.
    assert coord.popen.poll() is None, cluster.tails()
    coord.popen.terminate()
    assert cluster.wait([coord], timeout=30) == [143]  # 128 + SIGTERM (README exit codes)


def test_a_worker_that_builds_another_model_is_refused_naming_both_signatures(
    cluster: Cluster,
) -> None:
    run = new_run_id("msig")
    coord = cluster.coordinator(run, "--mode", "cpu-sync", "--world-size", "2")
    bad = cluster.worker(run, "stranger", "--job", "tests.e2e.jobs:other_model_job")
    (code,) = cluster.wait([bad], timeout=60)
    assert code == 2, cluster.tails()
    theirs = model_signature(digits.job.build_model)
    mine = model_signature(other_model_job.build_model)
    assert theirs and mine and theirs != mine
    *_progress, refusal = bad.output().strip().splitlines()
    assert refusal.startswith("flodl-bus worker: refused by the coordinator"), refusal
    assert "model signature" in refusal and mine in refusal and theirs in refusal
    assert coord.popen.poll() is None, cluster.tails()
    coord.popen.terminate()
    assert cluster.wait([coord], timeout=30) == [143]


def test_cpu_workers_tell_no_device_score_so_the_run_has_no_spec_prior_and_replays(
    cluster: Cluster,
) -> None:
    # This host's ranks train on CPU: their Hellos carry no device score, so the
    # recorded config has no device_scores and ElChe starts without an anchor rank.
    run = new_run_id("spec")
    coord = cluster.coordinator(run, "--mode", "cpu-cadence", "--world-size", "2", "--epochs", "2")
    joiners = [cluster.worker(run, f"joiner{i}", "--device", "cpu") for i in range(2)]
    codes = cluster.wait([coord, *joiners], timeout=120)
    assert codes == [0, 0, 0], cluster.tails()
    run_dir = cluster.run_dir(run)
    head = header(records(run_dir))
    assert [m["device_score"] for m in head["members"]] == [None, None]
    assert head["config"]["device_scores"] is None
    client = redis.Redis.from_url(cluster.redis_url, socket_timeout=10)
    try:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(RunKeys(run).join)  # type: ignore[assignment]
    finally:
        client.close()
    bodies = [msgpack.unpackb(f[b"body"]) for _, f in entries if f[b"type"] == b"Hello"]
    assert len(bodies) == 2 and not any("device_score" in b for b in bodies)
    replays = replay_run(run_dir)
    assert {k: r.summary() for k, r in replays.items() if not r.identical} == {}
