"""Stop a run hard after a mid-run checkpoint, resume it: the new run trains exactly the
samples the checkpoint's coverage left uncovered, from the saved consensus model."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from flodl_bus.examples import digits
from flodl_bus.replay import replay_run
from tests.e2e.harness import (
    SLOW,
    Cluster,
    epoch_samples,
    final_metric,
    header,
    metrics_rows,
    new_run_id,
    received,
    records,
    sent_plans,
    tiles,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.redis]

EPOCHS = 6
MODE = "nccl-cadence"


def _checkpointed(stem: Path) -> bool:
    meta, model = Path(f"{stem}.meta.json"), Path(f"{stem}.model.pt")
    if not (meta.exists() and model.exists()):
        return False
    return bool(json.loads(meta.read_text())["reason"] == "checkpoint")


def test_a_killed_run_resumes_training_only_the_uncovered_samples(
    cluster: Cluster, tmp_path: Path
) -> None:
    stem = tmp_path / "ckpt" / "digits"
    first = new_run_id("resume-a")
    common = ("--mode", MODE, "--world-size", "2", "--epochs", str(EPOCHS))
    procs = [
        cluster.coordinator(
            first, *common, "--save-path", str(stem), "--checkpoint-every", "1", job=SLOW
        ),
        *cluster.ranked_workers(first, 2, "--mode", MODE),
    ]
    wait_for(lambda: _checkpointed(stem), 90, "a mid-run checkpoint", cluster)
    for p in procs:  # a crash: nobody gets to write anything more
        p.popen.send_signal(signal.SIGKILL)
    for p in procs:
        p.popen.wait(timeout=10)
    first_rows = metrics_rows(cluster.run_dir(first))
    assert len(first_rows) < EPOCHS, "the first run finished before it was stopped"

    meta = json.loads(Path(f"{stem}.meta.json").read_text())
    cov = meta["coverage"]
    size = (len(digits.train_data()) // digits.job.batch_size) * digits.job.batch_size
    expected: dict[int, list[tuple[int, int]]] = {
        int(e["epoch"]): [(o, s) for o, s in e["uncovered"]] for e in cov["epochs"]
    }
    for e in range(cov["next_epoch"], EPOCHS):
        expected[e] = [(0, size)]
    assert sum(s for h in expected.values() for _, s in h) < EPOCHS * size

    second = new_run_id("resume-b")
    coord = cluster.coordinator(second, *common, "--resume", str(stem), job=SLOW)
    workers = cluster.ranked_workers(second, 2, "--mode", MODE)
    codes = cluster.wait([coord, *workers], timeout=120)
    assert codes == [0, 0, 0], cluster.tails()

    run_dir = cluster.run_dir(second)
    recs = records(run_dir)
    assert header(recs)["resume_meta"] == meta
    plans = sent_plans(recs)
    rows = {int(r["epoch"]): r for r in metrics_rows(run_dir) if r["samples"]}
    trained_epochs = sorted(e for e, r in rows.items() if int(r["samples"]) > 0)
    assert trained_epochs == sorted(e for e, h in expected.items() if h)
    for e, holes in expected.items():
        want = sum(s for _, s in holes)
        got = sum(epoch_samples(rows[e], 2)) if e in rows else 0
        assert got == want, (e, got, holes)
        sent = [rng for r in plans.get(e, {}) for rng in plans[e][r]]
        assert tiles(sent, holes), (e, sent, holes)
    # Nothing outside the uncovered set was sent.
    assert set(plans) <= set(expected)
    assert sorted(m["rank"] for m in received(recs, "Exiting")) == [0, 1]
    metric = final_metric(run_dir)
    print(f"\nresumed at epoch {min(trained_epochs)}: final accuracy {metric:.4f}")
    assert metric >= 0.9


def _trained(
    cluster: Cluster, run: str, stem: Path, epochs: int, world: int, mode: str, *extra: str
) -> dict[str, torch.Tensor]:
    coord = cluster.coordinator(
        run,
        "--mode",
        mode,
        "--world-size",
        str(world),
        "--epochs",
        str(epochs),
        "--save-path",
        str(stem),
        "--no-final-eval",
        *extra,
    )
    workers = cluster.ranked_workers(run, world, "--mode", mode)
    assert cluster.wait([coord, *workers], timeout=240) == [0] * (world + 1), cluster.tails()
    state: dict[str, torch.Tensor] = torch.load(f"{stem}.model.pt", weights_only=True)
    return state


#: the deterministic schedule: with more than one rank, where rounds fall and how many
#: steps each weighs otherwise follow timing, and two straight runs already differ
LOCKSTEP = ("--lockstep", "true")


@pytest.mark.parametrize(
    ("world", "mode", "extra"),
    [(1, "nccl-sync", ()), (2, "nccl-sync", LOCKSTEP), (2, "cpu-sync", LOCKSTEP)],
)
def test_a_run_resumed_at_an_epoch_boundary_ends_bit_identical_to_one_never_stopped(
    cluster: Cluster, tmp_path: Path, world: int, mode: str, extra: tuple[str, ...]
) -> None:
    total, first = 4, 2
    straight = _trained(
        cluster, new_run_id("straight"), tmp_path / "s" / "m", total, world, mode, *extra
    )
    half = tmp_path / "h" / "m"
    stopped = _trained(cluster, new_run_id("half"), half, first, world, mode, *extra)
    for r in range(world):
        assert Path(f"{half}.rank{r}.state.pt").exists()
    resumed = _trained(
        cluster,
        new_run_id("rest"),
        tmp_path / "r" / "m",
        total,
        world,
        mode,
        *extra,
        "--resume",
        str(half),
    )
    assert set(resumed) == set(straight)
    # The stop was real: the half-way model is not the end model.
    assert any(not torch.equal(stopped[k], straight[k]) for k in straight)
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), k


def test_a_run_killed_after_a_mid_run_checkpoint_resumes_bit_identical_to_one_never_stopped(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A --checkpoint-every save carries each rank's optimizer and random state: a run
    killed (SIGKILL, nothing written after the save) and resumed from it ends where the
    run that never stopped ends, bit for bit."""
    mode, world, total = "nccl-sync", 2, 4
    common = ("--mode", mode, "--world-size", str(world), "--epochs", str(total), *LOCKSTEP)
    straight = _trained(
        cluster, new_run_id("ck-straight"), tmp_path / "s" / "m", total, world, mode, *LOCKSTEP
    )

    stem = tmp_path / "ckpt" / "m"
    run = new_run_id("ck-killed")
    procs = [
        cluster.coordinator(
            run, *common, "--save-path", str(stem), "--checkpoint-every", "2", job=SLOW
        ),
        *cluster.ranked_workers(run, world, "--mode", mode),
    ]

    def saved() -> bool:
        states = [Path(f"{stem}.rank{r}.state.pt") for r in range(world)]
        return _checkpointed(stem) and all(p.exists() for p in states)

    wait_for(saved, 120, "the epoch-2 checkpoint with every rank's state", cluster)
    for p in procs:
        p.popen.send_signal(signal.SIGKILL)
    for p in procs:
        p.popen.wait(timeout=10)
    meta = json.loads(Path(f"{stem}.meta.json").read_text())
    assert meta["coverage"]["next_epoch"] == 2 and meta["coverage"]["epochs"] == []
    assert len(metrics_rows(cluster.run_dir(run))) < total, "the run ended before the kill"

    rest = new_run_id("ck-rest")
    resumed = _trained(
        cluster, rest, tmp_path / "r" / "m", total, world, mode, *LOCKSTEP, "--resume", str(stem)
    )
    for p in cluster.procs:
        if p.name.startswith("rank") and rest in p.name:
            assert "resume_without_rank_state" not in p.output(), p.tail()
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), k
    # Lockstep's decisions and every rank's state saves replay as recorded.
    replays = replay_run(cluster.run_dir(rest))
    assert {k: r.summary() for k, r in replays.items() if not r.identical} == {}


