r"""Sequential Bayesian active learning for binary classification on the convex relaxation (Nickisch & Seeger 2009 §3).

:class:`ActiveLearner` includes candidates one at a time and refits the posterior every ``refit_every``
inclusions (the block inclusions of Nickisch & Seeger 2009 §3; a *block* below is the ``refit_every``
inclusions between two refits):

1. **Block start.** The relaxation ``Q(u|D) = N(u_*, A^{-1})`` of the current training set is
   available (the engine's fit). Marginals ``Q(s_j) = N(mu_j, rho_j)`` of *all* pool rows are
   formed once: ``mu = B_pool u_* + o``, ``rho`` from the engine's covariance representation (one
   pass of the K-Lanczos factors over the pool, or the exact Cholesky factor).
2. **Inclusions** (``refit_every`` of them). Score the remaining candidates from their current marginals
   (vectorised), pick the winner ``i``, query its label, solve ``d = A^{-1} b_i`` by CG (``A`` includes
   the rows already added in this block), recompute ``rho_i = b_i^T d`` and ``mu_i`` (corrects Lanczos
   underestimation, as the paper does), solve ``gamma_i = argmin phi_i`` for the observed label and
   apply the rank-one updates of Nickisch & Seeger 2009 §3 to ``mu``, ``rho`` of all pool rows, to ``u_*`` and to
   ``log|A|`` (:func:`~pyro_convexvb.design.scores.rank_one_include`). Candidates whose ``rho``
   turned nonpositive are dropped from scoring for the rest of the block; a block whose candidates are all
   dropped ends early (its refit gives every candidate fresh marginals).
   The variances ``z`` of the *model* sites (the training cases, and Laplace prior sites) get the same
   rank-one updates, so they stay valid for the enlarged model.
3. **Block end.** All ``gamma`` are refitted jointly: the engine is rerun on the enlarged training
   set, warm-started at the current ``gamma`` (old sites keep theirs, new sites get the ``gamma_i`` of
   step 2) *and* at the kept-valid marginals: "the first outer loop update comes for free, since the
   model marginals, ``u_*`` and ``log|A|`` have been kept valid" (Nickisch & Seeger 2009 §3), so the engine skips
   its first variance step (a :class:`~pyro_convexvb.infer.convex_relaxation.RelaxationState` with ``z``).  Model-site variances that turned nonpositive are recomputed
   by CG first, as the paper prescribes.  With ``refit_outer=1`` (the paper's choice) a block costs
   one inner loop and a **single Lanczos run**, plus one pass of its factors over the pool.
"""
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from ..infer.convex_relaxation import (
    ConvexVariationalRelaxation,
    LogisticPotential,
    RelaxationState,
    site_designs,
)
from ..errors import ConvergenceWarning
from ..lgm.extract import lgm_from_pyro
from ..lgm.families import BernoulliLogit
from ..linalg import cg
from .imaging import _index_list
from .scores import classifier_uncertainty, information_gain, minimize_site_phi, rank_one_include

__all__ = ["ActiveLearner", "ActiveHistory"]

_SCORES = ("cu", "ig", "random")
#: engine options the learner sets itself
_RESERVED = frozenset({"max_outer", "variance", "seed", "progress", "init"})


def _check_rows(X, name, columns=None):
    """Refuse a design ``X`` that is not a 2-D dense tensor or torch sparse CSR matrix with rows, finite entries and
    (when given) ``columns`` columns, naming it."""
    if not torch.is_tensor(X) or X.dim() != 2 or X.layout not in (torch.strided, torch.sparse_csr, torch.sparse_coo):
        raise ValueError(f"{name}: expected a 2-D dense tensor or torch sparse (CSR/COO) matrix")
    if X.shape[0] == 0:
        raise ValueError(f"{name}: has no rows")
    if columns is not None and X.shape[1] != columns:
        raise ValueError(f"{name}: expected {columns} columns (those of X_pool), got {X.shape[1]}")
    values = X if X.layout == torch.strided else (X.coalesce() if X.layout == torch.sparse_coo else X).values()
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{name}: contains NaN/inf")


