"""Fourier (circulant) and tile block-Jacobi preconditioners of the convex relaxation's Newton systems for image
models (Seeger 2010 §5).

References are dense matrices built here: the unitary 2-D DFT matrix, ``A = X^T X + B^T diag(w) B`` from the
operators' dense forms, T. Chan's optimal circulant as ``diag(F A F^H)``, tile blocks cut out of the dense ``A``."""
import math

import pytest
import torch

from pyro_convexvb.design.imaging import (
    compressive_sensing_model,
    difference_operator,
    fourier_columns_operator,
    haar_operator,
    laplace_map,
)
from pyro_convexvb.design.sequential import SequentialPhaseEncodeDesign, pair_candidates
from pyro_convexvb.infer.convex_relaxation import ConvexVariationalRelaxation, RelaxationProblem
from pyro_convexvb.infer.convex_relaxation.inner import inner_loop
from pyro_convexvb.lgm.layout import LatentLayout
from pyro_convexvb.lgm.model import LatentGaussianModel, PriorBlock, SiteGroup
from pyro_convexvb.lgm.sites import Gaussian, Laplace
from pyro_convexvb.linalg import CirculantSymbol, FunctionOperator, TileBlocks, cg, shift_class_symbol, tile_layout

D = torch.float64
SIG2 = 1e-3
pytestmark = pytest.mark.filterwarnings("ignore:engine .convex_relaxation. did not converge")


def _dft(H, W, dtype=torch.complex128):
    """Unitary 2-D DFT matrix ``F`` (``F u = fft2(u, ortho)`` for row-major images)."""
    n = H * W
    eye = torch.eye(n, dtype=dtype)
    return torch.fft.fft2(eye.reshape(n, H, W), norm="ortho").reshape(n, n).transpose(0, 1)


def _chan(A, H, W):
    """T. Chan's optimal circulant approximation of a dense ``A``: ``F^H diag(diag(F A F^H)) F`` and its symbol."""
    F = _dft(H, W)
    lam = torch.diagonal(F @ A.to(F.dtype) @ F.conj().T).real
    return (F.conj().T @ torch.diag(lam.to(F.dtype)) @ F).real, lam


