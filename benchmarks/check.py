"""Regression guard: compare benchmark results with the last committed ones (``make bench-check``).

For every ``benchmarks/results/*.json`` that differs from its version in a git revision (``HEAD`` by
default), the rows of the two versions are matched on their identifying fields (strings, integers,
booleans: case, data set, size, method, ...). Within each group of rows that differ only in
``method``, the time of each of this package's methods is divided by the time of each peer
(``seconds``, or the first time-like field present) — a ratio measured in one run, so insensitive
to the machine's overall speed. A ratio that grew by more than ``--tolerance`` (30%) is flagged.

Also flagged: a row of this package's methods that converged before and does not now, and one that
is missing from the new results.

Usage (from the repository root; not part of CI — run it before committing engine changes)::

    python benchmarks/check.py                    # every changed results file against HEAD
    python benchmarks/check.py --rev HEAD~3 benchmarks/results/gmrf.json
    python benchmarks/check.py --baseline benchmarks/results/hierarchical.json \
        benchmarks/results/hierarchical_gp-lengthscale.json   # a one-case run against the all-case file
    make bench-check

With ``--baseline``, every file given is compared with that one committed file instead of its own committed
version, and only the cases present in the new file are compared (a one-case run does not miss the others); a
case of the new file that the baseline lacks is reported, not passed.

Exit status 1 when something is flagged.
"""
import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: methods of this package (everything else is a peer)
OURS = re.compile(r"dual_vg|convex_relaxation|diag_mixture|pcv|ours|BayesianLogisticRegression|"
                  r"BayesianLinearRegression|OnlineBayesLogistic|Algorithm 1|GPClassifier|SparseGMRF|qdldl",
                  re.IGNORECASE)
#: methods of a peer even when they name one of our parts ("svi_autonormal, SparseGMRF": Pyro's SVI on our prior)
PEERS = re.compile(r"^(svi_|pyro |numpyro|nuts|sklearn|scikit-learn|gpytorch|revrand|cvi|splu|cholmod|cholespy)",
                   re.IGNORECASE)


def is_ours(method):
    """Whether ``method`` names one of this package's methods (else a peer's)."""
    return bool(OURS.search(method)) and not PEERS.match(method)


#: time fields, in order of preference
TIME_FIELDS = ("seconds", "median_seconds", "wall_seconds", "fit_seconds", "time_s", "factor_s")
#: fields that identify a row besides its method
METHOD_FIELDS = ("method", "library", "engine", "model", "solver")
#: fields that never identify a row: counts that vary from run to run, and free text (a note may quote a time)
NOT_IDENTITY = ("converged", "iterations", "evaluations", "steps", "failed", "mvm",
                "note", "notes", "source", "comment")


def rows_of(payload):
    """Every list of dicts in a results payload (any nesting), each with the path that leads to it."""
    out = []

    def walk(obj, path):
        if isinstance(obj, list) and obj and all(isinstance(r, dict) for r in obj):
            out.append((path, obj))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if k != "machine":
                    walk(v, path + (k,))

    walk(payload, ())
    return out


def _method_field(row):
    return next((f for f in METHOD_FIELDS if isinstance(row.get(f), str)), None)


def _identifying(row, method_field):
    """The fields of ``row`` that may identify it: strings, integers and booleans, not counts or free text."""
    return {k for k, v in row.items()
            if k != method_field and isinstance(v, (str, int, bool)) and k not in NOT_IDENTITY}


def _identity(row, method_field, keys):
    """``row``'s identifying ``(field, value)`` pairs among ``keys`` (those every row of its table has)."""
    return tuple(sorted((k, row[k]) for k in _identifying(row, method_field) & keys))


def _time(row):
    for f in TIME_FIELDS:
        v = row.get(f)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None and v > 0 and math.isfinite(v):
            return float(v)
    return None


def _named(rows):
    """``(row, its method field)`` for the rows that name a method."""
    pairs = ((r, _method_field(r)) for r in rows)
    return [(r, mf) for r, mf in pairs if mf is not None]


def identity_keys(*tables):
    """The fields that may identify every method-naming row of all ``tables`` (a count such as ``factor_nnz``,
    given for our rows and ``None`` for a peer's, does not split a case; comparing two runs, the keys are those
    of both, so a peer that reported ``None`` in one run only does not split the cases of the other)."""
    named = [pair for rows in tables for pair in _named(rows)]
    return set.intersection(*(_identifying(r, mf) for r, mf in named)) if named else set()


