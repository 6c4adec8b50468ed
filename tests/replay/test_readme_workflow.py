"""The README's "Turning a recorded run into tests" example runs as written (on the golden
cpu-cadence session in place of the reader's own run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flodl_bus.replay import load_run

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "sessions" / "cpu-cadence"


def _example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Turning a recorded run into tests", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_example_passes_on_a_real_recorded_run(tmp_path: Path) -> None:
    code = _example()
    assert 'GOLDEN = "tests/runs/golden"' in code
    namespace: dict[str, Any] = {}
    exec(
        compile(code.replace('"tests/runs/golden"', repr(str(GOLDEN))), "README", "exec"), namespace
    )
    tests = sorted(k for k in namespace if k.startswith("test_"))
    assert tests == [
        "test_a_rank_silent_midway_is_declared_lost",
        "test_a_tampered_record_fails",
        "test_the_golden_run_replays_identically",
    ]
    namespace["test_the_golden_run_replays_identically"](load_run(GOLDEN))
    namespace["test_a_rank_silent_midway_is_declared_lost"](load_run(GOLDEN))
    namespace["test_a_tampered_record_fails"](tmp_path)
