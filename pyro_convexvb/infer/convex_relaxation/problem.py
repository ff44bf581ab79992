r"""A latent Gaussian model in Nickisch & Seeger's (2009) form ``P(u|D) ∝ N(y | X u, sigma^2 I) prod_i t_i(s_i)``.

Mapping (``sigma^2 = 1`` throughout):

* **Gaussian part.**  The Gaussian prior blocks ``N(u_b | mu_b, P_b^{-1})`` and the Gaussian
  observation groups ``N(y_g | B_g u + o_g, diag(sd_g^2))`` are whitened row by row into one
  least-squares term ``||y~ - X u||^2`` with

  .. math:: X = \begin{bmatrix} P^{1/2} \\ \mathrm{diag}(sd_g)^{-1} B_g \end{bmatrix}, \quad
            \tilde y = \begin{bmatrix} P^{1/2}\mu \\ \mathrm{diag}(sd_g)^{-1}(y_g - o_g) \end{bmatrix},

  so ``X^T X = P + sum_g B_g^T diag(sd_g^{-2}) B_g`` (``P`` block diagonal, zero on flat blocks).
  ``X`` itself is only formed as the sampling factor ``J`` (``P^{1/2}``: ``sqrt`` of a diagonal,
  the Cholesky factor of a dense block, the sparse Cholesky factor of a sparse precision).  A
  diagonal prior scale is the paper's ``X = I/sigma`` case.  Each Gaussian group keeps its own noise scales: they enter through the whitening, not
  through ``sigma``.
* **Why sigma^2 = 1.**  Nickisch & Seeger's (2009) ``sigma^2`` is one global scale on every term.  Replacing
  ``(sigma^2, gamma)`` by ``(1, gamma / sigma^2)`` maps the family of Gaussian lower bounds of each
  site onto itself (the bound ``exp(sigma^{-2}(beta s - s^2/(2 gamma)) - h(gamma)/2)`` only depends
  on ``gamma sigma^2`` once ``beta`` and ``h`` are re-expressed), so the relaxation, its optimum,
  ``Q(u|D)`` and the bound are the same for every ``sigma^2``.  With ``sigma^2 = 1``:
  ``Cov_Q[u] = A^{-1}``, ``A = X^T X + B^T Gamma^{-1} B`` and ``z = Var_Q[s]`` directly
  (``precision_scale = sigma^2 = 1`` on the posterior).
* **Non-Gaussian sites.**  Every non-Gaussian group ``t_i(eta_i)``, ``eta = B u + offset``, becomes
  super-Gaussian potentials (:mod:`.potentials`) of ``s = B u + o`` with ``o = offset - shift``
  (``shift`` = a site's own location, e.g. Student-t observations).  Laplace priors extracted from a
  Pyro model (``SiteGroup.from_prior``) are Laplace sites on ``I u - loc``: the paper's "append I to
  B" (Nickisch & Seeger 2009, §2).
* **Constants.**  With ``c_G`` the normaliser of the Gaussian part and ``kappa_i`` those of the sites
  (``log t_i = kappa_i + beta_i s + g_i(s^2)``), Nickisch & Seeger's (2009) bound (§2.1) becomes, with every
  constant of the model as written,

  .. math:: \log p(y) \ge C - \phi(\gamma)/2, \qquad
            C = \text{log\_const} + \sum_i \kappa_i + \log c_G + \frac{n}{2}\log 2\pi,

  ``log c_G = -(n_P/2) log 2 pi - (1/2) log|Sigma| - sum_{g,i} (log sd_gi + (1/2) log 2 pi)``
  (``n_P`` latent coordinates under a Gaussian prior), and
  ``phi = log|A| + h(gamma) + min_u R(u, gamma)``,
  ``R = ||y~ - X u||^2 + s^T Gamma^{-1} s - 2 beta^T s`` (Nickisch & Seeger 2009, §2.1).
"""
from dataclasses import dataclass
import math

import torch

from ...errors import UnsupportedModelError
from ...linalg.operators import (
    DENSE_LIMIT,
    BlockDiagonalOperator,
    ComposedOperator,
    DenseOperator,
    DiagonalOperator,
    EmbedColumnsOperator,
    FunctionOperator,
    LinearOperator,
    StackedOperator,
)
from ...distributed import comm_of, reduce_sites
from .potentials import PotentialStack, potential_for