def _image(H, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(0, 1, H, dtype=D)
    img = 0.5 + 0.3 * torch.outer(torch.sin(3 * x), torch.cos(2 * x)) + 0.05 * torch.randn(H, H, generator=g, dtype=D)
    img[: H // 2, : H // 3] += 0.4  # an edge
    return img.reshape(-1)


def _model(H, cols, seed=0, dtype=D):
    u = _image(H, seed).to(dtype)
    y = fourier_columns_operator(H, H, cols, dtype=dtype).mv(u)
    return compressive_sensing_model(y, H, H, cols, SIG2, 0.08, 0.16)


def _periodic_differences(H, W):
    """Horizontal then vertical *periodic* differences (rows wrap around), with their circulant symbol."""
    def fwd(v):
        one = v.dim() == 1
        X = (v.unsqueeze(-1) if one else v).transpose(0, 1).reshape(-1, H, W)
        out = torch.cat([(X.roll(-1, 2) - X).reshape(X.shape[0], -1), (X.roll(-1, 1) - X).reshape(X.shape[0], -1)], 1)
        out = out.transpose(0, 1)
        return out[:, 0] if one else out.contiguous()

    def adj(r):
        one = r.dim() == 1
        R = (r.unsqueeze(-1) if one else r).transpose(0, 1)
        dh, dv = R[:, : H * W].reshape(-1, H, W), R[:, H * W:].reshape(-1, H, W)
        X = dh.roll(1, 2) - dh + dv.roll(1, 1) - dv
        out = X.reshape(X.shape[0], -1).transpose(0, 1)
        return out[:, 0] if one else out.contiguous()

    def fwd_sq(v):
        one = v.dim() == 1
        X = (v.unsqueeze(-1) if one else v).transpose(0, 1).reshape(-1, H, W)
        out = torch.cat([(X.roll(-1, 2) + X).reshape(X.shape[0], -1), (X.roll(-1, 1) + X).reshape(X.shape[0], -1)], 1)
        out = out.transpose(0, 1)
        return out[:, 0] if one else out.contiguous()

    def adj_sq(r):
        one = r.dim() == 1
        R = (r.unsqueeze(-1) if one else r).transpose(0, 1)
        dh, dv = R[:, : H * W].reshape(-1, H, W), R[:, H * W:].reshape(-1, H, W)
        X = dh.roll(1, 2) + dh + dv.roll(1, 1) + dv
        out = X.reshape(X.shape[0], -1).transpose(0, 1)
        return out[:, 0] if one else out.contiguous()

    shape = (2 * H * W, H * W)
    sq = FunctionOperator(fwd_sq, adj_sq, shape, batched=True)
    op = FunctionOperator(fwd, adj, shape, batched=True, squared=sq)
    classes = torch.cat([torch.zeros(H * W, dtype=torch.long), torch.ones(H * W, dtype=torch.long)])
    op._gram_symbol = shift_class_symbol(op, classes, (H, W))
    return op


def _periodic_model(H, cols):
    """The model of ``compressive_sensing_model`` with periodic differences: ``A`` is circulant for class-wise
    constant weights."""
    n = H * H
    u = _image(H)
    X = fourier_columns_operator(H, H, cols)
    y = X.mv(u)
    Ba, Br = haar_operator(H, H), _periodic_differences(H, H)
    sigma = math.sqrt(SIG2)

    def group(name, B, b):
        q = B.shape[0]
        return SiteGroup(name, Laplace(torch.full((q,), b, dtype=D)), B, torch.zeros(q, dtype=D), (q,))

    obs = SiteGroup("y", Gaussian(y, torch.full_like(y, sigma)), X, torch.zeros_like(y), tuple(y.shape))
    layout = LatentLayout.from_shapes([("u", (n,))], [1])
    return LatentGaussianModel(layout, [PriorBlock("u", torch.zeros(n, dtype=D), flat=True)],
                               [obs, group("wavelet", Ba, sigma / 0.08), group("differences", Br, sigma / 0.16)])


def _dense_op(M, n):
    """Dense matrix of a preconditioner (tensor ``d``: ``diag(1/d)``; callable: its action on the identity)."""
    eye = torch.eye(n, dtype=D)
    return torch.diag(1 / M) if torch.is_tensor(M) else M(eye)


# ---------------------------------------------------------------------------------------------- symbols
@pytest.mark.parametrize("which", ["haar", "haar2", "differences", "fourier_half", "fourier_full"])
def test_gram_symbol_is_chans_optimal_circulant(which):
    H, W = 8, 8
    op = {"haar": haar_operator(H, W), "haar2": haar_operator(H, W, levels=2), "differences": difference_operator(H, W),
          "fourier_half": fourier_columns_operator(H, W, [0, 1, 3, 4]),
          "fourier_full": fourier_columns_operator(H, W, [1, 5, 6])}[which]
    w = torch.rand(op.shape[0], generator=torch.Generator().manual_seed(3), dtype=D) + 0.1
    B = op.mv(torch.eye(H * W, dtype=D))
    A = B.T @ (w[:, None] * B)
    C, lam = _chan(A, H, W)
    sym = op.gram_symbol(w)
    assert sym.grid == (H, W)
    assert torch.allclose(sym.full().reshape(-1), lam, atol=1e-12, rtol=1e-12)
    assert torch.allclose(sym.mv(torch.eye(H * W, dtype=D)), C, atol=1e-12)


def test_fourier_rows_with_constant_noise_are_exactly_circulant():
    H = 8
    for cols in ([0, 1, 4], [2, 3, 7]):
        X = fourier_columns_operator(H, H, cols)
        Xd = X.mv(torch.eye(H * H, dtype=D))
        sym = X.gram_symbol(torch.full((X.shape[0],), 1 / SIG2, dtype=D))
        assert torch.allclose(sym.mv(torch.eye(H * H, dtype=D)), Xd.T @ Xd / SIG2, atol=1e-9)


def test_circulant_symbol_products_solves_and_validation():
    H, W = 4, 6
    kk, cc = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    R = torch.rand(H, W, generator=torch.Generator().manual_seed(0), dtype=D) + 0.5
    R = 0.5 * (R + R[(-kk) % H, (-cc) % W])  # the symbol of a real symmetric circulant: lambda(omega) = lambda(-omega)
    lam = R[:, : W // 2 + 1]
    C = CirculantSymbol((H, W), lam)
    full = C.full()
    assert torch.equal(full, R)
    with pytest.raises(ValueError, match="symmetric"):
        CirculantSymbol((H, W), torch.rand(H, W // 2 + 1, generator=torch.Generator().manual_seed(1), dtype=D))
    F = _dft(H, W)
    dense = (F.conj().T @ torch.diag(full.reshape(-1).to(F.dtype)) @ F).real
    R = torch.randn(H * W, 3, dtype=D)
    assert torch.allclose(C.mv(R), dense @ R, atol=1e-12)
    assert torch.allclose(C.solve(R), torch.linalg.solve(dense, R), atol=1e-10)
    assert torch.allclose(C.mv(R[:, 0]), dense @ R[:, 0], atol=1e-12)
    assert abs(float(C.diagonal_value()) - float(torch.diagonal(dense).mean())) < 1e-12
    with pytest.raises(ValueError, match="half spectrum"):
        CirculantSymbol((H, W), lam[:, :2])
    with pytest.raises(ValueError, match="grids"):
        C + CirculantSymbol((W, H), torch.ones(W, H // 2 + 1, dtype=D))
    with pytest.raises(ValueError, match="non-empty"):
        shift_class_symbol(haar_operator(4, 4), torch.cat([torch.zeros(15, dtype=torch.long),
                                                            torch.full((1,), 2, dtype=torch.long)]), (4, 4))


# ---------------------------------------------------------------------------------------------- preconditioners
def test_periodic_model_preconditioners_invert_A_exactly():
    H = 8
    n = H * H
    prob = RelaxationProblem(_periodic_model(H, [0, 1, 2]))
    # one weight per class of translates: wavelet subbands get their own, each difference direction its own
    w = torch.empty(prob.q, dtype=D)
    w[:n] = 30.0
    w[n:2 * n], w[2 * n:] = 7.0, 11.0
    A = prob.dense_a(w)
    C, _ = _chan(A, H, H)
    assert torch.allclose(C, A, atol=1e-9)  # A is circulant
    for kind in ("circulant", "fourier"):
        Minv = _dense_op(prob.preconditioner(w, kind), n)
        assert torch.allclose(Minv @ A, torch.eye(n, dtype=D), atol=1e-9), kind


def test_preconditioners_are_spd_and_fourier_has_the_jacobi_diagonal():
    H = 8
    n = H * H
    prob = RelaxationProblem(_model(H, [0, 1, 2]))
    e = torch.exp(2 * torch.randn(prob.q, generator=torch.Generator().manual_seed(1), dtype=D))  # very uneven
    A = prob.dense_a(e)
    d = torch.diagonal(A)
    assert torch.allclose(prob.preconditioner(e, "jacobi"), d, rtol=1e-12)
    _, lam = _chan(A, H, H)
    assert torch.allclose(prob.circulant_symbol(e).full().reshape(-1), lam, rtol=1e-10, atol=1e-9)
    for kind in ("circulant", "fourier"):
        Minv = _dense_op(prob.preconditioner(e, kind), n)
        assert torch.allclose(Minv, Minv.T, atol=1e-10 * float(Minv.abs().max()))
        assert float(torch.linalg.eigvalsh(0.5 * (Minv + Minv.T)).min()) > 0
    # "fourier" = D^{-1/2} c~^{-1} D^{-1/2} with c~ of unit diagonal: its inverse has A's diagonal
    M = torch.linalg.inv(_dense_op(prob.preconditioner(e, "fourier"), n))
    assert torch.allclose(torch.diagonal(M), d, rtol=1e-9)


@pytest.mark.parametrize("kind", ["circulant", "fourier"])
def test_cg_with_fourier_preconditioners_reaches_the_jacobi_solution(kind):
    H = 16
    prob = RelaxationProblem(_model(H, [0, 1, 2, 3]))
    e = torch.exp(torch.randn(prob.q, generator=torch.Generator().manual_seed(2), dtype=D))
    b = torch.randn(prob.n, generator=torch.Generator().manual_seed(3), dtype=D)
    ref = torch.linalg.solve(prob.dense_a(e), b)
    sols = {k: cg(lambda v: prob.a_mv(v, e), b, precond=prob.preconditioner(e, k), rtol=1e-10, on_fail="raise")
            for k in ("jacobi", kind)}
    for s in sols.values():
        assert torch.allclose(s.x, ref, rtol=1e-7, atol=1e-7 * float(ref.abs().max()))


def test_fewer_cg_iterations_than_jacobi_where_weights_are_even():
    """Class-wise constant weights on the (non-periodic) model: A is nearly circulant, where a circulant
    preconditioner is made for; with the spatially uneven weights of real images it is not (docs/design.md)."""
    H = 32
    n = H * H
    prob = RelaxationProblem(_model(H, [0, 1, 2, 3]))
    w = torch.empty(prob.q, dtype=D)
    w[:n] = 0.5  # weak wavelet weight, strong differences: a stiff, Laplacian-like A
    w[n:] = 200.0
    b = torch.randn(n, generator=torch.Generator().manual_seed(4), dtype=D)
    its = {k: cg(lambda v: prob.a_mv(v, w), b, precond=prob.preconditioner(w, k), rtol=1e-8, on_fail="raise").iterations
           for k in ("jacobi", "circulant", "fourier")}
    assert its["circulant"] < 0.5 * its["jacobi"]
    assert its["fourier"] < 0.5 * its["jacobi"]


def test_float32_follows_the_inputs():
    H = 8
    prob = RelaxationProblem(_model(H, [0, 1], dtype=torch.float32))
    e = torch.ones(prob.q, dtype=torch.float32)
    sym = prob.circulant_symbol(e)
    assert sym.values.dtype == torch.float32
    r = torch.randn(H * H, dtype=torch.float32)
    for kind in ("circulant", "fourier"):
        assert prob.preconditioner(e, kind)(r).dtype == torch.float32


def test_inner_loop_and_engine_agree_across_preconditioners():
    H = 16
    lgm = _model(H, [0, 1, 2, 3, 4])
    prob = RelaxationProblem(lgm)
    z = torch.full((prob.q,), 1e-2, dtype=D)
    u0 = torch.zeros(prob.n, dtype=D)
    runs = {k: inner_loop(prob, z, u0, max_newton=30, cg_tol=1e-10, newton_tol=1e-14, preconditioner=k)
            for k in ("jacobi", "fourier", "circulant")}
    for k in ("fourier", "circulant"):
        assert abs(runs[k].objective - runs["jacobi"].objective) <= 1e-10 * abs(runs["jacobi"].objective)
        assert torch.allclose(runs[k].u, runs["jacobi"].u, atol=1e-6)
    # the engine (dense_logdet_max=0: no dense Cholesky replaces the preconditioner)
    opts = dict(variance="lanczos", lanczos_rank=20, max_outer=2, cg_tol=1e-10, dense_logdet_max=0, progress=False)
    fits = {k: ConvexVariationalRelaxation(lgm, preconditioner=k, **opts).run() for k in ("jacobi", "fourier")}
    assert torch.allclose(fits["fourier"].state.gamma, fits["jacobi"].state.gamma, rtol=1e-5, atol=1e-9)
    assert torch.allclose(fits["fourier"].posterior.loc, fits["jacobi"].posterior.loc, atol=1e-6)
    # laplace_map
    maps = {k: laplace_map(lgm, z_start=1e-3, z_final=1e-5, z_factor=0.1, preconditioner=k) for k in ("jacobi", "fourier")}
    assert abs(maps["fourier"][1]["objective"] - maps["jacobi"][1]["objective"]) <= 1e-9 * maps["jacobi"][1]["objective"]
    assert torch.allclose(maps["fourier"][0], maps["jacobi"][0], atol=1e-6)
    assert len(maps["fourier"][1]["cg_iterations"]) == len(maps["fourier"][1]["z"])


def test_design_order_is_the_same_with_the_fourier_preconditioner():
    H = 16
    u = _image(H, 5)
    cand = pair_candidates(H)
    X = fourier_columns_operator(H, H, cand)
    y = X.mv(u) + math.sqrt(SIG2) * torch.randn(X.shape[0], generator=torch.Generator().manual_seed(6), dtype=D)
    m = len(cand)

    def measure(pairs):
        return torch.cat([y[c * H:(c + 1) * H] for c in pairs] + [y[H * m + c * H:H * m + (c + 1) * H] for c in pairs])

    hist = {}
    for k in ("jacobi", "fourier"):
        d = SequentialPhaseEncodeDesign(measure, H, H, SIG2, 0.08, 0.16, k_var=40, k_score=20, seed=3, progress=False,
                                        engine_options=dict(preconditioner=k, dense_logdet_max=0, cg_tol=1e-10))
        hist[k] = d.run([0, 1], 3)
    assert hist["fourier"].added == hist["jacobi"].added
    for a, b in zip(hist["fourier"].best_scores, hist["jacobi"].best_scores):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_models_without_a_symbol_are_refused_by_name():
    from pyro_convexvb.lgm.sites import BernoulliLogit

    X = torch.randn(20, 3, dtype=D)
    lgm = LatentGaussianModel.from_design(X, BernoulliLogit((X[:, 0] > 0).double()), prior_scale=1.0)
    prob = RelaxationProblem(lgm)
    w = torch.ones(prob.q, dtype=D)
    assert prob.circulant_symbol(w) is None
    assert torch.is_tensor(prob.preconditioner(w, "jacobi"))
    with pytest.raises(ValueError, match="preconditioner='fourier': this model offers no circulant symbol"):
        prob.preconditioner(w, "fourier")
    with pytest.raises(ValueError, match="expected one of 'jacobi'"):
        prob.preconditioner(w, "ilu")
    with pytest.raises(ValueError, match="preconditioner='block4': this model offers no 4 x 4 tile blocks"):
        prob.preconditioner(w, "block4")
    with pytest.raises(ValueError, match="preconditioner"):
        ConvexVariationalRelaxation(lgm, preconditioner="fourier", progress=False).run()
    with pytest.raises(ValueError, match="preconditioner"):
        ConvexVariationalRelaxation(lgm, preconditioner="ilu", progress=False)
    cs = _model(8, [0, 1])
    with pytest.raises(ValueError, match="expected one of 'jacobi'"):
        laplace_map(cs, preconditioner=None)
    with pytest.raises(ValueError, match="offers no 16 x 16|expected one of"):
        laplace_map(cs, preconditioner="block16")


# ---------------------------------------------------------------------------------------------- tile blocks
def _dense_tiles(A, H, W, t):
    tile, off = tile_layout(H, W, t)
    blocks = torch.zeros((H // t) * (W // t), t * t, t * t, dtype=A.dtype)
    same = tile.view(-1, 1) == tile.view(1, -1)
    p, p2 = torch.nonzero(same, as_tuple=True)
    blocks[tile[p], off[p], off[p2]] = A[p, p2]
    return blocks


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("which", ["haar", "haar2", "haar1", "differences", "fourier_half", "fourier_full"])
def test_gram_tiles_are_the_dense_diagonal_blocks(which, t):
    """(``haar1`` at ``t = 4``: every wavelet lies inside one tile, coarser than the transform's levels.)"""
    H, W = 8, 8
    op = {"haar": haar_operator(H, W), "haar2": haar_operator(H, W, levels=2), "haar1": haar_operator(H, W, levels=1),
          "differences": difference_operator(H, W),
          "fourier_half": fourier_columns_operator(H, W, [0, 1, 3, 4]),
          "fourier_full": fourier_columns_operator(H, W, [1, 5, 6])}[which]
    w = torch.rand(op.shape[0], generator=torch.Generator().manual_seed(5), dtype=D) + 0.1
    if which.startswith("fourier"):
        assert op.gram_tiles(w, t) is None  # row weights that differ: X^T diag(w) X is not circulant, refused
        w = torch.full_like(w, 3.0)
    B = op.mv(torch.eye(H * W, dtype=D))
    ref = _dense_tiles(B.T @ (w[:, None] * B), H, W, t)
    tb = op.gram_tiles(w, t)
    assert (tb.grid, tb.tile) == ((H, W), t)
    assert torch.allclose(tb.blocks, ref, atol=1e-12)


def test_tile_blocks_products_solves_and_refusals():
    H, W, t = 4, 8, 2
    g = torch.Generator().manual_seed(0)
    R = torch.randn((H // t) * (W // t), t * t, t * t, generator=g, dtype=D)
    tb = TileBlocks((H, W), t, R @ R.transpose(1, 2) + torch.eye(t * t, dtype=D))
    dense = torch.zeros(H * W, H * W, dtype=D)
    tile, off = tile_layout(H, W, t)
    for k in range(tb.blocks.shape[0]):
        idx = torch.nonzero(tile == k).reshape(-1)
        idx = idx[torch.argsort(off[idx])]
        dense[idx.view(-1, 1), idx.view(1, -1)] = tb.blocks[k]
    r = torch.randn(H * W, 3, generator=g, dtype=D)
    assert torch.allclose(tb.mv(r), dense @ r, atol=1e-12)
    assert torch.allclose(tb.solve(r), torch.linalg.solve(dense, r), atol=1e-10)
    assert torch.allclose(tb.solve(r[:, 0]), torch.linalg.solve(dense, r[:, 0]), atol=1e-10)
    with pytest.raises(ValueError, match="tile side"):
        tile_layout(4, 6, 4)
    with pytest.raises(ValueError, match="blocks: expected shape"):
        TileBlocks((H, W), t, tb.blocks[:2])
    bad = tb.blocks.clone()
    bad[3] = -torch.eye(t * t, dtype=D)
    with pytest.raises(ValueError, match="tile 3 is not positive definite"):
        TileBlocks((H, W), t, bad).solve(r)


@pytest.mark.parametrize("kind", ["block2", "block4", "block8"])
def test_block_preconditioners_invert_the_tile_blocks_and_reach_the_solution(kind):
    H = 16
    n = H * H
    t = int(kind[5:])
    prob = RelaxationProblem(_model(H, [0, 1, 2, 3]))
    e = torch.exp(2 * torch.randn(prob.q, generator=torch.Generator().manual_seed(7), dtype=D))
    A = prob.dense_a(e)
    Minv = _dense_op(prob.preconditioner(e, kind), n)
    M = torch.linalg.inv(Minv)
    assert torch.allclose(Minv, Minv.T, atol=1e-10 * float(Minv.abs().max()))
    tile, _ = tile_layout(H, H, t)
    same = tile.view(-1, 1) == tile.view(1, -1)
    assert torch.allclose(M[same], A[same], rtol=1e-9, atol=1e-9 * float(A.abs().max()))
    assert float(M[~same].abs().max()) < 1e-8 * float(A.abs().max())
    b = torch.randn(n, generator=torch.Generator().manual_seed(8), dtype=D)
    ref = torch.linalg.solve(A, b)
    for k in ("jacobi", kind):  # (random weights: no claim on the counts; see the inner-loop test below)
        sol = cg(lambda v: prob.a_mv(v, e), b, precond=prob.preconditioner(e, k), rtol=1e-10, on_fail="raise")
        assert torch.allclose(sol.x, ref, rtol=1e-7, atol=1e-7 * float(ref.abs().max()))


def test_block_preconditioner_needs_fewer_iterations_on_a_newton_system_of_the_inner_loop():
    """A 32 x 32 image with an edge at the design's start columns: the Newton systems of the inner loop (spatially
    uneven weights) with block Jacobi on 4 x 4 tiles take fewer CG iterations than with Jacobi, same optimum."""
    H = 32
    lgm = _model(H, [0, 1, 2, 3, 4, 5])
    prob = RelaxationProblem(lgm)
    z = torch.full((prob.q,), 1e-3, dtype=D)
    u0 = torch.zeros(prob.n, dtype=D)
    runs = {k: inner_loop(prob, z, u0, max_newton=40, cg_tol=1e-8, newton_tol=1e-12, preconditioner=k)
            for k in ("jacobi", "block4")}
    assert all(r.converged for r in runs.values())
    per_system = {k: sum(r.cg_iterations) / len(r.cg_iterations) for k, r in runs.items()}
    assert per_system["block4"] < 0.8 * per_system["jacobi"]
    assert abs(runs["block4"].objective - runs["jacobi"].objective) <= 1e-8 * abs(runs["jacobi"].objective)
