"""GP classification on banana with kernel hyperparameters learned through the dual VG bound (envelope gradients).

    python examples/gp_banana_hyper.py

Writes ``docs/figures/dual_vg_banana_hyper.png``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gp_banana import main  # noqa: E402

if __name__ == "__main__":
    main(learn=True)
