"""``benchmarks/check.py`` (``make bench-check``): time ratios against peers measured in one run."""
import importlib.util
import pathlib

import pytest

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("bench_check", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _payload(ours, peer, converged=True, n=100):
    return {"machine": {"cpu_count": 2}, "rows": [
        {"case": "a9a", "n": n, "method": "dual_vg", "seconds": ours, "converged": converged},
        {"case": "a9a", "n": n, "method": "svi_automvn", "seconds": peer, "converged": False},
    ]}


def test_a_slower_machine_is_not_a_regression(check):
    assert check.compare(_payload(1.0, 10.0), _payload(2.0, 20.0), 0.3) == []


def test_a_ratio_that_grew_by_more_than_the_tolerance_is_flagged(check):
    msgs = check.compare(_payload(1.0, 10.0), _payload(1.5, 10.0), 0.3)
    assert len(msgs) == 1 and "dual_vg / svi_automvn" in msgs[0] and "+50%" in msgs[0]
    assert check.compare(_payload(1.0, 10.0), _payload(1.25, 10.0), 0.3) == []


def test_lost_convergence_and_missing_rows_are_flagged(check):
    msgs = check.compare(_payload(1.0, 10.0), _payload(1.0, 10.0, converged=False), 0.3)
    assert msgs == ["rows [case=a9a, n=100] dual_vg: converged before, not now"]
    msgs = check.compare(_payload(1.0, 10.0), _payload(1.0, 10.0, n=200), 0.3)
    assert msgs == ["rows [case=a9a, n=100] dual_vg: missing from the new results"]


def test_nested_tables_and_library_rows(check):
    old = {"libraries_table": [{"n": 10, "library": "qdldl", "factor_s": 1.0},
                               {"n": 10, "library": "splu", "factor_s": 2.0}]}
    new = {"libraries_table": [{"n": 10, "library": "qdldl", "factor_s": 3.0},
                               {"n": 10, "library": "splu", "factor_s": 2.0}]}
    (msg,) = check.compare(old, new, 0.3)
    assert msg.startswith("libraries_table [n=10] qdldl / splu: time ratio 0.5 -> 1.5")


def test_free_text_does_not_identify_a_row(check):
    old, new = _payload(1.0, 10.0), _payload(1.0, 10.0)
    old["rows"][0]["note"] = "warm start 0.5 s, not in the fit time"
    new["rows"][0]["note"] = "warm start 0.7 s, not in the fit time"
    old["rows"][0]["source"] = "full run, printed table (rounded)"
    assert check.compare(old, new, 0.3) == []
    new["rows"][0]["seconds"] = 2.0
    (msg,) = check.compare(old, new, 0.3)
    assert "dual_vg / svi_automvn: time ratio 0.1 -> 0.2" in msg


def test_a_peer_run_on_our_prior_is_still_a_peer(check):
    def payload(ours, peer):
        return {"rows": [{"nodes": 2025, "method": "dual_vg, SparseGMRF", "seconds": ours},
                         {"nodes": 2025, "method": "svi_autonormal, SparseGMRF", "seconds": peer}]}

    assert check.is_ours("dual_vg, SparseGMRF") and not check.is_ours("svi_autonormal, SparseGMRF")
    (msg,) = check.compare(payload(0.07, 4.6), payload(0.26, 8.9), 0.3)
    assert "dual_vg, SparseGMRF / svi_autonormal, SparseGMRF" in msg


def test_a_count_given_for_every_row_in_one_run_only_does_not_split_cases(check):
    """Old run: a peer reported ``nnz_L = None`` (so ``nnz_L`` identified no row); new run: every row reports it.
    The two runs' rows still match on the fields both can identify them by."""
    old = {"libraries_table": [{"n": 10, "library": "qdldl", "factor_s": 1.0, "nnz_L": 50},
                               {"n": 10, "library": "splu", "factor_s": 2.0, "nnz_L": 60},
                               {"n": 10, "library": "cholmod", "factor_s": 2.0, "nnz_L": None}]}
    new = {"libraries_table": [{"n": 10, "library": "qdldl", "factor_s": 1.0, "nnz_L": 50},
                               {"n": 10, "library": "splu", "factor_s": 2.0, "nnz_L": 60}]}
    assert check.compare(old, new, 0.3) == []
    new["libraries_table"][0]["factor_s"] = 3.0
    (msg,) = check.compare(old, new, 0.3)
    assert msg.startswith("libraries_table [n=10] qdldl / splu: time ratio 0.5 -> 1.5")


def test_a_run_of_some_cases_against_a_run_of_all_of_them(check):
    """``--baseline``: a one-case run is compared on its case only; the other cases are not reported missing."""
    old = _payload(1.0, 10.0)
    old["rows"] += [dict(r, case="sonar") for r in old["rows"]]
    new = _payload(1.0, 10.0)
    assert check.compare(old, new, 0.3, subset=True) == []
    assert check.compare(old, new, 0.3) == ["rows [case=sonar, n=100] dual_vg: missing from the new results"]
    new["rows"][0]["seconds"] = 2.0
    (msg,) = check.compare(old, new, 0.3, subset=True)
    assert msg.startswith("rows [case=a9a, n=100] dual_vg / svi_automvn: time ratio 0.1 -> 0.2")
    only_new = _payload(1.0, 10.0)
    for r in only_new["rows"]:
        r["case"] = "bym"
    msgs = check.compare(old, only_new, 0.3, subset=True)
    assert msgs == ["rows [case=bym, n=100]: not in the baseline, not compared"]
