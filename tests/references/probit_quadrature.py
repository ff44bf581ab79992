"""``E log Phi(m + sqrt(v) e)``, ``e ~ N(0, 1)``, by adaptive mpmath quadrature, stored as JSON for the tests.

The quadrature is independent of the package (mpmath only) and takes ~0.2 s per point, so the grid of
``tests/test_probit.py::test_expected_log_prob_against_quadrature`` is computed once and stored in
``probit_quadrature.json``; the test recomputes one point live to show the stored table is this function's.

Usage (from the repository root)::

    python tests/references/probit_quadrature.py     # rewrites probit_quadrature.json (~15 s)
"""
import json
import os

import mpmath as mp

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "probit_quadrature.json")

#: the grid: every (m, v) below, for y = 1 (y = 0 at m is y = 1 at -m)
MEANS = [-40.0, -8.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 8.0, 40.0]
VARIANCES = [1e-6, 0.5, 1.0, 2.25, 10.0, 100.0, 1e4, 1e6]
DPS = 20


def expected_log_phi(m, v, dps=DPS):
    """``E log Phi(m + sqrt(v) e)`` by adaptive quadrature split around the kink of ``log Phi`` (float)."""
    with mp.workdps(dps):
        s = mp.sqrt(v)
        m = mp.mpf(m)
        f = lambda e: mp.log(mp.ncdf(m + s * e)) * mp.npdf(e)  # noqa: E731
        c = -m / s
        near = (float(c + k / s) for k in (-300, -30, -3, 0, 3, 30, 300))
        pts = sorted({-40.0, 40.0} | {p for p in near if -40 < p < 40})
        return float(mp.quad(f, [-mp.inf] + [mp.mpf(p) for p in pts] + [mp.inf]))


def load():
    """The stored table: a list of ``[m, v, E log Phi(m + sqrt(v) e)]``."""
    with open(PATH) as f:
        return json.load(f)["table"]


def main():
    table = [[m, v, expected_log_phi(m, v)] for m in MEANS for v in VARIANCES]
    with open(PATH, "w") as f:
        rows = ",\n".join(json.dumps(r) for r in table)
        f.write(f'{{"dps": {DPS},\n"table": [\n{rows}\n]}}\n')


if __name__ == "__main__":
    main()
