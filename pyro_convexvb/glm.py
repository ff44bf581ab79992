"""Bayesian generalised linear models with a mixture-of-diagonal-Gaussians posterior (Steinberg et al. 2017, §1.3).

    y_n ~ p(y_n | g(phi(x_n)^T w), gamma),   w ~ N(0, lambda I_D)            (Eqs. 19-20)

trained by SVI on :class:`~pyro_convexvb.infer.diag_mixture.DiagMixtureELBO` with mini-batches
(Eqs. 5-6, 21-27), learning ``lambda``, the Gaussian noise and the basis hyperparameters along
with ``q(w) = (1/K) sum_k N(m_k, diag psi_k)``.  Predictions follow Eqs. (29)-(31).
"""
import copy
import math

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from .blr import check_Xy, design_matrix
from .lgm.linear import linear

__all__ = ["GLM"]

_LIKELIHOODS = ("bernoulli", "gaussian", "poisson", "binomial")


def _gh(num_points, dtype, device):
    from .lgm.sites import gauss_hermite

    return gauss_hermite(num_points, dtype, device)


class GLM:
    """Bayesian GLM estimator (revrand's ``GeneralizedLinearModel``), scikit-learn style.

    :param str likelihood: ``"bernoulli"`` (logit link), ``"gaussian"`` (identity), ``"poisson"``
        (log link) or ``"binomial"`` (logit link, ``n_trials`` per row).
    :param basis: ``None`` (linear), a callable ``X -> Phi`` or a :class:`torch.nn.Module` such as
        :class:`~pyro_convexvb.gp.RandomFourierFeatures` (parameters learned when ``learn_basis``, on a copy ``basis_``; the module passed in is never
        modified).
    :param int num_components: ``K`` mixture components of ``q(w)``.
    :param int batch_size: mini-batch size ``M`` (``None``: full batch).
    :param float prior_var: initial ``lambda`` (learned when ``learn_prior_var``).
    :param float noise_var: initial Gaussian noise variance (learned when ``learn_noise``).
    :param int n_trials: default binomial number of trials (``fit``/``predict`` accept per-row counts).
    :param bool fit_intercept: append a ones column to ``Phi``.
    :param int num_particles: samples per component per step (``L``).
    :param str entropy: entropy bound, ``"eq24"`` (Steinberg et al. 2017) or ``"bhattacharyya"``.
    :param float lr: Adam learning rate.
    :param int max_steps: SVI step limit; the plateau rule of ``diag_mixture`` stops earlier.
    :param int seed: random seed.

    Fitted attributes: ``posterior_`` (:class:`~pyro_convexvb.infer.diag_mixture.DiagMixturePosterior`
    over ``w``), ``prior_var_``, ``noise_var_`` (gaussian), ``result_`` (the
    :class:`~pyro_convexvb.InferenceResult`), ``n_steps_``, ``converged_``.

    Example::

        >>> import torch
        >>> X = torch.randn(300, 2, dtype=torch.float64)
        >>> y = (X[:, 0] - X[:, 1] > 0).double()
        >>> glm = GLM("bernoulli", num_components=2, max_steps=600, min_steps=300).fit(X, y)
        >>> bool(((glm.predict(X) > 0.5).double() == y).double().mean() > 0.9)
        True
    """

    def __init__(self, likelihood="bernoulli", basis=None, num_components=1, batch_size=None, prior_var=1.0,
                 learn_prior_var=True, noise_var=1.0, learn_noise=True, n_trials=1, learn_basis=True,
                 fit_intercept=True, num_particles=1, entropy="eq24", lr=0.02, max_steps=20000, min_steps=500,
                 window=250, rtol=2e-4, init_scale=0.1, seed=0, progress=False):
        self.likelihood = likelihood
        self.basis = basis
        self.num_components = num_components
        self.batch_size = batch_size
        self.prior_var = prior_var
        self.learn_prior_var = learn_prior_var
        self.noise_var = noise_var
        self.learn_noise = learn_noise
        self.n_trials = n_trials
        self.learn_basis = learn_basis
        self.fit_intercept = fit_intercept
        self.num_particles = num_particles
        self.entropy = entropy
        self.lr = lr
        self.max_steps = max_steps
        self.min_steps = min_steps
        self.window = window
        self.rtol = rtol
        self.init_scale = init_scale
        self.seed = seed
        self.progress = progress

    # ------------------------------------------------------------------ the Pyro model
    def _learn_basis(self):
        return self.learn_basis and isinstance(self.basis_, torch.nn.Module) and any(
            p.requires_grad for p in self.basis_.parameters())

    def _trials(self, n_trials, N, like):
        n = self.n_trials if n_trials is None else n_trials
        n = torch.as_tensor(n, dtype=like.dtype, device=like.device).expand(N)
        if (n < 0).any() or (n != torch.round(n)).any():
            raise ValueError("n_trials must be nonnegative integers")
        return n

    def _model(self, X, y=None, n_trials=None, Phi=None):
        N = X.shape[0]
        dt, dev = X.dtype, X.device
        if self.learn_prior_var:
            lam = pyro.param("prior_var", torch.tensor(float(self.prior_var), dtype=dt, device=dev),
                             constraint=constraints.positive)
        else:
            lam = torch.tensor(float(self.prior_var), dtype=dt, device=dev)
        if self.likelihood == "gaussian":
            if self.learn_noise:
                s2 = pyro.param("noise_var", torch.tensor(float(self.noise_var), dtype=dt, device=dev),
                                constraint=constraints.positive)
            else:
                s2 = torch.tensor(float(self.noise_var), dtype=dt, device=dev)
        if self._learn_basis():
            pyro.module("basis", self.basis_)
        D = self.n_weights_
        w = pyro.sample("w", dist.Normal(torch.zeros(D, dtype=dt, device=dev), lam.sqrt()).to_event(1))
        wl = w if w.dim() == 1 else (w.reshape(w.shape[:-2] + w.shape[-1:]) if w.shape[-2] == 1 else w)
        with pyro.plate("data", N, subsample_size=self.batch_size) as idx:
            P = Phi[idx] if Phi is not None else design_matrix(self.basis_, X[idx], self.fit_intercept)
            f = linear(P, wl)
            obs = None if y is None else y[idx]
            if self.likelihood == "bernoulli":
                pyro.sample("y", dist.Bernoulli(logits=f), obs=obs)
            elif self.likelihood == "gaussian":
                pyro.sample("y", dist.Normal(f, s2.sqrt()), obs=obs)
            elif self.likelihood == "poisson":
                pyro.sample("y", dist.Poisson(torch.exp(f)), obs=obs)
            else:
                pyro.sample("y", dist.Binomial(total_count=n_trials[idx], logits=f), obs=obs)
        return f

    def _check_y(self, y, n_trials):
        if self.likelihood == "bernoulli" and not ((y == 0) | (y == 1)).all():
            raise ValueError("y must hold labels in {0, 1} for likelihood='bernoulli'")
        if self.likelihood in ("poisson", "binomial"):
            if (y < 0).any() or (y != torch.round(y)).any():
                raise ValueError(f"y must hold nonnegative integer counts for likelihood='{self.likelihood}'")
        if self.likelihood == "binomial" and (y > n_trials).any():
            raise ValueError("y exceeds n_trials for likelihood='binomial'")

    def fit(self, X, y, n_trials=None):
        """Fit ``q(w)`` and the hyperparameters by SVI on the mixture ELBO. Returns ``self``.

        :param X: ``(N, d)`` inputs.
        :param y: ``(N,)`` targets (labels in {0, 1}, counts, or reals).
        :param n_trials: binomial trials per row (int or ``(N,)``), default ``self.n_trials``.
        """
        from .infer.diag_mixture import DiagMixtureEngine

        if self.likelihood not in _LIKELIHOODS:
            raise ValueError(f"likelihood must be one of {_LIKELIHOODS}, got {self.likelihood!r}")
        if not isinstance(self.num_components, int) or self.num_components < 1:
            raise ValueError(f"num_components must be a positive integer, got {self.num_components!r}")
        X, y = check_Xy(X, y)
        N = X.shape[0]
        if self.batch_size is not None and not (isinstance(self.batch_size, int) and 1 <= self.batch_size):
            raise ValueError(f"batch_size must be a positive integer or None, got {self.batch_size!r}")
        batch = None if self.batch_size is None or self.batch_size >= N else self.batch_size
        trials = self._trials(n_trials, N, X) if self.likelihood == "binomial" else None
        self._check_y(y, trials)
        # the basis passed in is never trained: fit works on a copy (basis_)
        self.basis_ = copy.deepcopy(self.basis) if isinstance(self.basis, torch.nn.Module) else self.basis
        with torch.no_grad():
            self.n_weights_ = design_matrix(self.basis_, X[:2], self.fit_intercept).shape[1]
        Phi = None if self._learn_basis() else design_matrix(self.basis_, X, self.fit_intercept).detach()
        saved_batch = self.batch_size
        self.batch_size = batch

        def model(X, y=None):
            return self._model(X, y, trials, Phi)

        store = pyro.get_param_store()
        try:
            with store.scope() as state:
                engine = DiagMixtureEngine(
                    model, progress=bool(self.progress), num_components=self.num_components,
                    num_particles=self.num_particles, entropy=self.entropy, lr=self.lr, max_steps=self.max_steps,
                    min_steps=self.min_steps, window=self.window, rtol=self.rtol, init_scale=self.init_scale,
                    seed=self.seed, vectorize_particles=self.num_components * self.num_particles > 1)
                res = engine.run(X, y=y)
                params = {k: v.detach().clone() for k, v in store.items()}
        finally:
            self.batch_size = saved_batch
        self.param_state_ = state
        self.result_ = res
        self.posterior_ = res.posterior
        self.prior_var_ = float(params["prior_var"]) if "prior_var" in params else float(self.prior_var)
        if self.likelihood == "gaussian":
            self.noise_var_ = float(params["noise_var"]) if "noise_var" in params else float(self.noise_var)
        self.n_steps_ = res.info["steps"]
        self.converged_ = res.converged
        self.log_evidence_bound_ = res.log_evidence_bound
        self.n_features_in_ = X.shape[1]
        return self

    # ------------------------------------------------------------------ prediction
    def _check_fitted(self):
        if not hasattr(self, "posterior_"):
            raise RuntimeError("this GLM is not fitted yet; call fit(X, y) first")

    def _latent(self, X):
        """Per-component means and variances ``(K, M)`` of ``f* = phi*^T w``."""
        self._check_fitted()
        X = check_Xy(X, dtype=self.posterior_.dtype)
        if X.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {X.shape[1]} columns, the model was fitted on {self.n_features_in_}")
        with torch.no_grad():
            Phi = design_matrix(self.basis_, X.to(self.posterior_.dtype), self.fit_intercept)
            return self.posterior_.component_marginals(Phi)

    def predict(self, X, n_trials=None):
        """Predictive expectation ``E[y*]`` -- Steinberg et al. 2017, Eq. (29).

        Evaluated per mixture component on the exact Gaussian marginal of ``f* = phi*^T w``: closed
        form (gaussian, poisson) or 64-point Gauss-Hermite (bernoulli, binomial); no sampling.

        :returns: ``(M,)``.
        """
        M, V = self._latent(X)
        if self.likelihood == "gaussian":
            return M.mean(0)
        if self.likelihood == "poisson":
            return torch.exp(M + 0.5 * V).mean(0)
        x, wts = _gh(64, M.dtype, M.device)
        p = (torch.sigmoid(M.unsqueeze(-1) + V.clamp_min(0).sqrt().unsqueeze(-1) * x) * wts).sum(-1).mean(0)
        if self.likelihood == "binomial":
            return p * self._trials(n_trials, p.shape[0], p)
        return p

    def predict_proba(self, X):
        """``P(y* = 1)`` (bernoulli): the predictive expectation."""
        if self.likelihood != "bernoulli":
            raise ValueError("predict_proba is only defined for likelihood='bernoulli'")
        return self.predict(X)

    def predictive_cdf(self, X, alpha, n_trials=None, num_points=32):
        """``P(y* <= alpha | data)`` per row -- Steinberg et al. 2017, Eq. (30), by quadrature over ``q``.

        :param alpha: ``(M,)`` or broadcastable thresholds.
        """
        M, V = self._latent(X)
        alpha = torch.as_tensor(alpha, dtype=M.dtype, device=M.device)
        return self._cdf(M, V, alpha.expand(M.shape[1:]), n_trials, num_points)

    def _cdf(self, M, V, alpha, n_trials, num_points=32):
        # M, V: (K, rows); alpha: (rows,) -> (rows,)
        if self.likelihood == "gaussian":
            s = (V + self.noise_var_).sqrt()
            return torch.special.ndtr((alpha - M) / s).mean(0)
        x, wts = _gh(num_points, M.dtype, M.device)
        f = M.unsqueeze(-1) + V.clamp_min(0).sqrt().unsqueeze(-1) * x  # (K, rows, Q)
        a = torch.floor(alpha).unsqueeze(-1)
        if self.likelihood == "bernoulli":
            F = torch.where(a < 0, torch.zeros_like(f), torch.where(a >= 1, torch.ones_like(f), torch.sigmoid(-f)))
        elif self.likelihood == "poisson":
            F = torch.where(a < 0, torch.zeros_like(f), torch.special.gammaincc(a.clamp_min(0) + 1, torch.exp(f)))
        else:
            n = self._trials(n_trials, M.shape[1], M).unsqueeze(-1)
            F = _binomial_cdf(a, n, f)
        return (F * wts).sum(-1).mean(0)

    def predict_quantile(self, X, q, n_trials=None):
        """Predictive quantile ``alpha`` with ``P(y* <= alpha) = q`` -- Steinberg et al. 2017, Eq. (31), by root finding.

        Continuous (gaussian): Newton/bisection on the mixture CDF.  Discrete likelihoods: the
        smallest integer ``alpha`` with ``P(y* <= alpha) >= q`` (integer bisection).
        """
        from .infer.diag_mixture import mixture_quantiles

        if not 0 < float(q) < 1:
            raise ValueError(f"q must lie in (0, 1), got {q}")
        M, V = self._latent(X)
        if self.likelihood == "gaussian":
            return mixture_quantiles(M, (V + self.noise_var_).sqrt(), [float(q)])[0]
        rows = M.shape[1]
        lo = torch.full((rows,), -1.0, dtype=M.dtype, device=M.device)  # F(-1) = 0 < q
        if self.likelihood == "bernoulli":
            hi = torch.ones(rows, dtype=M.dtype, device=M.device)
        elif self.likelihood == "binomial":
            hi = self._trials(n_trials, rows, M).clone()
        else:
            hi = torch.ceil(torch.exp(M + 0.5 * V).max(0).values + 10 * torch.exp(M + V).max(0).values.sqrt() + 10)
            for _ in range(60):
                bad = self._cdf(M, V, hi, n_trials) < q
                if not bad.any():
                    break
                hi = torch.where(bad, 2 * hi, hi)
        while bool((hi - lo > 1).any()):
            mid = torch.floor((lo + hi) / 2)
            ok = self._cdf(M, V, mid, n_trials) >= q
            move = hi - lo > 1
            hi = torch.where(move & ok, mid, hi)
            lo = torch.where(move & ~ok, mid, lo)
        return hi

    def predict_interval(self, X, p=0.95, n_trials=None):
        """Central predictive interval with probability ``p``: quantiles ``(1-p)/2`` and ``(1+p)/2`` (Eqs. 30-31).

        :returns: ``(lower (M,), upper (M,))``.
        """
        if not 0 < float(p) < 1:
            raise ValueError(f"p must lie in (0, 1), got {p}")
        return (self.predict_quantile(X, (1 - p) / 2, n_trials), self.predict_quantile(X, (1 + p) / 2, n_trials))


def _binomial_cdf(a, n, f):
    """``P(Y <= a)`` for ``Y ~ Binomial(n, sigmoid(f))`` (``a`` integer-valued), by summing the pmf."""
    n_max = int(n.max())
    k = torch.arange(n_max + 1, dtype=f.dtype, device=f.device)
    logp, log1mp = torch.nn.functional.logsigmoid(f).unsqueeze(-1), torch.nn.functional.logsigmoid(-f).unsqueeze(-1)
    nn = n.unsqueeze(-1)
    valid = k <= nn
    kk = torch.where(valid, k, torch.zeros_like(k))
    logpmf = (torch.lgamma(nn + 1) - torch.lgamma(kk + 1) - torch.lgamma((nn - kk).clamp_min(0) + 1)
              + kk * logp + (nn - kk) * log1mp)
    pmf = torch.where(valid & (k <= a.unsqueeze(-1)), logpmf.exp(), torch.zeros_like(logpmf))
    return pmf.sum(-1).clamp(0, 1)