@dataclass
class ActiveHistory:
    """Record of an :meth:`ActiveLearner.run`.

    :ivar chosen: pool indices of the included candidates, in order of inclusion.
    :ivar scores: score of each winner at the time it was picked (``nan`` for ``"random"``).
    :ivar num_included: training-set size after the initial fit and after each refit.
    :ivar test_error: test error at those points (empty without a test set).
    :ivar seconds: cumulative wall seconds at those points.
    :ivar dropped: number of candidates dropped between successive refits for ``rho <= 0``.
    :ivar converged: ``converged`` of the initial fit and of each refit (refits run ``refit_outer``
        outer iterations by design, so they usually report ``False``).
    :ivar result: the last :class:`~pyro_convexvb.InferenceResult`.
    """

    chosen: list = field(default_factory=list)
    scores: list = field(default_factory=list)
    num_included: list = field(default_factory=list)
    test_error: list = field(default_factory=list)
    seconds: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    converged: list = field(default_factory=list)
    result: object = None


def _take_rows(X, idx):
    """Rows ``idx`` of a dense tensor or a torch sparse CSR matrix (stays sparse)."""
    idx = torch.as_tensor(np.asarray(idx, dtype=np.int64))
    if X.layout == torch.strided:
        return X[idx.to(X.device)]
    import scipy.sparse as sp

    Xc = X.to_sparse_csr() if X.layout != torch.sparse_csr else X
    m = sp.csr_matrix((Xc.values().cpu().numpy(), Xc.col_indices().cpu().numpy(), Xc.crow_indices().cpu().numpy()),
                      shape=tuple(Xc.shape))[idx.numpy()]
    m.sort_indices()
    out = torch.sparse_csr_tensor(torch.from_numpy(m.indptr.astype(np.int64)), torch.from_numpy(m.indices.astype(np.int64)),
                                  torch.from_numpy(m.data).to(X.dtype), size=m.shape,
                                  check_invariants=False)
    return out.to(X.device)


def default_cg_tol(dtype):
    """:class:`ActiveLearner`'s default ``cg_tol`` for a pool of ``dtype``: ``max(1e-8, 1000 eps)``, at most 0.1
    (``1e-8`` in float64, ``1.2e-4`` in float32).

    Example::

        >>> import torch
        >>> default_cg_tol(torch.float64), round(default_cg_tol(torch.float32), 6)
        (1e-08, 0.000119)
    """
    eps = torch.finfo(dtype if dtype.is_floating_point else torch.float64).eps
    return min(0.1, max(1e-8, 1000 * eps))


