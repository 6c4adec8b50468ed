"""Where a rank's time goes, read off its own record (``rank<r>.jsonl``).

A rank's record dates every step (``now`` at its end, with its compute and data time)
and every plan and dispatch (``now`` at its start) on the rank's one clock. Its training
time, from its first plan to its last step, splits into:

* ``compute`` and ``data``: the steps themselves (``batch_ms``, ``data_ms``), at the rate
  the run settled to;
* ``warmup``: what the first steps took beyond that rate (steps before ``SETTLE`` steps in
  a row ran at most ``SETTLED`` times the run's median step);
* ``plan``, ``epoch``: waits between the last step of a plan and the first of the next,
  within an epoch and across one (an epoch's end includes its aggregation);
* ``averaging``: time in the dispatch of a round's message (``SyncNow``, ``RequestParams``,
  ``Update``, ``Throttle``) between two steps, a boundary's included;
* ``eval``: the evals the rank ran (``EvalResult.elapsed_ms``), a cost every contender has;
* ``rest``: the other gaps between steps: the bus's per-step cost on the training thread
  (reports, the record, polling control) and whatever else stalled it.

The parts add up to the training time. Records made before steps were dated have no
breakdown (None).

Beside the parts, the steps' own profile (``step_profile``, which the plain loop and DDP
report too): the median step, and the tail: what the settled steps longer than
``SETTLED`` x the median took beyond the median. A rank whose median step is the plain
loop's but whose compute is not loses its time to a few stalled steps (its threads, or
other processes on its cores), not to a dearer step. And how often the training thread
blocked a second (``blocks_s``, the record's ``end`` line, ``worker.thread_stats``): the
plain loop's almost never does; a rank's blocks on its control and its rounds' collectives
and, most often, on the GIL another of its threads holds, and that count holds still
where step times drift.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Final

from flodl_bus.record.log import read_records

#: A run has settled once this many steps in a row took at most ``SETTLED`` x its median.
SETTLE: Final = 20
SETTLED: Final = 1.5
#: Dispatches that are part of an averaging round on the rank.
ROUND_TYPES: Final = frozenset({"SyncNow", "RequestParams", "Update", "Throttle"})


@dataclass(frozen=True)
class Breakdown:
    """Seconds of one rank's training time, by where they went."""

    total: float
    compute: float
    data: float
    warmup: float
    plan: float
    epoch: float
    averaging: float
    eval: float
    rest: float
    steps: int
    plans: int
    #: the median step (compute and data), ms
    step_ms: float = 0.0
    #: seconds the settled steps over ``SETTLED`` x the median took beyond it
    tail: float = 0.0
    #: times a second the training thread blocked (None: the record does not say)
    blocks_s: float | None = None

    def parts(self) -> dict[str, float]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("total", "steps", "plans", BLOCKS, *PROFILE)
        }


#: what ``step_profile`` adds beside the parts (not a part: the tail is in ``compute``)
PROFILE: Final = ("step_ms", "tail")
#: said beside the parts where every rank's record has it (not a part either)
BLOCKS: Final = "blocks_s"


def step_profile(lengths: Sequence[float]) -> dict[str, float]:
    """The median step (ms) and the tail (s) of steps ``lengths`` (seconds, in order)."""
    if not lengths:
        return {}
    median = statistics.median(lengths)
    bound = SETTLED * median
    settled = _settled_at(lengths, median)
    tail = sum(x - median for x in lengths[settled:] if x > bound)
    return {"step_ms": median * 1e3, "tail": tail}


def _type(msg: Any) -> str | None:
    return msg.get("type") if isinstance(msg, Mapping) else None


def _settled_at(steps: Sequence[float], median: float) -> int:
    """Index of the first step of the first run of ``SETTLE`` settled steps."""
    bound = SETTLED * median
    run = 0
    for i, s in enumerate(steps):
        run = run + 1 if s <= bound else 0
        if run == SETTLE:
            return i - SETTLE + 1
    return 0


