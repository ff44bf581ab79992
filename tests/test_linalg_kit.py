"""The shared numerics kit: backtracking, the L-BFGS memory, and CG with a reduction over row blocks (float64)."""
import math
import threading

import pytest
import torch

from pyro_convexvb.linalg import cg
from pyro_convexvb.linalg.lbfgs import LBFGSMemory, minimize_lbfgs
from pyro_convexvb.linalg.linesearch import armijo, backtrack

DT = torch.float64


# ----------------------------------------------------------------------------- backtracking
def test_backtrack_returns_the_first_accepted_halving_and_its_payload():
    tried = []

    def trial(t):
        tried.append(t)
        return ("ok", t) if t <= 0.3 else None

    t, out = backtrack(trial, 2.0)
    assert tried == [2.0, 1.0, 0.5, 0.25]
    assert t == 0.25 and out == ("ok", 0.25)


def test_backtrack_gives_up_after_max_trials():
    tried = []
    t, out = backtrack(lambda t: tried.append(t), 1.0, max_trials=5)
    assert out is None
    assert tried == [1.0, 0.5, 0.25, 0.125, 0.0625]
    assert t == 1.0 / 32


def test_armijo_refuses_non_finite_values_and_insufficient_decrease():
    assert armijo(0.9, 1.0, 1.0, -1.0)
    assert not armijo(0.99995, 1.0, 1.0, -1.0)  # needs f <= 1 - 1e-4
    assert armijo(1.0 - 1e-4, 1.0, 1.0, -1.0)
    for bad in (math.nan, math.inf, -math.inf):
        assert not armijo(bad, 1.0, 1.0, -1.0)


# ----------------------------------------------------------------------------- L-BFGS memory
def _bfgs_inverse(S, Y):
    """Dense BFGS inverse-Hessian updates (Nocedal & Wright 2006, Eq. 6.17) from ``H0 = (s^T y / y^T y) I`` of
    the newest pair: the matrix the two-loop recursion applies."""
    n = S[0].shape[0]
    H = float(S[-1] @ Y[-1]) / float(Y[-1] @ Y[-1]) * torch.eye(n, dtype=DT)
    eye = torch.eye(n, dtype=DT)
    for s, y in zip(S, Y):
        rho = 1.0 / float(y @ s)
        H = (eye - rho * torch.outer(s, y)) @ H @ (eye - rho * torch.outer(y, s)) + rho * torch.outer(s, s)
    return H


def test_lbfgs_memory_direction_is_the_dense_bfgs_inverse_times_the_gradient():
    g = torch.Generator().manual_seed(0)
    n = 6
    Q = torch.randn(n, n, generator=g, dtype=DT)
    A = Q @ Q.T + n * torch.eye(n, dtype=DT)
    mem = LBFGSMemory(3)
    pairs = [torch.randn(n, generator=g, dtype=DT) for _ in range(5)]
    for s in pairs:
        mem.update(s, A @ s)
    assert len(mem) == 3  # the two oldest pairs were dropped
    grad = torch.randn(n, generator=g, dtype=DT)
    H = _bfgs_inverse(pairs[-3:], [A @ s for s in pairs[-3:]])
    torch.testing.assert_close(mem.direction(grad), -H @ grad, rtol=1e-12, atol=1e-12)


def test_lbfgs_memory_skips_pairs_of_nonpositive_curvature_and_resets_on_ascent():
    mem = LBFGSMemory(5)
    s = torch.tensor([1.0, 0.0], dtype=DT)
    mem.update(s, -s)  # s^T y < 0: not stored
    assert len(mem) == 0
    grad = torch.tensor([2.0, -1.0], dtype=DT)
    torch.testing.assert_close(mem.direction(grad), -grad)  # empty memory: steepest descent

    mem = LBFGSMemory(5)
    mem.update(s, 2 * s)
    mem.dot = lambda a, b: -float(a @ b) if a is grad else float(a @ b)  # makes -H g look like an ascent
    d = mem.direction(grad)
    assert len(mem) == 0
    torch.testing.assert_close(d, -grad)


# ----------------------------------------------------------------------------- minimize_lbfgs and non-finite trials
def _barrier_1d(outside):
    """``4 x - log x`` (minimum at ``x = 1/4``), ``outside`` (inf or NaN) for ``x <= 0``; counts trials there."""
    x = torch.tensor([0.9], dtype=DT, requires_grad=True)
    hits = [0]

    def loss():
        if float(x.detach()) <= 0:
            hits[0] += 1
            return (x * 0).sum() + outside
        return (4 * x - torch.log(x)).sum()
    return x, loss, hits