__all__ = ["RelaxationProblem", "CovarianceForm"]

#: the CG preconditioners of :meth:`RelaxationProblem.preconditioner`
PRECONDITIONERS = ("jacobi", "fourier", "circulant", "block2", "block4", "block8")

#: largest prior block that is inverted/factorised densely when only a covariance is given
DENSE_BLOCK_LIMIT = DENSE_LIMIT


class _Counted(LinearOperator):
    """Wraps an operator and counts products (one per column)."""

    def __init__(self, base, counter, key):
        self.base, self.counter, self.key = base, counter, key
        self.shape, self.dtype, self.device = base.shape, base.dtype, base.device

    def _cols(self, v):
        return 1 if v.dim() == 1 else v.shape[1]

    def _mv(self, v):
        self.counter[self.key] = self.counter.get(self.key, 0) + self._cols(v)
        return self.base.mv(v)

    def _rmv(self, u):
        self.counter[self.key] = self.counter.get(self.key, 0) + self._cols(u)
        return self.base.rmv(u)

    def squared(self):
        return self.base.squared()

    def gram_symbol(self, weights=None):
        return self.base.gram_symbol(weights)

    def gram_tiles(self, weights, tile):
        return self.base.gram_tiles(weights, tile)

    def to_dense(self):
        return self.base.to_dense()

    def flops(self):
        return self.base.flops()

    def weighted_gram(self, weights=None, chunk=256):
        """``base.T diag(w) base``, counted as ``2 n`` products (what probing with identity columns costs)."""
        self.counter[self.key] = self.counter.get(self.key, 0) + 2 * self.shape[1]
        return self.base.weighted_gram(weights, chunk)

    def weighted_gram_identity(self, chunk=256):
        """The wrapped square operator as a dense matrix (``n`` products, or none when it stores one)."""
        self.counter[self.key] = self.counter.get(self.key, 0) + self.shape[1]
        return self.base.to_dense()


class _ScaledCirculant:
    """``R -> D^{-1/2} C^{-1} D^{-1/2} R`` (``root = D^{1/2}``), the ``"fourier"`` preconditioner."""

    def __init__(self, symbol, root):
        self.symbol, self.root = symbol, root

    def __call__(self, R):
        r = self.root if R.dim() == 1 else self.root.unsqueeze(-1)
        return self.symbol.solve(R / r) / r


class _PrecisionProduct:
    """``v -> A v`` with ``A = X^T X + B^T diag(w) B`` of a :class:`RelaxationProblem` (a picklable callable, so
    posteriors and results holding the precision operator can be pickled)."""

    def __init__(self, problem, w):
        self.problem, self.w = problem, w

    def __call__(self, v):
        return self.problem.a_mv(v, self.w)


@dataclass
class CovarianceForm:
    r"""The Gaussian prior in covariance (whitened) form ``u = mu + L v``, ``v ~ N(0, I)``, ``L L^T = Sigma``.

    With ``A = Sigma^{-1} + M_u`` (``M_u = sum_g B_g^T diag(sd_g^{-2}) B_g + B^T Gamma^{-1} B``, the
    Gaussian observation rows and the sites), ``A_v = L^T A L = I + L^T M_u L``.

    :ivar factor: ``L``, a block-diagonal :class:`~pyro_convexvb.linalg.LinearOperator` of shape ``(n, n)``
        (dense lower Cholesky factors of the dense blocks, square roots of the diagonal ones).
    :ivar prior_var: ``diag(Sigma)``, shape ``(n,)``.
    :ivar site_prior_var: ``diag(B Sigma B^T)``, shape ``(q,)``.
    :ivar gauss_trace: ``sum_g sum_i sd_gi^{-2} (B_g Sigma B_g^T)_ii``, so that
        ``tr A_v = n + gauss_trace + sum_i (site_prior_var_i / gamma_i)``.
    :ivar logdet: ``log|Sigma| = 2 sum_j log L_jj``.
    :ivar dense_fraction: fraction of the ``n`` coordinates in blocks with a dense (non-diagonal) covariance.
    """

    factor: LinearOperator
    prior_var: torch.Tensor
    site_prior_var: torch.Tensor
    gauss_trace: float
    logdet: float
    dense_fraction: float


