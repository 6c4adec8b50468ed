"""pytest helpers for recorded runs (a plugin: ``pytest_plugins = ["flodl_bus.replay.testing"]``).

Turning a run into a regression test::

    @pytest.mark.recorded_run("tests/sessions/cpu-cadence")
    def test_cadence_run_replays(recorded_run):
        assert_identical(recorded_run)

    def test_a_silent_rank_is_declared_dead(recorded_run):
        t = run_span(recorded_run) / 2
        result = what_if(surgery.drop_upstream(recorded_run, 2, after=t))
        assert alerts(result, "rank_lost")

``recorded_run`` also takes an indirect parametrization (``@pytest.mark.parametrize(
"recorded_run", [dir1, dir2], indirect=True)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from flodl_bus.record.chain import SUFFIXES, DamagedRecord, IncompleteRecord, UnchainedRecord
from flodl_bus.replay import Recording, ReplayResult, load_run, replay, verify_run
from flodl_bus.replay.load import MissingRecords

Run = Mapping[str, Recording]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "recorded_run(path): the run directory the recorded_run fixture loads"
    )


@pytest.fixture
def recorded_run(request: pytest.FixtureRequest) -> dict[str, Recording]:
    """A recorded run directory, loaded (``coordinator`` / ``rank:R`` -> Recording)."""
    path = getattr(request, "param", None)
    if path is None:
        marker = request.node.get_closest_marker("recorded_run")
        if marker is None or not marker.args:
            raise pytest.UsageError(
                "recorded_run needs @pytest.mark.recorded_run(PATH) or indirect parametrization"
            )
        path = marker.args[0]
    return load_run(_resolved(Path(path), request.config.rootpath))


def _resolved(path: Path, rootdir: Path) -> Path:
    """A relative run directory is the project's (pytest's rootdir), wherever pytest runs
    from; one that only exists relative to the working directory is still found."""
    if path.is_absolute():
        return path
    under_root = rootdir / path
    if under_root.exists() or not path.exists():
        return under_root
    return path


def assert_identical(
    run: Run, role: str | None = None, *, verify: bool = True, transport: str = "direct"
) -> dict[str, ReplayResult]:
    """Verify ``run`` (every record read from disk: its digest chain, its end, its
    headers), then replay every process (or one ``role``); fail with what was refused or
    the first divergence. ``verify=False`` is for records written before records were
    chained: they replay, but nothing proves they are what their processes wrote."""
    keys = [role] if role is not None else list(run)
    if verify:
        try:
            verify_run({k: run[k] for k in keys}, whole=role is None)
        except (DamagedRecord, IncompleteRecord, UnchainedRecord, MissingRecords) as exc:
            raise AssertionError(f"the record cannot be trusted: {exc}") from None
    results = {k: replay(run[k], keep_actual=False, transport=transport) for k in keys}
    bad = [f"{k}: {r.summary()}" for k, r in results.items() if not r.identical]
    if bad:
        raise AssertionError("replay diverged\n" + "\n".join(bad))
    return results


def what_if(run: Run, role: str = "coordinator") -> ReplayResult:
    """Replay ``role`` of a (surgically changed) run, following where it leads."""
    return replay(run[role], explore=True)


def run_span(run: Run, role: str = "coordinator") -> float:
    """Seconds from the first to the last clock reading of ``role``'s core events."""
    nows = [float(e["now"]) for e in run[role].core_events() if "now" in e]
    return max(nows) - min(nows) if nows else 0.0


def emitted(result: ReplayResult, type_: str) -> list[dict[str, Any]]:
    """Every emitted message of wire type ``type_`` (a coordinator's Send/Broadcast
    effects with their ``rank``, or a rank's upstream messages), in order."""
    found: list[dict[str, Any]] = []
    for ev in result.actual:
        for o in ev.get("out") or ():
            if not isinstance(o, dict):
                continue
            msg = o.get("msg", o)
            if isinstance(msg, dict) and msg.get("type") == type_:
                found.append({**msg, "_rank": o.get("rank"), "_event": ev.get("event")})
    return found


def alerts(result: ReplayResult, event: str) -> list[dict[str, Any]]:
    """The coordinator's ``Alert`` effects named ``event``."""
    return [
        o
        for ev in result.actual
        for o in ev.get("out") or ()
        if isinstance(o, dict) and o.get("kind") == "Alert" and o.get("event") == event
    ]


def logged(result: ReplayResult, event: str) -> list[dict[str, Any]]:
    """Log lines a rank's core wrote during replayed dispatches (e.g. errors)."""
    return [
        entry
        for ev in result.actual
        for entry in ev.get("logs") or ()
        if entry.get("event") == event
    ]


def recorded_sessions(root: str | Path) -> list[Path]:
    """Run directories under ``root`` (each holds a coordinator and/or rank records)."""
    base = Path(root)
    return sorted(
        p
        for p in base.iterdir()
        if p.is_dir() and any(f.name.endswith(SUFFIXES) for f in p.iterdir())
    )
