"""The shipped digits file is scikit-learn's digits, and the example needs no sklearn."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from flodl_bus.examples import digits


def test_the_shipped_file_holds_exactly_sklearns_digits() -> None:
    datasets = pytest.importorskip("sklearn.datasets", reason="the [examples] extra")
    ref = datasets.load_digits()
    with np.load(digits.DATA) as shipped:
        assert np.array_equal(shipped["images"].astype(np.float64), ref.data)
        assert np.array_equal(shipped["labels"].astype(np.int64), ref.target)
    assert digits.DATA.stat().st_size < 100_000  # small enough to ship in the wheel


def test_the_example_loads_its_data_without_importing_sklearn() -> None:
    code = (
        "import sys; from flodl_bus.examples import digits; "
        "tr, te = digits.train_data(), digits.eval_data(); "
        "print(len(tr), len(te), 'sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1438", "359", "False"]