class RelaxationProblem:
    """Nickisch & Seeger's (2009) quantities for a :class:`~pyro_convexvb.LatentGaussianModel` (``sigma^2 = 1``).

    :param lgm: the latent Gaussian model.
    :raises UnsupportedModelError: for a non-Gaussian site family without a super-Gaussian form,
        or a large prior block given by a covariance only.

    Products with ``B``, the ``B_g`` and the prior precision are counted in ``self.counts``
    (one per column).
    """

    def __init__(self, lgm):
        self.lgm = lgm
        self.n = lgm.n
        self.dtype, self.device = lgm.dtype, lgm.device
        self.counts = {}
        # row-sharded data (pcv.distributed): every site group holds this rank's rows; sums over sites are
        # reduced over ranks by site_sum, latent-sized vectors are replicated
        self.comm = comm_of(lgm)
        if self.comm is not None:
            for g in list(lgm.gaussian_groups) + list(lgm.nongaussian_groups):
                if comm_of(g.design) is None:
                    raise UnsupportedModelError(
                        g.name, "engine 'convex_relaxation' with row-sharded data (pcv.distributed.row_sharded) needs "
                                "every site group to be built on row-sharded rows; this group's design is replicated "
                                "(e.g. a Laplace prior's sites): use a Gaussian prior, or fit on one process")
        # ---- Gaussian prior blocks
        self.prior_blocks = []  # (slice, precision operator, loc)
        for p, sl in zip(lgm.priors, lgm.prior_slices):
            if p.flat:
                continue
            if p.prec is not None:
                prec = p.prec
            else:
                if p.size > DENSE_BLOCK_LIMIT:
                    raise UnsupportedModelError(p.name, "a prior block given only by a covariance larger than "
                                                        f"{DENSE_BLOCK_LIMIT} needs a precision operator")
                L, info = torch.linalg.cholesky_ex(p.cov.to_dense())
                if int(info) != 0:
                    from ...errors import NotPositiveDefiniteError

                    raise NotPositiveDefiniteError(
                        f"site '{p.name}': its prior covariance is not positive definite in floating point (Cholesky "
                        f"fails at pivot {int(info)} of {p.size}), e.g. a kernel matrix of repeated or very close "
                        "inputs; add jitter to its diagonal (GPClassifier(jitter=...)) or give the prior a precision")
                prec = DenseOperator(torch.cholesky_inverse(L))
            self.prior_blocks.append((sl, _Counted(prec, self.counts, "prior"), p.loc))
        # ---- Gaussian observation groups
        self.gauss = []
        for g in lgm.gaussian_groups:
            y, sd = g.family.params["y"], g.family.params["scale"]
            if not bool((sd > 0).all()):
                raise UnsupportedModelError(g.name, "Gaussian noise scales must be positive")
            self.gauss.append((_Counted(g.design, self.counts, "gaussian"), g.offset, y, sd))
        # ---- non-Gaussian sites
        groups = lgm.nongaussian_groups
        self.groups = groups
        pots = []
        for g in groups:
            try:
                pots.append(potential_for(g.family))
            except UnsupportedModelError as e:
                raise UnsupportedModelError(g.name, e.reason) from None
        self.pot = PotentialStack(pots)
        self.q = len(self.pot)
        if groups:
            B = groups[0].design if len(groups) == 1 else StackedOperator([g.design for g in groups])
            self.B = _Counted(B, self.counts, "B")
            self.o = torch.cat([g.offset for g in groups]) - self.pot.shift
        else:
            self.B = None
            self.o = torch.zeros(0, dtype=self.dtype, device=self.device)
        self.group_slices = self.pot.slices
        self._xty = None
        self._diag_xtx = None

    def site_sum(self, t):
        """Sum over the sites of all ranks of a local site sum ``t`` (tensor or number; the identity on one
        process)."""
        return reduce_sites(self.comm, t)

    def site_dot(self, a, b):
        """Inner product of two site vectors ``(q,)`` over all ranks (a float)."""
        return float(self.site_sum((a * b).sum()))

    # ------------------------------------------------------------------ Gaussian part
    def xtx_mv(self, v):
        """``X^T X v`` for ``v`` of shape ``(n,)`` or ``(n, k)``."""
        out = self.obs_mv(v)
        for sl, P, _ in self.prior_blocks:
            out[sl] += P.mv(v[sl])
        return out

    def obs_mv(self, v):
        """``sum_g B_g^T diag(sd_g^{-2}) B_g v``, the Gaussian observation rows of ``X^T X``, for ``v`` of shape
        ``(n,)`` or ``(n, k)``."""
        out = torch.zeros_like(v)
        for Bg, _, _, sd in self.gauss:
            w = sd**-2
            out += Bg.rmv((w if v.dim() == 1 else w.unsqueeze(-1)) * Bg.mv(v))
        return out

    def xty(self):
        """``X^T y~ = P mu + sum_g B_g^T (y_g - o_g) / sd_g^2`` (cached)."""
        if self._xty is None:
            out = torch.zeros(self.n, dtype=self.dtype, device=self.device)
            for sl, P, loc in self.prior_blocks:
                out[sl] += P.mv(loc)
            for Bg, og, y, sd in self.gauss:
                out += Bg.rmv((y - og) / sd**2)
            self._xty = out
        return self._xty

    def quad(self, u):
        """``||y~ - X u||^2 = (u - mu)^T P (u - mu) + sum_g ||(y_g - o_g - B_g u) / sd_g||^2``."""
        total = u.new_zeros(())
        for sl, P, loc in self.prior_blocks:
            r = u[sl] - loc
            total = total + r @ P.mv(r)
        if self.gauss:
            rows = u.new_zeros(())
            for Bg, og, y, sd in self.gauss:
                rows = rows + (((y - og - Bg.mv(u)) / sd) ** 2).sum()
            total = total + self.site_sum(rows)
        return total

    def diag_xtx(self):
        """``diag(X^T X)`` (Jacobi preconditioner part); unknown parts are left at 0."""
        if self._diag_xtx is None:
            d = torch.zeros(self.n, dtype=self.dtype, device=self.device)
            for sl, P, _ in self.prior_blocks:
                dp = P.base.diagonal()
                if dp is not None:
                    d[sl] += dp
            for Bg, _, _, sd in self.gauss:
                dg = Bg.base.diag_gram(sd**-2)
                if dg is not None:
                    d += dg
            self._diag_xtx = d
        return self._diag_xtx

    # ------------------------------------------------------------------ sites
    def s(self, u):
        """Site variables ``s = B u + o`` (``(q,)``)."""
        return self.B.mv(u) + self.o if self.B is not None else self.o

    def a_mv(self, v, w):
        """``(X^T X + B^T diag(w) B) v`` for ``v`` ``(n,)`` or ``(n, k)``; ``w = 1/gamma`` gives ``A``."""
        out = self.xtx_mv(v)
        if self.B is not None:
            ww = w if v.dim() == 1 else w.unsqueeze(-1)
            out = out + self.B.rmv(ww * self.B.mv(v))
        return out

    def jacobi(self, w):
        """``diag(X^T X + B^T diag(w) B)`` from the sparse rows (``op.diag_gram``), never densifying ``B``."""
        d = self.diag_xtx().clone()
        if self.B is not None:
            dg = self.B.base.diag_gram(w)
            if dg is not None:
                d += dg
        return d

    def circulant_symbol(self, w):
        r"""Symbol of T. Chan's optimal circulant approximation ``c(A)`` of ``A = X^T X + B^T diag(w) B``
        (:mod:`pyro_convexvb.linalg.circulant`), or ``None`` when some part does not offer one.

        Available when the latent is one image (no non-flat prior block: a flat prior adds nothing to ``A``), every
        Gaussian design and ``B`` report ``op.gram_symbol`` on the same grid (e.g. the Fourier columns, Haar and
        difference operators of :mod:`pyro_convexvb.design.imaging`), and the sites are not row-sharded.
        Exact (``c(A) = A``) when ``A`` is circulant, e.g. Fourier rows with constant noise, an orthonormal
        wavelet transform with one weight, and periodic differences with one weight per direction.

        :param w: ``(q,)`` site weights (``1/gamma`` or the Newton weights ``e``).
        :returns: :class:`~pyro_convexvb.linalg.CirculantSymbol` or ``None``.
        """
        return self._summed_gram(w, lambda op, wt: op.gram_symbol(wt), lambda s: s.grid)

    def tile_blocks(self, w, tile):
        r"""Exact diagonal blocks of ``A = X^T X + B^T diag(w) B`` over the aligned ``tile x tile`` pixel tiles
        (:class:`~pyro_convexvb.linalg.TileBlocks`), or ``None`` when some part does not offer them
        (``op.gram_tiles``; same conditions as :meth:`circulant_symbol`).

        :param w: ``(q,)`` site weights; :param int tile: tile side.
        """
        return self._summed_gram(w, lambda op, wt: op.gram_tiles(wt, tile), lambda b: (b.grid, b.tile))

    def _gram_parts(self, w):
        """``[(op, weights)]``: the Gaussian designs with their noise precisions, then ``B`` with ``w``."""
        return [(Bg, sd**-2) for Bg, _, _, sd in self.gauss] + ([(self.B, w)] if self.B is not None else [])

    def _summed_gram(self, w, part, key):
        """Sum over :meth:`_gram_parts` of ``part(op, weights)`` (a structured Gram summary), or ``None`` when the
        latent is not one image (sharded sites, a prior block), some part offers none, two parts disagree in
        ``key`` (grid, tile) or the grid does not cover the ``n`` latents."""
        if self.comm is not None or self.prior_blocks:
            return None
        out = None
        for op, wt in self._gram_parts(w):
            b = part(op, wt)
            if b is None or (out is not None and key(b) != key(out)):
                return None
            out = b if out is None else out + b
        if out is None or out.grid[0] * out.grid[1] != self.n:
            return None
        return out

    def _scaled_symbol(self, w, d):
        """T. Chan symbol of ``D^{-1/2} A D^{-1/2}`` with each row's spectrum kept and its energy scaled:
        row ``b_j`` counts with weight ``w_j ||D^{-1/2} b_j||^2 / ||b_j||^2`` (``D = diag(A)``)."""
        inv = 1.0 / d
        ones = torch.ones_like(d)
        out = None
        parts = self._gram_parts(w)
        for op, wt in parts:
            sq = op.squared()
            if sq is None:
                return None
            norms = sq.mv(ones)
            scale = torch.where(norms > 0, sq.mv(inv) / norms.clamp_min(torch.finfo(d.dtype).tiny), 0.0)
            sym = op.gram_symbol(wt * scale)
            if sym is None:
                return None
            out = sym if out is None else out + sym
        return out

    def preconditioner(self, w, kind="jacobi"):
        r"""Preconditioner for CG on ``A(w) = X^T X + B^T diag(w) B``, in the form :func:`~pyro_convexvb.linalg.cg`
        takes (``precond=``).

        * ``"jacobi"``: ``diag(A)`` (from ``op.diag_gram``), a ``(n,)`` tensor; available for every problem.
        * ``"circulant"``: ``c(A)^{-1}``, T. Chan's optimal circulant approximation
          (:meth:`circulant_symbol`), applied with two real FFTs.
        * ``"block2"``, ``"block4"``, ``"block8"``: block Jacobi on the aligned ``t x t`` pixel tiles (``t`` = 2, 4,
          8), the exact diagonal blocks of ``A`` (:meth:`tile_blocks`) factorised by batched Cholesky.
        * ``"fourier"``: the Jacobi-scaled circulant ``D^{-1/2} c~^{-1} D^{-1/2}``, ``D = diag(A)`` and ``c~`` the
          optimal circulant of ``D^{-1/2} A D^{-1/2}`` with every row's spectrum kept and its energy scaled by
          ``D`` (:meth:`_scaled_symbol`): equal to ``"circulant"`` when ``D`` is constant, and to Jacobi in its
          diagonal (``c~`` has unit diagonal). See docs/convex_relaxation.md, "Fourier preconditioners".

        Example::

            >>> import torch
            >>> from pyro_convexvb.design import compressive_sensing_model, fourier_columns_operator
            >>> u = torch.rand(64, dtype=torch.float64)
            >>> lgm = compressive_sensing_model(fourier_columns_operator(8, 8, [0, 1]).mv(u), 8, 8, [0, 1], 1e-3,
            ...                                 0.08, 0.16)
            >>> prob = RelaxationProblem(lgm)
            >>> e = torch.ones(prob.q, dtype=torch.float64)
            >>> from pyro_convexvb.linalg import cg
            >>> sol = cg(lambda v: prob.a_mv(v, e), prob.a_mv(u, e), precond=prob.preconditioner(e, "block4"),
            ...          rtol=1e-10)
            >>> torch.allclose(sol.x, u, atol=1e-6)
            True

        :param w: ``(q,)`` nonnegative site weights (``None`` without sites).
        :param str kind: one of ``PRECONDITIONERS``: ``"jacobi"``, ``"fourier"``, ``"circulant"``, ``"block2"``,
            ``"block4"``, ``"block8"``.
        :returns: a positive ``(n,)`` tensor (Jacobi) or a callable ``R -> M^{-1} R`` for ``(n,)`` and ``(n, k)``.
        :raises ValueError: for an unknown ``kind``, or a structured ``kind`` the problem does not offer (naming
            what is missing), or when the symbol or a tile block is not positive definite.
        """
        if kind not in PRECONDITIONERS:
            raise ValueError(f"preconditioner: expected one of {', '.join(map(repr, PRECONDITIONERS))}, got {kind!r}")
        if kind.startswith("block"):
            t = int(kind[5:])
            blocks = self.tile_blocks(w, t)
            if blocks is None:
                raise ValueError(f"preconditioner={kind!r}: this model offers no {t} x {t} tile blocks (it needs one "
                                 "image latent with a flat prior, sides divisible by the tile, and every design "
                                 "operator with gram_tiles(), e.g. the operators of pyro_convexvb.design.imaging); "
                                 "use preconditioner='jacobi'")
            blocks.cholesky()  # raises, naming the tile, if a block is not positive definite
            return blocks.solve
        d = self.jacobi(w)
        d = torch.where(d > 0, d, torch.ones_like(d))
        if kind == "jacobi":
            return d
        sym = self.circulant_symbol(w)
        if sym is None:
            raise ValueError(f"preconditioner={kind!r}: this model offers no circulant symbol (it needs one image "
                             "latent with a flat prior, and every design operator with gram_symbol(), e.g. the "
                             "operators of pyro_convexvb.design.imaging); use preconditioner='jacobi'")
        if kind == "fourier":
            sym = self._scaled_symbol(w, d)
        lam = sym.values
        if not bool(torch.isfinite(lam).all()) or not bool((lam > 0).all()):
            raise ValueError(f"preconditioner={kind!r}: the circulant symbol is not positive (min "
                             f"{float(lam.min()):.3g}): A has directions no site or measurement constrains; use "
                             "preconditioner='jacobi'")
        if kind == "circulant":
            return sym.solve
        root = d.sqrt()
        return _ScaledCirculant(sym, root)

    def diag_a(self, w):
        """Exact ``diag(X^T X + B^T diag(w) B)``, or ``None`` if some part is not available cheaply."""
        d = torch.zeros(self.n, dtype=self.dtype, device=self.device)
        for sl, P, _ in self.prior_blocks:
            dp = P.base.diagonal()
            if dp is None:
                return None
            d[sl] += dp
        for Bg, _, _, sd in self.gauss:
            dg = Bg.base.diag_gram(sd**-2)
            if dg is None:
                return None
            d += dg
        if self.B is not None:
            dg = self.B.base.diag_gram(w)
            if dg is None:
                return None
            d += dg
        return d

    def dense_a(self, w, chunk=256):
        """Dense ``A = X^T X + B^T diag(w) B`` (small ``n`` only): prior blocks densified, the Gaussian and
        non-Gaussian rows through each operator's ``weighted_gram`` (a sparse-sparse product for sparse designs)."""
        n = self.n
        A = torch.zeros(n, n, dtype=self.dtype, device=self.device)
        for sl, P, _ in self.prior_blocks:
            A[sl, sl] += P.weighted_gram_identity(chunk)
        for Bg, _, _, sd in self.gauss:
            A += Bg.weighted_gram(sd**-2, chunk)
        if self.B is not None:
            A += self.B.weighted_gram(w, chunk)
        return 0.5 * (A + A.transpose(0, 1))

    def precision_operator(self, w):
        """``A`` as a matrix-free :class:`~pyro_convexvb.linalg.LinearOperator` (batched products)."""
        f = _PrecisionProduct(self, w)
        return FunctionOperator(f, f, (self.n, self.n), dtype=self.dtype, device=self.device, batched=True)

    def factor(self, w):
        """``J`` with ``J^T J = X^T X + B^T diag(w) B`` (for exact perturb-and-solve sampling), or ``None``."""
        parts = []
        for sl, P, _ in self.prior_blocks:
            R = P.base.sqrt_factor()
            if R is None:
                return None
            parts.append(R if (sl.start == 0 and sl.stop == self.n) else EmbedColumnsOperator(R, sl.start, self.n))
        for Bg, _, _, sd in self.gauss:
            parts.append(ComposedOperator(DiagonalOperator(1.0 / sd), Bg.base))
        if self.B is not None:
            parts.append(ComposedOperator(DiagonalOperator(torch.sqrt(w)), self.B.base))
        return parts[0] if len(parts) == 1 else StackedOperator(parts)

    # ------------------------------------------------------------------ covariance (whitened) form
    def covariance_blocks(self):
        """The prior blocks as ``[(slice, covariance operator, dense)]`` when every latent coordinate has a
        Gaussian prior given by a covariance, else ``None``.

        ``None`` when some block is flat (e.g. a Laplace prior turned into sites), is given by its precision
        only, or is a dense covariance larger than ``DENSE_BLOCK_LIMIT``; :meth:`covariance_obstacle` says which.
        ``dense`` is ``False`` for a diagonal covariance.  No computation: this only inspects the model.
        """
        return self._covariance_scan()[0]

    def covariance_obstacle(self):
        """``None`` when :meth:`covariance_blocks` exists, else why not, naming the prior site (a phrase)."""
        return self._covariance_scan()[1]

    def _covariance_scan(self):
        out, pos = [], 0
        for p, sl in zip(self.lgm.priors, self.lgm.prior_slices):
            if sl.start != pos:
                return None, f"latent coordinates {pos}..{sl.start - 1} have no prior block"
            if p.flat:
                return None, (f"site '{p.name}' has no Gaussian prior of its own (a flat block, e.g. a Laplace prior "
                              "turned into sites)")
            if p.cov is None:
                return None, f"the Gaussian prior of site '{p.name}' is given by its precision only"
            dense = not isinstance(p.cov, DiagonalOperator)
            if dense and p.size > DENSE_BLOCK_LIMIT:
                return None, (f"the dense prior covariance of site '{p.name}' has {p.size} coordinates, more than "
                              f"the {DENSE_BLOCK_LIMIT} factorised densely")
            out.append((sl, p.cov, dense))
            pos = sl.stop
        if pos != self.n:
            return None, f"latent coordinates {pos}..{self.n - 1} have no prior block"
        return out, None

    def covariance_form(self, chunk=256):
        """The prior in covariance form (:class:`CovarianceForm`), or ``None`` (see :meth:`covariance_blocks`).

        Computed once and cached: one Cholesky factorisation per dense block, and ``diag(B Sigma B^T)`` by
        products of ``B`` (and of the Gaussian designs ``B_g``) with the ``n`` columns of ``L``, ``chunk``
        at a time.
        """
        if getattr(self, "_cov_form", None) is not None:
            return self._cov_form
        blocks = self.covariance_blocks()
        if blocks is None:
            return None
        factors, prior_var, logdet, n_dense = [], [], 0.0, 0
        for sl, cov, dense in blocks:
            if dense:
                Lb = torch.linalg.cholesky(cov.to_dense())
                factors.append(DenseOperator(Lb))
                prior_var.append((Lb * Lb).sum(1))
                logdet += 2.0 * float(torch.log(torch.diagonal(Lb)).sum())
                n_dense += sl.stop - sl.start
            else:
                d = cov.diag
                factors.append(DiagonalOperator(torch.sqrt(d)))
                prior_var.append(d.clone())
                logdet += float(torch.log(d).sum())
        L = factors[0] if len(factors) == 1 else BlockDiagonalOperator(factors)
        n, dt, dev = self.n, self.dtype, self.device
        z0 = torch.zeros(self.q, dtype=dt, device=dev)
        gauss_trace = 0.0
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            E = torch.zeros(n, stop - start, dtype=dt, device=dev)
            E[torch.arange(start, stop), torch.arange(stop - start)] = 1
            C = L.mv(E)  # columns start..stop-1 of L
            if self.B is not None:
                W = self.B.mv(C)
                z0 += (W * W).sum(1)
            for Bg, _, _, sd in self.gauss:
                Wg = Bg.mv(C)
                gauss_trace += float(((Wg * Wg).sum(1) / sd**2).sum())
        gauss_trace = float(self.site_sum(gauss_trace))
        self._cov_form = CovarianceForm(L, torch.cat(prior_var), z0, gauss_trace, logdet, n_dense / n)
        return self._cov_form

    def mvm_flops(self, whitened=False):
        """Floating-point operations of one product with ``A`` (``whitened=True``: with ``A_v = L^T A L``,
        computed as ``v + L^T (M_u (L v))``) for one vector, from the operators' ``flops()``.

        :returns: ``float``; the cost model of the outer loop's ``variance="auto"`` uses it.
        """
        flops = sum(2.0 * Bg.flops() + Bg.shape[0] for Bg, _, _, _ in self.gauss)
        if self.B is not None:
            flops += 2.0 * self.B.flops() + self.q
        if whitened:
            blocks = self.covariance_blocks()
            if blocks is None:
                raise ValueError("mvm_flops: the model has no covariance form (a flat or precision-only prior block)")
            sizes = [(sl.stop - sl.start, dense) for sl, _, dense in blocks]
            return flops + 2.0 * sum(2.0 * m * m if dense else m for m, dense in sizes) + self.n
        return flops + sum(P.flops() for _, P, _ in self.prior_blocks)

    # ------------------------------------------------------------------ objective pieces
    def R(self, u, gamma, s=None):
        """``R(u, gamma) = ||y~ - X u||^2 + s^T Gamma^{-1} s - 2 beta^T s`` (Nickisch & Seeger 2009, §2.1)."""
        s = self.s(u) if s is None else s
        val = self.quad(u)
        if self.groups and (self.q or self.comm is not None):  # (no non-Gaussian site groups: no term on any rank)
            val = val + self.site_sum((s * s / gamma - 2 * self.pot.beta * s).sum())
        return val

    def mean_rhs(self, gamma):
        """Right-hand side of ``A u = X^T y~ + B^T (beta - o / gamma)`` (the minimiser of ``R`` over ``u``)."""
        rhs = self.xty().clone()
        if self.B is not None:
            rhs += self.B.rmv(self.pot.beta - self.o / gamma)
        return rhs

    def log_const(self):
        """``C`` of ``log p(y) >= C - phi(gamma)/2`` with every constant (module docstring)."""
        lgm = self.lgm
        two_pi = math.log(2 * math.pi)
        n_prior = sum(sl.stop - sl.start for sl, _, _ in self.prior_blocks)
        log_cg = -0.5 * n_prior * two_pi - 0.5 * lgm.prior_logdet_cov()
        # site constants: the observed rows' normalisers, sum_i kappa_i and the model's log_const (observed
        # sites and factors free of the latents: this rank's data when sharded)
        local = float(lgm.log_const)
        for _, _, _, sd in self.gauss:
            local -= float(torch.log(sd).sum()) + 0.5 * sd.numel() * two_pi
        local += float(self.pot.kappa.sum()) if self.q else 0.0
        return float(self.site_sum(local)) + log_cg + 0.5 * self.n * two_pi
