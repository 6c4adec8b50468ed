"""``bench.breakdown``: a rank's training time split by where it went, from its record."""

from __future__ import annotations

from typing import Any

import pytest

from flodl_bus.bench.breakdown import (
    BLOCKS,
    SETTLE,
    describe,
    mean_of,
    median_of,
    rank_breakdown,
    step_profile,
)


def _step(now: float, batch_ms: float, data_ms: float = 0.0) -> dict[str, Any]:
    return {"event": "step", "now": now, "args": [0.5, batch_ms, data_ms, 0.01]}


def _plan(now: float, epoch: int) -> dict[str, Any]:
    return {"event": "plan", "now": now, "plan": {"epoch": epoch}}


def _dispatch(now: float, kind: str, out: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"event": "dispatch", "now": now, "msg": {"type": kind}, "out": out or []}


def _run(start: float, n: int, step_s: float, gap_s: float = 0.0) -> list[dict[str, Any]]:
    """n back-to-back steps of step_s (9/10 compute), each after a gap, from start."""
    recs, t = [], start
    for _ in range(n):
        t += gap_s + step_s
        recs.append(_step(t, step_s * 900.0, step_s * 100.0))
    return recs


def test_the_parts_add_up_and_each_wait_lands_where_it_happened() -> None:
    recs: list[dict[str, Any]] = [_plan(0.0, 0)]
    recs += _run(0.0, 30, 0.001)  # to t=0.030
    recs.append(_plan(0.035, 0))  # a plan boundary: 5 ms
    recs += _run(0.035, 30, 0.001)  # to 0.065
    recs.append(_dispatch(0.066, "RequestParams"))  # a round mid-plan: 2 ms
    recs.append(_dispatch(0.068, "SetGlobalStep"))
    recs += _run(0.068, 30, 0.001)  # to 0.098
    recs.append(
        _dispatch(0.100, "ExecuteEvalCallback", [{"type": "EvalResult", "elapsed_ms": 4.0}])
    )
    recs.append(_plan(0.110, 1))  # the epoch's end: 12 ms, of which 4 eval
    recs += _run(0.110, 30, 0.001, gap_s=0.0001)  # 0.1 ms of the bus after each step
    b = rank_breakdown(recs)
    assert b is not None and b.steps == 120 and b.plans == 3
    assert b.total == pytest.approx(0.110 + 30 * 0.0011)
    assert sum(b.parts().values()) == pytest.approx(b.total)
    assert b.compute == pytest.approx(0.9 * 0.120) and b.data == pytest.approx(0.1 * 0.120)
    assert b.plan == pytest.approx(0.005)
    assert b.averaging == pytest.approx(0.002, abs=1e-6)  # until the next dated event
    assert b.eval == pytest.approx(0.004)
    # from 0.098 to the first step's start at 0.1101, less the eval
    assert b.epoch == pytest.approx(0.0121 - 0.004)
    # the round's gap left 1 ms; 29 steps after the first of the last run waited 0.1 ms
    assert b.rest == pytest.approx(0.001 + 29 * 0.0001)
    assert b.warmup == 0.0


def test_slow_first_steps_are_warm_up_beyond_the_settled_rate() -> None:
    recs: list[dict[str, Any]] = [_plan(0.0, 0)]
    recs += _run(0.0, 10, 0.010)  # ten steps at 10x the settled rate
    recs += _run(0.100, 3 * SETTLE, 0.001)
    b = rank_breakdown(recs)
    assert b is not None
    assert b.warmup == pytest.approx(10 * 0.009)
    assert b.compute + b.data == pytest.approx((10 + 3 * SETTLE) * 0.001)
    assert sum(b.parts().values()) == pytest.approx(b.total)


def test_a_record_without_dated_steps_has_no_breakdown() -> None:
    recs = [_plan(0.0, 0), {"event": "step", "args": [0.5, 1.0, 0.0, 0.01]}]
    assert rank_breakdown(recs) is None


def test_a_few_stalled_steps_are_the_tail_not_a_dearer_median_step() -> None:
    recs: list[dict[str, Any]] = [_plan(0.0, 0)]
    recs += _run(0.0, 3 * SETTLE, 0.001)
    recs += _run(0.060, 1, 0.005)  # one step stalled 4 ms
    recs += _run(0.065, 3 * SETTLE, 0.001)
    b = rank_breakdown(recs)
    assert b is not None
    assert b.step_ms == pytest.approx(1.0)
    assert b.tail == pytest.approx(0.004)
    assert sum(b.parts().values()) == pytest.approx(b.total)  # the tail is in compute
    assert "tail" not in b.parts() and "step_ms" not in b.parts()


def test_the_profile_leaves_warm_up_out_of_the_tail_and_reads_the_same_for_a_baseline() -> None:
    lengths = [0.010] * 5 + [0.001] * (2 * SETTLE) + [0.0016, 0.0014]
    got = step_profile(lengths)
    assert got["step_ms"] == pytest.approx(1.0)
    assert got["tail"] == pytest.approx(0.0006)  # 1.6 ms is over 1.5x; 1.4 ms is not
    assert step_profile([]) == {}


def test_the_line_names_the_median_step_and_the_tail_beside_the_plain_loops() -> None:
    bus = {"total": 1.0, "compute": 0.8, "rest": 0.2, "step_ms": 0.22, "tail": 0.036}
    plain = {"total": 0.5, "compute": 0.45, "data": 0.03, "eval": 0.01, "rest": 0.01}
    plain |= {"step_ms": 0.215, "tail": 0.002}
    line = describe("bus x1", bus, plain)
    assert "compute 0.80 (80%)" in line and "step_ms" not in line
    assert "median step 0.220 ms, tail 0.04 s" in line
    assert line.endswith("of 0.50 s; median step 0.215 ms, tail 0.00 s")


def test_the_training_threads_blocks_come_from_the_end_line_and_are_said_beside_the_plains() -> (
    None
):
    recs: list[dict[str, Any]] = [_plan(0.0, 0), *_run(0.0, 3 * SETTLE, 0.001)]
    assert rank_breakdown(recs).blocks_s is None  # type: ignore[union-attr]  # an older record
    trained = {"wall_s": 2.0, "blocks_s": 150.0, "preempted_s": 3.0, "on_core": 0.9}
    recs.append({"event": "end", "exit_code": 0, "training_thread": trained})
    b = rank_breakdown(recs)
    assert b is not None and b.blocks_s == 150.0
    assert BLOCKS not in b.parts() and sum(b.parts().values()) == pytest.approx(b.total)
    other = rank_breakdown([*recs[:-1], {**recs[-1], "training_thread": {BLOCKS: 50.0}}])
    assert other is not None
    assert mean_of([b, other])[BLOCKS] == 100.0
    # a rank whose record does not say (off Linux): no figure rather than a wrong mean
    unsaid = rank_breakdown(recs[:-1])
    assert unsaid is not None and BLOCKS not in mean_of([b, unsaid])
    line = describe("bus x1", mean_of([b]), {**mean_of([unsaid]), BLOCKS: 4.0})
    assert "training thread blocked 150/s" in line and line.endswith("blocked 4/s")
    assert "blocks_s" not in line


def test_the_median_over_runs_keeps_only_what_every_run_says() -> None:
    runs = [{"total": 1.0, BLOCKS: 10.0}, {"total": 3.0}, {"total": 2.0, BLOCKS: 30.0}]
    assert median_of(runs) == {"total": 2.0}
    assert median_of([runs[0], runs[2]]) == {"total": 1.5, BLOCKS: 20.0}