@pytest.mark.parametrize("outside", [math.inf, math.nan])
def test_minimize_lbfgs_backtracks_from_a_trial_point_with_a_non_finite_loss(outside):
    # the first step, of length 1 along -grad (grad 2.9), lands at x = -0.1 where the loss is not finite
    x, loss, hits = _barrier_1d(outside)
    res = minimize_lbfgs([x], loss, grad_tol=1e-10, change_tol=0.0)
    assert hits[0] >= 1
    assert res.converged and res.stop_reason == "gradient"
    assert float(x.detach()) == pytest.approx(0.25, rel=1e-9)
    assert res.value == pytest.approx(1.0 - math.log(0.25), rel=1e-12)


def test_minimize_lbfgs_log_barrier_2d_matches_the_closed_form():
    # a^T x - log(1 - |x|^2): the minimum is x = -r a/|a| with |a| r^2 + 2 r - |a| = 0
    a = torch.tensor([3.0, 4.0], dtype=DT)
    x = torch.zeros(2, dtype=DT, requires_grad=True)
    hits = [0]

    def loss():
        inside = 1 - (x * x).sum()
        if float(inside.detach()) <= 0:
            hits[0] += 1
        return a @ x - torch.log(inside)  # NaN outside the unit disc
    res = minimize_lbfgs([x], loss, grad_tol=1e-10, change_tol=0.0)
    na = float(a.norm())
    r = (math.sqrt(1 + na * na) - 1) / na
    assert hits[0] >= 1
    assert res.converged
    torch.testing.assert_close(x.detach(), -r * a / na, rtol=0, atol=1e-11)


def test_minimize_lbfgs_refuses_a_non_finite_loss_at_the_start():
    x = torch.tensor([-1.0], dtype=DT, requires_grad=True)
    with pytest.raises(FloatingPointError, match="at the starting point"):
        minimize_lbfgs([x], lambda: torch.log(x).sum())


def test_minimize_lbfgs_reports_a_line_search_that_finds_no_finite_point():
    # loss x on x >= 1, +inf below: every step along the descent direction -1 is infinite
    x = torch.tensor([1.0], dtype=DT, requires_grad=True)

    def loss():
        return x.sum() if float(x.detach()) >= 1 else x.sum() + math.inf
    with pytest.raises(FloatingPointError, match="found no point with a finite loss"):
        minimize_lbfgs([x], loss)
    assert float(x.detach()) == 1.0


# ----------------------------------------------------------------------------- CG with a reduction
class _ThreadSum:
    """Sum over ``P`` threads, one per row block: a stand-in for an all-reduce over processes."""

    def __init__(self, parts):
        self.parts = parts
        self.barrier = threading.Barrier(parts)
        self.slots = [None] * parts
        self.rank = threading.local()

    def sum(self, t):
        self.slots[self.rank.value] = t
        self.barrier.wait()
        total = sum(self.slots[1:], self.slots[0].clone())
        self.barrier.wait()
        return total

    def gather(self, v):
        self.slots[self.rank.value] = v
        self.barrier.wait()
        full = torch.cat(self.slots)
        self.barrier.wait()
        return full


@pytest.mark.parametrize("negative_curvature", ["raise", "truncate"])
def test_cg_with_a_reduction_over_row_blocks_matches_the_single_process_solve(negative_curvature):
    g = torch.Generator().manual_seed(1)
    n, blocks = 12, (5, 7)
    Q = torch.randn(n, n, generator=g, dtype=DT)
    A = Q @ Q.T + 0.5 * torch.eye(n, dtype=DT)
    b = torch.randn(n, generator=g, dtype=DT)
    d = A.diagonal().clone()
    full = cg(A, b, precond=d, rtol=1e-10, true_residual=False, on_negative_curvature=negative_curvature)
    red = _ThreadSum(2)
    rows = torch.arange(n).split(blocks)
    out = [None, None]

    def worker(r):
        red.rank.value = r
        A_r = A[rows[r]]
        res = cg(lambda v: A_r @ red.gather(v), b[rows[r]], precond=d[rows[r]], rtol=1e-10, true_residual=False,
                 on_negative_curvature=negative_curvature, reduction=red)
        out[r] = res

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    x = torch.cat([o.x for o in out])
    torch.testing.assert_close(x, torch.linalg.solve(A, b), rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(x, full.x, rtol=1e-9, atol=1e-10)
    assert out[0].iterations == out[1].iterations == full.iterations
    assert out[0].converged and out[1].converged
    assert float(out[0].residual_norm) == float(out[1].residual_norm) <= 1e-10  # the same reduced value on each