class ActiveLearner:
    r"""Bayesian active learning for logistic classification on the convex relaxation (Nickisch & Seeger 2009 §3).

    :param model: Pyro model ``model(X, y)`` of the kind the convex relaxation takes: a Gaussian or
        Laplace prior on the weights and ``Bernoulli(logits=pcv.linear(X, u) + ...)`` observations
        (exactly one Bernoulli-logit site group).
    :param X_pool: ``(N, d)`` candidate rows, dense tensor or torch sparse CSR.
    :param oracle: callable ``oracle(indices: LongTensor) -> labels (len,)`` in ``{0, 1}``.
    :param str score: ``"cu"`` (classifier uncertainty), ``"ig"`` (information gain) or ``"random"``.
    :param int refit_every: number of inclusions between joint refits of all ``gamma`` (the block size
        of Nickisch & Seeger 2009 §3); within a block the posterior is kept valid by rank-one updates.
    :param int lanczos_rank: number of Lanczos steps of the engine (variances of model and candidate sites);
        ``None``: the engine's default ``lanczos_rank``.
    :param str variance: the engine's variance method (``"lanczos"``, or ``"exact"`` for small models).
    :param int init_outer: outer iterations of the initial fit.
    :param int refit_outer: outer iterations of each warm-started refit (``>= 1``; each costs one
        inner loop and one Lanczos run, the first variance update being the kept-valid marginals).
    :param float cg_tol: relative residual of the CG solves ``d = A^{-1} b_i``; default ``None``:
        ``max(1e-8, 1000 eps)`` with ``eps`` that of ``X_pool``'s dtype, i.e. ``1e-8`` in float64 and ``1.2e-4``
        in float32 (whose rounding puts ``1e-8`` out of reach); a value given is used as it is.
    :param dict engine_options: further keyword arguments of
        :class:`~pyro_convexvb.infer.convex_relaxation.ConvexVariationalRelaxation`.
    :param int seed: seeds the random score and the engine.
    :param bool progress: tqdm bar over inclusions.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> import pyro_convexvb as pcv
        >>> def model(X, y):
        ...     u = pyro.sample("u", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, u)), obs=y)
        >>> X = torch.randn(200, 3, dtype=torch.float64); y = (X[:, 0] > 0).double()
        >>> learner = ActiveLearner(model, X, lambda i: y[i], score="cu", refit_every=5, variance="exact",
        ...                         progress=False)
        >>> h = learner.run(10, init=torch.arange(10))
        >>> len(h.chosen)
        10
    """

    def __init__(self, model, X_pool, oracle, score="cu", refit_every=1, lanczos_rank=None, *, variance="lanczos",
                 init_outer=5, refit_outer=1, cg_tol=None, engine_options=None, seed=0, progress=True):
        if score not in _SCORES:
            raise ValueError(f"score: expected one of {_SCORES}, got {score!r}")
        for name, v, lo in (("refit_every", refit_every, 1), ("lanczos_rank", lanczos_rank, 1),
                            ("init_outer", init_outer, 0), ("refit_outer", refit_outer, 1)):
            if (v is not None or name != "lanczos_rank") and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                raise ValueError(f"{name}: expected an integer >= {lo}, got {v!r}")
        _check_rows(X_pool, "X_pool")
        if not callable(oracle):
            raise TypeError("oracle: expected a callable indices -> labels")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: expected a nonnegative integer, got {seed!r}")
        if cg_tol is None:
            cg_tol = default_cg_tol(X_pool.dtype)
        elif isinstance(cg_tol, bool) or not isinstance(cg_tol, (int, float)) or not 0 < cg_tol < 1:
            raise ValueError(f"cg_tol: expected None or a relative residual in (0, 1), got {cg_tol!r}")
        clash = sorted((_RESERVED | ({"lanczos_rank"} if lanczos_rank is not None else set()))
                       & set(engine_options or {}))
        if clash:
            raise ValueError(f"engine_options: {clash} are set by the active learner (use its own arguments: "
                             "init_outer/refit_outer, variance, lanczos_rank, seed)")
        self.model, self.X_pool, self.oracle = model, X_pool, oracle
        self.score, self.refit_every, self.lanczos_rank = score, refit_every, lanczos_rank
        self.init_outer, self.refit_outer, self.cg_tol = init_outer, refit_outer, cg_tol
        self.variance, self.seed, self.progress = variance, seed, progress
        self.engine_options = dict(engine_options or {})
        self.N = X_pool.shape[0]
        # candidate sites: trace the model once on the whole pool (labels do not enter the design)
        self.B_pool, self.o_pool, self.lik_name = self._sites(X_pool)

    # ------------------------------------------------------------------ helpers
    def _sites(self, X):
        y0 = torch.zeros(X.shape[0], dtype=X.dtype, device=X.device)
        lgm = lgm_from_pyro(self.model, X, y0)
        lik = [g for g in lgm.nongaussian_groups if isinstance(g.family, BernoulliLogit)]
        if len(lik) != 1:
            raise ValueError("model: expected exactly one Bernoulli-logit site group "
                             f"(found {len(lik)}); active learning needs the candidates' sites")
        return lik[0].design, lik[0].offset, lik[0].name

    def _fit(self, idx, labels, max_outer, init=None):
        rank = {} if self.lanczos_rank is None else {"lanczos_rank": self.lanczos_rank}
        eng = ConvexVariationalRelaxation(self.model, max_outer=max_outer, variance=self.variance, seed=self.seed,
                                          progress=False, init=init, **rank, **self.engine_options)
        with warnings.catch_warnings():
            # the outer-iteration budget of the fits is the algorithm's (Nickisch & Seeger 2009, §3): stopping
            # at max_outer is expected and recorded in ActiveHistory.converged, not warned about
            warnings.filterwarnings("ignore", category=ConvergenceWarning,
                                    message=r"engine 'convex_relaxation' did not converge \(stopped by: max_outer\)")
            return eng.run(_take_rows(self.X_pool, idx), labels)

    def _labels(self, idx):
        y = torch.as_tensor(self.oracle(torch.as_tensor(idx, dtype=torch.long)), dtype=self.X_pool.dtype)
        y = y.reshape(-1).to(self.X_pool.device)
        if y.numel() != len(idx):
            raise ValueError(f"oracle: returned {y.numel()} labels for {len(idx)} indices")
        if not bool(((y == 0) | (y == 1)).all()):
            raise ValueError("oracle: labels must be coded {0, 1}")
        return y

    def _scores(self, mean, var, alive, rng):
        if self.score == "random":
            s = torch.from_numpy(rng.random(self.N)).to(mean)
        elif self.score == "cu":
            s = classifier_uncertainty(mean, var.clamp_min(0))
        else:
            s = torch.full_like(mean, -float("inf"))
            ok = alive & (var > 0)
            s[ok] = information_gain(mean[ok], var[ok])
        return s.masked_fill(~alive, -float("inf"))

    def _test_error(self, result, B_test, o_test, y_test):
        eta = B_test.mv(result.posterior.loc) + o_test
        return float(((eta > 0).to(y_test.dtype) != y_test).double().mean())

    # ------------------------------------------------------------------ main loop
    def run(self, num_inclusions, init, X_test=None, y_test=None):
        """Include ``num_inclusions`` candidates sequentially, refitting every ``refit_every`` inclusions.

        :param int num_inclusions: number of candidates to include.
        :param init: initial training indices into ``X_pool`` (labels are asked from the oracle).
        :param X_test: optional ``(m, d)`` test rows; :param y_test: ``(m,)`` labels in ``{0, 1}``.
        :returns: :class:`ActiveHistory`.
        """
        t0 = time.perf_counter()
        init = _index_list(init, "init")
        if len(init) == 0 or len(set(init)) != len(init) or min(init) < 0 or max(init) >= self.N:
            raise ValueError("init: expected distinct indices into X_pool")
        if isinstance(num_inclusions, bool) or not isinstance(num_inclusions, int) or num_inclusions < 0:
            raise ValueError(f"num_inclusions: expected a nonnegative integer, got {num_inclusions!r}")
        if num_inclusions > self.N - len(init):
            raise ValueError(f"num_inclusions: only {self.N - len(init)} candidates remain")
        if (X_test is None) != (y_test is None):
            raise ValueError("X_test, y_test: give both or neither")
        if X_test is not None:
            _check_rows(X_test, "X_test", self.X_pool.shape[1])
            B_test, o_test, _ = self._sites(X_test)
            y_test = torch.as_tensor(y_test, dtype=self.X_pool.dtype, device=self.X_pool.device)
            if y_test.shape != (X_test.shape[0],):
                raise ValueError(f"y_test: expected shape ({X_test.shape[0]},), got {tuple(y_test.shape)}")
            if not bool(((y_test == 0) | (y_test == 1)).all()):
                raise ValueError("y_test: labels must be coded {0, 1} (as the oracle's)")
        rng = np.random.default_rng(self.seed)
        hist = ActiveHistory()
        idx = list(init)
        labels = self._labels(idx)
        result = self._fit(idx, labels, self.init_outer)

        def record(res):
            hist.converged.append(bool(res.converged))
            hist.num_included.append(len(idx))
            hist.seconds.append(time.perf_counter() - t0)
            if X_test is not None:
                hist.test_error.append(self._test_error(res, B_test, o_test, y_test))

        record(result)
        alive_all = torch.ones(self.N, dtype=torch.bool, device=self.X_pool.device)
        alive_all[torch.as_tensor(idx)] = False
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=num_inclusions, desc=f"active[{self.score}]", unit="case", leave=False)
        done = 0
        try:
            while done < num_inclusions:
                block = min(self.refit_every, num_inclusions - done)
                result, dropped, labels, included = self._block(result, idx, labels, block, alive_all, rng, hist,
                                                                bar)
                done += included  # fewer than block when every candidate left in the block was dropped
                hist.dropped.append(dropped)
                record(result)
        finally:
            if bar is not None:
                bar.close()
        hist.result = result
        return hist

    def _block(self, result, idx, labels, block, alive_all, rng, hist, bar):
        """One block: ``block`` inclusions with rank-one updates, then the warm-started refit.

        Over 80 lines: each inclusion updates the mean, the log-determinant and the candidates' marginals in place
        (Seeger 2010, §5), state that the steps of the loop share."""
        mean, var = result.posterior.marginals(self.B_pool, self.o_pool)
        u = result.posterior.loc.clone()
        log_det = result.state.logdet
        A0 = result.posterior.precision_operator
        sites = site_designs(result.lgm)  # model sites: B_m, group order of state.z / state.gamma
        z_model = result.state.z.clone()
        rows, gams = [], []
        alive = alive_all.clone()

        def a_mv(v):
            out = A0.mv(v)
            for b, g in zip(rows, gams):
                out = out + b * (b @ v) / g if v.dim() == 1 else out + torch.outer(b, b @ v) / g
            return out

        new_gamma, new_labels, new_idx = [], [], []
        dropped = 0
        for _ in range(block):
            s = self._scores(mean, var, alive, rng)
            i = int(torch.argmax(s))
            if not bool(torch.isfinite(s[i])):  # every candidate left was dropped: refit now (fresh marginals)
                break
            hist.chosen.append(i)
            hist.scores.append(float("nan") if self.score == "random" else float(s[i]))
            y_i = self._labels([i])
            new_labels.append(y_i)
            e = torch.zeros(self.N, dtype=mean.dtype, device=mean.device)
            e[i] = 1
            b = self.B_pool.rmv(e)
            d = cg(a_mv, b, rtol=self.cg_tol, on_fail="warn").x
            rho_i = b @ d
            mu_i = b @ u + self.o_pool[i]
            pot = LogisticPotential(y_i)
            gamma_i = minimize_site_phi(pot, mu_i.reshape(1), rho_i.reshape(1))[0]
            upd = rank_one_include(mean, var, self.B_pool.mv(d), d, u, log_det, mean_i=mu_i, var_i=rho_i,
                                   beta_i=pot.beta[0], gamma_i=gamma_i)
            mean, var, u, log_det = upd.mean, upd.var, upd.u, upd.log_det
            if sites.q:
                w_m = sites.design.mv(d)
                z_model = z_model - w_m * w_m / (rho_i + gamma_i)
            rows.append(b)
            gams.append(gamma_i)
            new_gamma.append(gamma_i)
            new_idx.append(i)
            idx.append(i)
            alive[i] = False
            alive_all[i] = False
            bad = alive & (var <= 0)
            dropped += int(bad.sum())
            alive &= ~bad
            if bar is not None:
                bar.update(1)
        if not new_idx:
            raise RuntimeError(f"active learning: no remaining candidate has a positive predictive variance under "
                               f"the fit of {len(idx)} cases (score {self.score!r}, variance {self.variance!r}); "
                               "use variance='exact' or a larger lanczos_rank")
        # block end: gamma, z and u of the enlarged model, in the engine's site order
        gamma_init, pieces = [], []  # pieces: (variances, rows of B as columns or the model-site slice)
        for name, sl in zip(sites.names, sites.slices):
            gamma_init.append(result.state.gamma[sl])
            pieces.append((z_model[sl], sl))
            if name == self.lik_name:
                gamma_init.append(torch.stack(new_gamma))
                pieces.append((var[torch.as_tensor(new_idx, device=var.device)], torch.stack(rows, 1)))
        # Nickisch & Seeger 2009 §3: model-site variances that turned nonpositive are recomputed by solving linear systems
        recomputed, parts = 0, []
        for zp, src in pieces:
            bad = torch.nonzero(zp <= 0).reshape(-1)
            if len(bad):
                if isinstance(src, slice):
                    E = torch.zeros(sites.q, len(bad), dtype=zp.dtype, device=zp.device)
                    E[src.start + bad, torch.arange(len(bad), device=zp.device)] = 1
                    Bt = sites.design.rmv(E)
                else:
                    Bt = src[:, bad]
                x = cg(a_mv, Bt, rtol=self.cg_tol, on_fail="warn").x
                zp = zp.clone()
                zp[bad] = (Bt * x).sum(0)
                recomputed += len(bad)
            parts.append(zp)
        z_init = torch.cat(parts)
        gamma_init = torch.cat(gamma_init)
        self.last_block = dict(result=result, mean=mean, var=var, u=u, log_det=log_det, rows=rows,
                               gamma=torch.stack(gams), labels=torch.cat(new_labels), alive=alive,
                               gamma_init=gamma_init, z_init=z_init, recomputed=recomputed)
        all_labels = torch.cat([labels] + new_labels)
        result = self._fit(idx, all_labels, self.refit_outer, RelaxationState(gamma_init, u, z_init, log_det))
        return result, dropped, all_labels, len(new_idx)