def test_each_rank_resumes_its_own_outer_optimizer_and_a_run_without_one_is_refused(
    cluster: Cluster, tmp_path: Path
) -> None:
    # slow momentum: it keeps the inner optimizer across rounds (nesterov, DiLoCo, resets
    # it after each: ``tests/params/test_collective.py``), so both states carry on
    mode, outer = "nccl-cadence", ("--outer", "slow-momentum")
    half = tmp_path / "h" / "m"
    _trained(cluster, new_run_id("outer-a"), half, 1, 2, mode, *outer)
    states = [torch.load(f"{half}.rank{r}.state.pt", weights_only=False) for r in range(2)]
    for s in states:  # rounds happened: the outer optimizer has a velocity to carry on
        assert s["outer"]["name"] == "slow-momentum" and s["outer"]["velocity"] is not None
        assert s["optimizer"]["state"], "the Adam moments were saved"
    # Per-rank state: the ranks trained other samples, so their moments differ.
    m0, m1 = (s["optimizer"]["state"][0]["exp_avg"] for s in states)
    assert not torch.equal(m0, m1)

    # The same setting goes on from there; the ranks do not start their state fresh.
    rest = new_run_id("outer-b")
    _trained(cluster, rest, tmp_path / "r" / "m", 2, 2, mode, *outer, "--resume", str(half))
    for p in cluster.procs:
        if p.name.startswith("rank") and rest in p.name:
            assert "resume_without_rank_state" not in p.output(), p.tail()

    # Without the outer optimizer the saved state does not fit: a config error (exit 2
    # everywhere), each rank saying why in one line naming the fix, and the checkpoint
    # left as it was (a save on the way out would overwrite what was resumed from).
    files = sorted(half.parent.iterdir())
    before = {p: p.read_bytes() for p in files}
    _refused(cluster, half, mode, "resume with the same --outer setting")
    # A model of other shapes under the stem: the same, naming the file and the fix.
    wrong = digits.job.build_model().state_dict()
    wrong["0.weight"] = torch.zeros(3, 3)
    torch.save(wrong, f"{half}.model.pt")
    _refused(cluster, half, mode, f"{half}.model.pt does not fit this job", *outer)
    before[Path(f"{half}.model.pt")] = Path(f"{half}.model.pt").read_bytes()
    assert sorted(half.parent.iterdir()) == files
    assert all(p.read_bytes() == b for p, b in before.items())


def _refused(cluster: Cluster, stem: Path, mode: str, fix: str, *extra: str) -> None:
    run = new_run_id("refused")
    common = ("--mode", mode, "--world-size", "2", "--epochs", "2", *extra)
    coord = cluster.coordinator(run, *common, "--resume", str(stem))
    workers = cluster.ranked_workers(run, 2, "--mode", mode)
    codes = cluster.wait([coord, *workers], timeout=120)
    assert codes == [2, 2, 2], cluster.tails()
    assert "job_failed" not in coord.output(), coord.tail()
    assert "config_error" in coord.output(), coord.tail()
    for w in workers:
        lines = [ln for ln in w.output().splitlines() if "rank_refused" in ln]
        assert len(lines) == 1 and fix in lines[0] and "resume with" in lines[0], w.tail()
