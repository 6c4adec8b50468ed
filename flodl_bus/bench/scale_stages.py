"""``bench scale``'s breakdown of the coordinator's time, per upstream message, from the
coordinator loop's own accounting (``coordinator.loop_profile``), beside the budget a
step leaves one thread at N ranks: step / 2N, as ``bench path`` defines it (N ranks send
about two messages a step each)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flodl_bus.coordinator.loop_profile import STAGES, WAITS, LoopProfile, busiest

if TYPE_CHECKING:
    from flodl_bus.bench.scale import ScaleResult


def stage_fields(raw: dict[str, Any] | None, step_ms: float, n: int) -> dict[str, Any]:
    """The coordinator loop's breakdown as ``ScaleResult`` fields."""
    budget = step_ms * 1000.0 / (2 * n)
    if not raw:
        return {"budget_us": budget}
    prof = LoopProfile(**{k: v for k, v in raw.items() if k != "other"})
    wall = prof.wall_s or float("nan")
    parts = {**prof.stages(), "other": prof.other}
    return {
        "loop": prof.to_dict(),
        "stage_us": prof.per_message_us(),
        "stage_share": {k: v / wall for k, v in parts.items()},
        "budget_us": budget,
        "busiest_stage": busiest(parts),
    }


#: what each stage of the coordinator's breakdown is, for the report
STAGE_LABELS = {
    "idle": "idle (blocked, no input)",
    "read_wait": "read: off-CPU (Redis, or 1st entry)",
    "read_cpu": "read: CPU (XREADGROUP, MAC, decode)",
    "handle": "core.handle",
    "record": "record",
    "send": "sends/broadcasts",
    "apply": "other effects",
    "tick": "ticks",
    "ack": "acks",
    "other": "loop's rest",
}


def breakdown(r: ScaleResult) -> list[str]:
    """Where the coordinator's time went, per upstream message, beside the budget."""
    if not r.loop:
        return []
    p = r.loop
    n = max(1, int(p["messages"]))
    work = sum(v for k, v in r.stage_us.items() if k not in WAITS)
    lines = [
        f"  coordinator loop  {p['wall_s']:8.2f} s wall, {p['cpu_s']:.2f} s CPU (loop thread); "
        f"{int(p['messages'])} upstream msgs in {int(p['reads'])} reads "
        f"({int(p['empty_reads'])} empty), {int(p['ticks'])} ticks "
        f"({int(p.get('ticks_behind', 0))} behind its input); sent "
        f"{int(p['sent'])} unicast + {int(p['broadcasts'])} broadcast in "
        f"{int(p['send_calls'])} bus calls ({p['send_calls'] / n:.3f} a msg)",
        *_sender_line(p, n),
        f"    per upstream msg (budget at {r.ranks} ranks: step / 2N = {r.budget_us:.1f} µs)",
    ]
    # the part of the reads' wait no backlog avoids: a round trip each (PING's, from the
    # same run); the rest waited for input or on Redis's own work
    rtt_us = p["reads"] * r.ping_p50_ms * 1000.0 / n
    for k in (*STAGES, "other"):
        note = f"  (round trips alone, reads x PING: {rtt_us:.1f} µs)" if k == "read_wait" else ""
        lines.append(
            f"    {STAGE_LABELS[k]:36s} {r.stage_us[k]:9.1f} µs  {100 * r.stage_share[k]:5.1f}% "
            f"of wall{note}"
        )
    lines.append(
        f"    {'work (all but the two waits)':36s} {work:9.1f} µs  "
        f"{100 * work / r.budget_us:5.1f}% of the budget; largest: "
        f"{STAGE_LABELS.get(r.busiest_stage, r.busiest_stage)}"
    )
    return lines


def _sender_line(p: dict[str, Any], n: int) -> list[str]:
    """The sender thread's time (``coordinator.sender``), beside the loop's: its calls
    overlap the loop's reads, so they are not one of its stages."""
    busy = float(p.get("sender_s", 0.0))
    if busy <= 0:
        return []
    calls = max(1, int(p["send_calls"]))
    return [
        f"    sender thread: {busy:.2f} s in its bus calls ({busy * 1e6 / n:.1f} µs a msg, "
        f"{busy * 1e6 / calls:.0f} µs a call), beside the loop"
    ]