def rank_breakdown(records: Iterable[Mapping[str, Any]]) -> Breakdown | None:
    """The breakdown of one rank's record (None without dated steps)."""
    # (now, kind, payload) in record order; kinds: step, plan, round, eval, other
    events: list[tuple[float, str, Any]] = []
    blocks: float | None = None
    for rec in records:
        ev = rec.get("event")
        now = rec.get("now")
        if ev == "end":
            trained = rec.get("training_thread")
            if isinstance(trained, Mapping) and isinstance(trained.get(BLOCKS), int | float):
                blocks = float(trained[BLOCKS])
        elif ev == "step":
            if now is None:
                return None
            args = rec.get("args") or (0.0, 0.0, 0.0, 0.0)
            events.append((float(now), "step", (float(args[1]), float(args[2]))))
        elif ev == "plan" and now is not None:
            plan = rec.get("plan") or {}
            events.append((float(now), "plan", plan.get("epoch")))
        elif ev == "dispatch" and now is not None:
            kind = _type(rec.get("msg"))
            if kind in ROUND_TYPES:
                events.append((float(now), "round", None))
            else:
                evals = [
                    float(o.get("elapsed_ms") or 0.0) / 1e3
                    for o in rec.get("out") or ()
                    if _type(o) == "EvalResult"
                ]
                events.append((float(now), "eval" if evals else "other", sum(evals)))
    steps = [(t, p) for t, k, p in events if k == "step"]
    plans = [e for e in events if e[1] == "plan"]
    if len(steps) < 2 or not plans:
        return None
    lengths = [(c + d) / 1e3 for _, (c, d) in steps]
    median = statistics.median(lengths)
    settled = _settled_at(lengths, median)
    compute = data = warmup = 0.0
    for i, (_, (c, d)) in enumerate(steps):
        length = (c + d) / 1e3
        if i < settled and length > median:
            warmup += length - median
            c, d = c * median / length, d * median / length
        compute += c / 1e3
        data += d / 1e3
    start = plans[0][0]
    end = steps[-1][0]
    plan_s = epoch_s = round_s = eval_s = rest = 0.0
    # Walk the gaps: from a step's end (or the first plan) to the next step's start.
    gap_from = start
    last_epoch = plans[0][2]
    pending: list[tuple[float, str, Any]] = []
    for now, kind, payload in events:
        if kind != "step":
            if now >= start:
                pending.append((now, kind, payload))
            continue
        c, d = payload
        gap_to = now - (c + d) / 1e3
        gap = max(0.0, gap_to - gap_from)
        in_round = in_eval = 0.0
        boundary: str | None = None
        for j, (t, k, p) in enumerate(pending):
            if k == "round":
                # until the next dated event after it (its end, near enough)
                nxt = pending[j + 1][0] if j + 1 < len(pending) else gap_to
                in_round += max(0.0, min(nxt, gap_to) - t)
            elif k == "eval":
                in_eval += p
            elif k == "plan":
                boundary = "epoch" if p != last_epoch else "plan"
                last_epoch = p
        in_eval = min(in_eval, gap)
        in_round = min(in_round, gap - in_eval)
        left = gap - in_eval - in_round
        eval_s += in_eval
        round_s += in_round
        if boundary == "epoch":
            epoch_s += left
        elif boundary == "plan":
            plan_s += left
        else:
            rest += left
        pending = []
        gap_from = now
    total = end - start
    return Breakdown(
        total=total,
        compute=compute,
        data=data,
        warmup=warmup,
        plan=plan_s,
        epoch=epoch_s,
        averaging=round_s,
        eval=eval_s,
        rest=rest,
        steps=len(steps),
        plans=len(plans),
        blocks_s=blocks,
        **step_profile(lengths),
    )


def run_breakdowns(run_dir: Path, world: int) -> list[Breakdown] | None:
    """Every rank's breakdown of a run's records (None if one has none)."""
    out = []
    for r in range(world):
        found = sorted(run_dir.rglob(f"rank{r}.jsonl*"))
        if not found:
            return None
        b = rank_breakdown(read_records(found[0]))
        if b is None:
            return None
        out.append(b)
    return out


def mean_of(breakdowns: Sequence[Breakdown]) -> dict[str, float]:
    """The ranks' mean of each part, and of the total (seconds)."""
    keys = ["total", *breakdowns[0].parts(), *PROFILE]
    out = {k: statistics.fmean(getattr(b, k) for b in breakdowns) for k in keys}
    blocks = [b.blocks_s for b in breakdowns]
    if all(x is not None for x in blocks):
        out[BLOCKS] = statistics.fmean(x for x in blocks if x is not None)
    return out


def median_of(runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each part's median over runs (of the parts every run has)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0] if all(k in r for r in runs)}


def describe(name: str, parts: Mapping[str, float], plain: Mapping[str, float] | None) -> str:
    """One line: each part in seconds and as a share of the training time."""
    total = parts["total"]
    cells = [f"{name:<24}{total:7.2f} s"]
    for k, v in parts.items():
        if k in ("total", BLOCKS) or k in PROFILE:
            continue
        share = v / total if total > 0 else 0.0
        cells.append(f"{k} {v:.2f} ({share:.0%})")
    line = "  ".join(cells) + _profile(parts)
    if plain is not None:
        line += (
            f"\n{'':<24}plain loop: compute {plain['compute']:.2f} s, data {plain['data']:.2f} s,"
            f" eval {plain['eval']:.2f} s, rest {plain['rest']:.2f} s of {plain['total']:.2f} s"
            + _profile(plain)
        )
    return line


def _profile(parts: Mapping[str, float]) -> str:
    if "step_ms" not in parts:
        return ""
    said = f"; median step {parts['step_ms']:.3f} ms, tail {parts.get('tail', 0.0):.2f} s"
    if BLOCKS in parts:
        said += f", training thread blocked {parts[BLOCKS]:.0f}/s"
    return said
