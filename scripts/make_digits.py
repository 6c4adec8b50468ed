"""Rebuild flodl_bus/examples/data/digits.npz from scikit-learn's bundled digits.

Run once when the file needs remaking (``pip install -e '.[examples]'`` brings sklearn);
the example itself reads the file and never imports sklearn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

OUT = Path(__file__).resolve().parents[1] / "flodl_bus" / "examples" / "data" / "digits.npz"


def main() -> None:
    digits = load_digits()
    # pixel values are integers 0..16 and labels 0..9: uint8 holds both exactly
    np.savez_compressed(
        OUT, images=digits.data.astype(np.uint8), labels=digits.target.astype(np.uint8)
    )
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
