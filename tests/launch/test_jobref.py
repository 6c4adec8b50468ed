"""``up``'s --job check reads the module's source: typos refused without importing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flodl_bus.launch.jobref import check_job_ref


@pytest.fixture
def in_job_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return tmp_path


def test_a_name_the_module_does_not_define_is_refused_with_the_names_it_does(
    in_job_dir: Path,
) -> None:
    (in_job_dir / "jobmod_a.py").write_text(
        "import torch\nfrom x import y as job_factory\nJOB = 1\ndef make(): pass\n"
        "class K: pass\nnotes: int = 3\n_private = 2\n"
    )
    why = check_job_ref("jobmod_a:jobb")
    assert why is not None and "jobmod_a has no attribute 'jobb'" in why
    assert "(it defines JOB, K, job_factory, make, notes, torch)" in why
    for name in ("JOB", "make", "K", "job_factory", "notes", "_private", "torch"):
        assert check_job_ref(f"jobmod_a:{name}") is None, name


@pytest.mark.parametrize(
    "source",
    [
        "from other import *\n",
        "def __getattr__(name): ...\n",
        "try:\n    job = 1\nexcept E:\n    pass\n",
    ],
    ids=["star-import", "module-getattr", "conditional"],
)
def test_a_module_that_may_bind_any_name_is_left_to_the_import(
    in_job_dir: Path, source: str
) -> None:
    (in_job_dir / "jobmod_b.py").write_text(source)
    assert check_job_ref("jobmod_b:whatever") is None


def test_the_check_imports_nothing(in_job_dir: Path) -> None:
    (in_job_dir / "jobmod_c.py").write_text("raise SystemExit('imported!')\njob = 1\n")
    code = (
        "import sys; from flodl_bus.launch.jobref import check_job_ref; "
        "print(check_job_ref('jobmod_c:job'), check_job_ref('jobmod_c:nope') is not None, "
        "'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=in_job_dir, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.stdout.split() == ["None", "True", "False"], out.stderr