def groups(rows, keys):
    """``{identity: {method: row}}`` over rows that name a method, identified by ``keys``
    (:func:`identity_keys`)."""
    out = {}
    for r, mf in _named(rows):
        out.setdefault(_identity(r, mf, keys), {})[r[mf]] = r
    return out


def compare(old_payload, new_payload, tolerance, subset=False):
    """Messages for every regression of ``new_payload`` against ``old_payload``; with ``subset``, the cases absent
    from ``new_payload`` are not compared (a run of some of the cases against a run of all of them)."""
    problems = []
    old_tables = dict(rows_of(old_payload))
    for path, new_rows in rows_of(new_payload):
        old_rows = old_tables.get(path)
        if old_rows is None:
            continue
        keys = identity_keys(old_rows, new_rows)
        old_g, new_g = groups(old_rows, keys), groups(new_rows, keys)
        where = "/".join(path) or "rows"
        if subset:  # a case the baseline does not have is not compared: say so rather than pass it
            for ident in new_g.keys() - old_g.keys():
                label = ", ".join(f"{k}={v}" for k, v in ident) or "-"
                problems.append(f"{where} [{label}]: not in the baseline, not compared")
        for ident, old_methods in old_g.items():
            label = ", ".join(f"{k}={v}" for k, v in ident) or "-"
            new_methods = new_g.get(ident)
            if subset and new_methods is None:
                continue
            for m, old_row in old_methods.items():
                if not is_ours(m):
                    continue
                if new_methods is None or m not in new_methods:
                    problems.append(f"{where} [{label}] {m}: missing from the new results")
                    continue
                new_row = new_methods[m]
                if old_row.get("converged") is True and new_row.get("converged") is False:
                    problems.append(f"{where} [{label}] {m}: converged before, not now")
                t_old, t_new = _time(old_row), _time(new_row)
                if t_old is None or t_new is None:
                    continue
                for peer, old_peer in old_methods.items():
                    if is_ours(peer) or peer not in new_methods:
                        continue
                    p_old, p_new = _time(old_peer), _time(new_methods[peer])
                    if p_old is None or p_new is None:
                        continue
                    r_old, r_new = t_old / p_old, t_new / p_new
                    if r_new > (1 + tolerance) * r_old:
                        problems.append(f"{where} [{label}] {m} / {peer}: time ratio {r_old:.3g} -> {r_new:.3g} "
                                        f"({100 * (r_new / r_old - 1):+.0f}%)")
    return problems


def committed(path, rev):
    rel = os.path.relpath(path, ROOT)
    try:
        text = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True, check=True,
                              text=True).stdout
    except subprocess.CalledProcessError:
        return None
    return json.loads(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="results files (default: every benchmarks/results/*.json)")
    ap.add_argument("--rev", default="HEAD", help="git revision to compare with")
    ap.add_argument("--tolerance", type=float, default=0.3, help="flag ratios that grew by more than this")
    ap.add_argument("--baseline", default=None,
                    help="compare every file given with this committed results file (its cases only)")
    args = ap.parse_args(argv)
    if args.baseline and not args.files:
        ap.error("--baseline: name the results files to compare with it")
    files = args.files or sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")))
    base = None
    if args.baseline:
        base = committed(os.path.abspath(args.baseline), args.rev)
        if base is None:
            ap.error(f"--baseline: {args.baseline} is not committed at {args.rev}")
    flagged, checked = 0, 0
    for f in files:
        old = base if base is not None else committed(os.path.abspath(f), args.rev)
        if old is None:
            continue
        with open(f) as fh:
            new = json.load(fh)
        if new == old:
            continue
        checked += 1
        for msg in compare(old, new, args.tolerance, subset=base is not None):
            print(f"{os.path.relpath(f, ROOT)}: {msg}")
            flagged += 1
    against = f"{os.path.relpath(os.path.abspath(args.baseline), ROOT)} at {args.rev}" if base is not None else args.rev
    print(f"{checked} changed results file(s) compared with {against}; {flagged} regression(s) or uncompared "
          f"case(s) flagged (tolerance {100 * args.tolerance:.0f}%)")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
