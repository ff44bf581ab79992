"""Bayesian linear regression with type-II maximum likelihood (Steinberg et al. 2017, §1.2).

    y_n ~ N(phi(x_n)^T w, sigma^2),   w ~ N(0, lambda I_D)             (Eqs. 12-13)

The posterior over ``w`` and the predictive distribution are Gaussian in closed form (Eqs. 15-17);
``sigma^2``, ``lambda`` and the hyperparameters of the basis ``phi`` (e.g. a GPyTorch kernel inside
:class:`~pyro_convexvb.gp.RandomFourierFeatures`) maximise the log marginal likelihood (Eq. 14),
computed through the Woodbury identity and the matrix determinant lemma when ``N > D`` (cost
``O(N D^2 + D^3)``) and by an ``N x N`` Cholesky otherwise.

Notation note: the report writes ``C = [lambda I + Phi^T Phi / sigma^2]^{-1}`` (§1.2) while its prior
(13) and marginal likelihood (14) use ``lambda`` as the prior *variance*; we use the variance
throughout, i.e. ``C = [I / lambda + Phi^T Phi / sigma^2]^{-1}``.
"""
import math

import numpy as np
import torch
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted, validate_data

from .errors import warn
from .estimator_base import (POSITIVE, POSITIVE_INT, check_sample_weight, dense_float64,  # noqa: F401
                             design_matrix, fit_context, float_copy, positive_rows, sklearn_input, validate_dense,
                             warn_unused)

__all__ = ["blr_log_marginal_likelihood", "blr_posterior", "BayesianLinearRegression", "design_matrix",
           "sklearn_input"]

_LOG_2PI = math.log(2 * math.pi)


def blr_log_marginal_likelihood(Phi, y, noise_var, prior_var, weight=None):
    """``log N(y | 0, sigma^2 I_N + lambda Phi Phi^T)`` -- Steinberg et al. 2017, Eq. (14).

    Uses the Woodbury identity and the determinant lemma with ``A = Phi^T Phi / sigma^2 + I / lambda``
    when ``N > D``; an ``N x N`` Cholesky otherwise.  Differentiable in every argument.

    With ``weight``, row ``n``'s likelihood ``N(y_n | phi_n^T w, sigma^2)`` is raised to the power ``w_n``
    (``poutine.scale``): the evidence of the rows scaled by ``sqrt(w_n)`` plus
    ``-(sum(w) - N) (log 2 pi + log sigma^2) / 2``, which for integer weights is the evidence of the data
    with row ``n`` repeated ``w_n`` times.

    :param torch.Tensor Phi: ``(N, D)`` features.
    :param torch.Tensor y: ``(N,)`` targets.
    :param noise_var: ``sigma^2`` (scalar tensor or float).
    :param prior_var: ``lambda`` (scalar tensor or float).
    :param torch.Tensor weight: ``(N,)`` positive row weights, or ``None``.
    :returns: scalar tensor.

    Example::

        >>> import torch
        >>> Phi = torch.randn(50, 3, dtype=torch.float64); y = torch.randn(50, dtype=torch.float64)
        >>> K = 0.5 * torch.eye(50, dtype=torch.float64) + 2.0 * Phi @ Phi.T
        >>> ref = torch.distributions.MultivariateNormal(torch.zeros(50, dtype=torch.float64), K).log_prob(y)
        >>> bool(torch.allclose(blr_log_marginal_likelihood(Phi, y, 0.5, 2.0), ref))
        True
    """
    N, D = Phi.shape
    s2 = torch.as_tensor(noise_var, dtype=Phi.dtype, device=Phi.device)
    lam = torch.as_tensor(prior_var, dtype=Phi.dtype, device=Phi.device)
    if weight is not None:
        Phi, y = _weighted_rows(Phi, y, weight)
        extra = weight.sum() - N
        return blr_log_marginal_likelihood(Phi, y, s2, lam) - 0.5 * extra * (_LOG_2PI + torch.log(s2))
    if N > D:
        A = Phi.transpose(0, 1) @ Phi / s2 + torch.eye(D, dtype=Phi.dtype, device=Phi.device) / lam
        L = torch.linalg.cholesky(A)
        b = Phi.transpose(0, 1) @ y / s2
        c = torch.linalg.solve_triangular(L, b.unsqueeze(-1), upper=False).squeeze(-1)
        logdet = N * torch.log(s2) + D * torch.log(lam) + 2 * torch.log(torch.diagonal(L)).sum()
        quad = (y @ y) / s2 - c @ c
    else:
        Kyy = lam * (Phi @ Phi.transpose(0, 1)) + s2 * torch.eye(N, dtype=Phi.dtype, device=Phi.device)
        L = torch.linalg.cholesky(Kyy)
        a = torch.linalg.solve_triangular(L, y.unsqueeze(-1), upper=False).squeeze(-1)
        logdet = 2 * torch.log(torch.diagonal(L)).sum()
        quad = a @ a
    return -0.5 * (N * _LOG_2PI + logdet + quad)


def _weighted_rows(Phi, y, weight):
    """``(sqrt(w) * Phi, sqrt(w) * y)``: row ``n`` of a Gaussian likelihood raised to the power ``w_n``."""
    weight = torch.as_tensor(weight, dtype=Phi.dtype, device=Phi.device)
    if weight.shape != (Phi.shape[0],) or not bool(torch.isfinite(weight).all()) or not bool((weight > 0).all()):
        raise ValueError(f"weight: expected {Phi.shape[0]} positive finite row weights, got shape {tuple(weight.shape)}")
    r = weight.sqrt()
    return Phi * r.unsqueeze(-1), y * r


#: most iterations of :func:`evidence_fixed_point` (each costs O(min(N, D)) after one thin SVD)
FIXED_POINT_MAX_ITER = 100_000
#: the smallest relative change the evidence fixed point is asked for: float64 rounding moves ``sigma^2`` and
#: ``lambda`` by about ``1e-15`` relative each iteration, so a smaller ``1e-6 tol`` could never be met
FIXED_POINT_RTOL_FLOOR = 1e-14


def evidence_fixed_point(Phi, y, noise_var, prior_var, weight=None, *, learn_noise=True, learn_prior_var=True,
                         noise_floor=0.0, rtol=1e-12, max_iter=FIXED_POINT_MAX_ITER):
    """Maximise the evidence Eq. (14) over ``sigma^2`` and ``lambda`` for a fixed design by MacKay's fixed point.

    With ``gamma = sum_i lambda e_i / (lambda e_i + sigma^2)`` (``e_i`` the eigenvalues of ``Phi^T Phi``),
    ``lambda <- |m|^2 / gamma`` and ``sigma^2 <- |y - Phi m|^2 / (N - gamma)`` (MacKay 1992; Bishop 2006,
    Eqs. 3.92 and 3.95, with ``lambda = 1 / alpha`` and ``sigma^2 = 1 / beta``), every quantity a sum over the
    ``min(N, D)`` singular values of ``Phi`` after one thin SVD. Unlike a gradient test, its stopping rule (the
    relative change of both parameters below ``rtol``) is not fooled where the evidence is nearly flat in
    ``log lambda`` over decades (uncentred targets with ``fit_intercept=False``: it rose by 0.2 nats between
    ``lambda = 0.9`` and ``2 10^4`` on 100 rows of the diabetes data).

    :param weight: ``(N,)`` positive row weights (row ``n``'s likelihood to the power ``w_n``), or ``None``.
    :param float noise_floor: ``sigma^2`` is kept at or above it.
    :returns: ``(sigma^2, lambda, iterations, converged)`` as floats, int and bool.
    """
    Phi = torch.as_tensor(Phi, dtype=torch.float64).detach().cpu()
    y = torch.as_tensor(y, dtype=torch.float64).detach().cpu()
    n_eff = float(Phi.shape[0]) if weight is None else float(torch.as_tensor(weight, dtype=torch.float64).sum())
    if weight is not None:
        Phi, y = _weighted_rows(Phi, y, torch.as_tensor(weight, dtype=torch.float64).cpu())
    U, S, _ = torch.linalg.svd(Phi, full_matrices=False)
    e, c = (S**2).numpy(), (U.transpose(0, 1) @ y).numpy()
    outside = max(float(y @ y) - float(c @ c), 0.0)  # |y|^2 off the range of Phi: never fitted
    s2, lam = float(noise_var), float(prior_var)
    for it in range(1, int(max_iter) + 1):
        d = lam * e + s2
        gamma = float((lam * e / d).sum())
        new_lam = float((lam**2 * e * c**2 / d**2).sum()) / gamma if learn_prior_var and gamma > 0 else lam
        new_s2 = s2
        if learn_noise and n_eff - gamma > 0:
            new_s2 = max((outside + float((s2**2 * c**2 / d**2).sum())) / (n_eff - gamma), noise_floor)
        done = abs(new_lam - lam) <= rtol * lam and abs(new_s2 - s2) <= rtol * s2
        s2, lam = new_s2, new_lam
        if done or not (math.isfinite(lam) and math.isfinite(s2) and lam > 0 and s2 > 0):
            break
    ok = math.isfinite(lam) and math.isfinite(s2) and lam > 0 and s2 > 0
    return s2, lam, it, bool(done and ok)


def blr_posterior(Phi, y, noise_var, prior_var, weight=None):
    """Exact posterior ``w | y ~ N(m, C)`` -- Steinberg et al. 2017, §1.2 (the equations below Eq. 14).

    ``C = [I / lambda + Phi^T Phi / sigma^2]^{-1}``, ``m = C Phi^T y / sigma^2``; for ``N <= D`` the
    equivalent ``N x N`` form ``m = lambda Phi^T K^{-1} y``, ``C = lambda I - lambda^2 Phi^T K^{-1} Phi``
    with ``K = sigma^2 I + lambda Phi Phi^T``.

    :param torch.Tensor weight: ``(N,)`` positive row weights (row ``n``'s likelihood to the power ``w_n``), or ``None``.
    :returns: ``(m (D,), C (D, D))``.
    """
    if weight is not None:
        Phi, y = _weighted_rows(Phi, y, weight)
    N, D = Phi.shape
    s2 = torch.as_tensor(noise_var, dtype=Phi.dtype, device=Phi.device)
    lam = torch.as_tensor(prior_var, dtype=Phi.dtype, device=Phi.device)
    eye_d = torch.eye(D, dtype=Phi.dtype, device=Phi.device)
    if N > D:
        L = torch.linalg.cholesky(Phi.transpose(0, 1) @ Phi / s2 + eye_d / lam)
        m = torch.cholesky_solve((Phi.transpose(0, 1) @ y / s2).unsqueeze(-1), L).squeeze(-1)
        C = torch.cholesky_inverse(L)
    else:
        L = torch.linalg.cholesky(lam * (Phi @ Phi.transpose(0, 1)) + s2 * torch.eye(N, dtype=Phi.dtype, device=Phi.device))
        m = lam * (Phi.transpose(0, 1) @ torch.cholesky_solve(y.unsqueeze(-1), L).squeeze(-1))
        W = torch.linalg.solve_triangular(L, Phi, upper=False)  # L^{-1} Phi
        C = lam * eye_d - lam**2 * (W.transpose(0, 1) @ W)
    return m, 0.5 * (C + C.transpose(0, 1))


class BayesianLinearRegression(RegressorMixin, BaseEstimator):
    """Bayesian linear regression with type-II maximum likelihood (Steinberg et al. 2017, §1.2): a scikit-learn regressor.

    ``X`` may be NumPy, pandas, SciPy sparse (densified: the algorithm works with the dense
    ``N x D`` design and ``D x D`` posterior) or torch; computations are in float64 and outputs are
    NumPy arrays.

    :param basis: ``None`` (linear in ``X``), a callable ``X (N, d) -> Phi (N, D)`` on float64 torch
        tensors, or a :class:`torch.nn.Module` such as :class:`~pyro_convexvb.gp.RandomFourierFeatures`
        whose parameters are learned when ``learn_basis`` (on a float64 copy, ``basis_``; the module
        passed in is never modified).
    :param float noise_var: initial ``sigma^2``.
    :param float prior_var: initial ``lambda``.
    :param bool learn_noise: optimise ``sigma^2`` (kept above ``1e-10`` times the variance of ``y``, where
        targets that the features fit exactly would drive it to zero; a ``UserWarning`` says when it stops there).
    :param bool learn_prior_var: optimise ``lambda``.
    :param bool learn_basis: optimise the basis module's parameters (``learn_basis=False`` with a basis that is not
        a :class:`torch.nn.Module` is unused and named in a ``UserWarning``; so are ``max_iter`` and ``tol`` other
        than the defaults when nothing is learned: ``learn_noise=False``, ``learn_prior_var=False`` and no learned
        basis parameters).
    :param bool fit_intercept: append a ones column to ``Phi`` (its weight shares the prior ``N(0, lambda)``, so,
        unlike scikit-learn's ``BayesianRidge``, the answer depends on the level of ``y``: centre ``y`` when its
        mean is far from 0 on the scale of the weights).
    :param int max_iter: iterations: with a fixed design, MacKay's fixed point for ``sigma^2`` and ``lambda``
        (:func:`evidence_fixed_point`) and then L-BFGS, which checks its gradient; with a learned basis, L-BFGS.
    :param float tol: convergence: the largest gradient entry of the negative log evidence per row,
        ``-log ML / N`` (over ``log sigma^2``, ``log lambda`` and the learned basis parameters), at most
        ``tol (1 + |log ML| / N)`` (``N``: the sum of the sample weights); with a fixed design the fixed point must
        also have converged, to a relative change of ``max(1e-6 tol, 1e-14)`` (the evidence can be flat over
        decades of ``lambda``, where a gradient test alone stops early; ``1e-14`` is float64's rounding).

    Fitted attributes: ``coef_`` ``(D,)`` (posterior mean of the weights of the basis features),
    ``intercept_`` (posterior mean of the intercept; ``0.0`` without ``fit_intercept``),
    ``covariance_`` ``(D', D')`` (``C`` over all weights, the intercept last; ``D' = D + fit_intercept``),
    ``noise_var_``, ``prior_var_``, ``log_marginal_likelihood_``, ``n_iter_``, ``converged_``,
    ``posterior_`` (a :class:`~pyro_convexvb.GaussianPosterior` over all weights), ``n_features_in_``,
    ``feature_names_in_`` (pandas input).

    Example::

        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> X = rng.normal(size=(100, 2))
        >>> y = X @ [1.0, -2.0] + 0.1 * rng.normal(size=100)
        >>> blr = BayesianLinearRegression().fit(X, y)
        >>> mean, std = blr.predict(X[:3], return_std=True)
        >>> mean.shape, bool(abs(blr.noise_var_ - 0.01) < 0.01)
        ((3,), True)
    """

    _parameter_constraints = {
        "basis": [None, callable], "noise_var": POSITIVE, "prior_var": POSITIVE, "learn_noise": ["boolean"],
        "learn_prior_var": ["boolean"], "learn_basis": ["boolean"], "fit_intercept": ["boolean"],
        "max_iter": POSITIVE_INT, "tol": POSITIVE}

    def __init__(self, basis=None, noise_var=1.0, prior_var=1.0, learn_noise=True, learn_prior_var=True,
                 learn_basis=True, fit_intercept=False, max_iter=200, tol=1e-6):
        self.basis = basis
        self.noise_var = noise_var
        self.prior_var = prior_var
        self.learn_noise = learn_noise
        self.learn_prior_var = learn_prior_var
        self.learn_basis = learn_basis
        self.fit_intercept = fit_intercept
        self.max_iter = max_iter
        self.tol = tol

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = True
        return tags

    def _design(self, X):
        return design_matrix(self.basis_, X, self.fit_intercept)

    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y, sample_weight=None):
        """Maximise Eq. (14) over the hyperparameters, then compute the exact posterior. Returns ``self``.

        Over 80 lines: one sequence (validation, the evidence fixed point, L-BFGS on what is left of ``max_iter``,
        the posterior at the optimum) whose steps share the hyperparameter tensors and the iteration budget.

        :param X: ``(N, d)`` array-like (NumPy, pandas, SciPy sparse, torch).
        :param y: ``(N,)`` real targets.
        :param sample_weight: ``(N,)`` nonnegative row weights (default: all one): row ``n``'s likelihood is
            raised to the power ``sample_weight[n]``, so an integer weight is the row repeated that many times
            and a zero weight drops the row (the evidence and the posterior are those of the repeated data).
        """
        X, y = validate_data(self, sklearn_input(X), sklearn_input(y), y_numeric=True, dtype=np.float64,
                             accept_sparse="csr")
        weight, X, y = positive_rows(check_sample_weight(sample_weight, X.shape[0]), X, np.asarray(y))
        weight = None if weight is None else torch.from_numpy(weight)
        X, y = dense_float64(X), torch.from_numpy(np.array(y, dtype=np.float64))
        n_eff = X.shape[0] if weight is None else float(weight.sum())
        # the basis passed in is never trained: fit works on a float64 copy (basis_)
        self.basis_ = float_copy(self.basis)
        dt, dev = X.dtype, X.device
        log_s2 = torch.tensor(math.log(float(self.noise_var)), dtype=dt, device=dev, requires_grad=bool(self.learn_noise))
        log_lam = torch.tensor(math.log(float(self.prior_var)), dtype=dt, device=dev,
                               requires_grad=bool(self.learn_prior_var))
        params = [p for p in (log_s2, log_lam) if p.requires_grad]
        basis_params = []
        if self.learn_basis and isinstance(self.basis_, torch.nn.Module):
            self.basis_(X[:1])  # build lazily created buffers before collecting parameters
            basis_params = [p for p in self.basis_.parameters() if p.requires_grad]
        params += basis_params
        if not isinstance(self.basis_, torch.nn.Module):
            warn_unused(self, ("learn_basis",), "the basis is not a torch.nn.Module: it has no parameters to learn")
        if not params:
            warn_unused(self, ("max_iter", "tol"), "learn_noise=False and learn_prior_var=False with no learned basis "
                        "parameters: the fit is closed-form, nothing is optimised")
        fixed_design = None if basis_params else self._design(X).detach()
        history = []

        # a learned sigma^2 is kept above 1e-10 of the targets' variance: on data the features fit exactly the
        # evidence grows without bound as sigma^2 -> 0 and the posterior's factorisation breaks down
        # (the variance of the rows as weighted, so that integer weights give the floor of the repeated rows)
        wy = torch.ones_like(y) if weight is None else weight.to(y.dtype)
        mean_y = float((wy * y).sum() / wy.sum())
        var_y = float((wy * (y - mean_y) ** 2).sum() / max(float(wy.sum()) - 1.0, 1e-300)) if wy.sum() > 1 else 0.0
        scale_y = var_y if var_y > 0 else max(float((wy * y**2).sum() / wy.sum()), 1.0)
        s2_floor = 1e-10 * scale_y if self.learn_noise else 0.0

        def noise():
            return log_s2.exp() + s2_floor

        def objective():
            Phi = fixed_design if fixed_design is not None else self._design(X)
            return -blr_log_marginal_likelihood(Phi, y, noise(), log_lam.exp(), weight) / n_eff

        self.n_iter_, self.converged_ = 0, True
        fixed_point = True
        if params and fixed_design is not None:  # sigma^2 and lambda only: the fixed point first (its docstring)
            s2, lam, self.n_iter_, fixed_point = evidence_fixed_point(
                fixed_design, y, float(noise().detach()), float(log_lam.detach().exp()), weight,
                learn_noise=bool(self.learn_noise), learn_prior_var=bool(self.learn_prior_var), noise_floor=s2_floor,
                max_iter=int(self.max_iter), rtol=max(1e-6 * float(self.tol), FIXED_POINT_RTOL_FLOOR))
            if math.isfinite(s2) and math.isfinite(lam) and s2 > 0 and lam > 0:  # L-BFGS goes on from there
                with torch.no_grad():
                    log_s2.fill_(math.log(max(s2 - s2_floor, 1e-300)))
                    log_lam.fill_(math.log(lam))
        if params:
            from .linalg.lbfgs import minimize_lbfgs

            def loss_fn():
                loss = objective()
                history.append(float(loss.detach()))
                return loss

            left = int(self.max_iter) - self.n_iter_  # the fixed point's iterations count against max_iter
            if left > 0:
                res = minimize_lbfgs(params, loss_fn, max_iter=left, grad_tol=float(self.tol) * 1e-2,
                                     change_tol=1e-12, history_size=20, name="BayesianLinearRegression")
                history.pop()  # the final gradient check is not an iteration
                value, gnorm, stop, iters = res.value, res.grad_norm, res.stop_reason, res.iterations
            else:  # the budget went to the fixed point: the gradient is checked where it stopped
                loss = objective()
                grads = torch.autograd.grad(loss, params)
                value, gnorm, stop, iters = float(loss.detach()), max(float(g.abs().max()) for g in grads), \
                    "max_iter", 0
            self.n_iter_ += iters
            self.converged_ = fixed_point and gnorm <= float(self.tol) * (1 + abs(value))
            if not self.converged_ and left <= 0:
                warn(f"BayesianLinearRegression: the evidence fixed point for sigma^2 and lambda did not converge in "
                     f"max_iter={self.max_iter} iterations (gradient {gnorm:.3g} there, tol {self.tol:.1g}); "
                     "raise max_iter")
            elif not self.converged_:
                warn(f"BayesianLinearRegression: L-BFGS stopped ({stop}) after {iters} "
                     f"iterations with gradient {gnorm:.3g} (tol {self.tol:.1g})"
                     + ("" if fixed_point else "; the evidence fixed point had not converged when L-BFGS took over")
                     + "; raise max_iter")
        if s2_floor > 0 and float(log_s2.detach().exp()) <= 1e-3 * s2_floor:
            warn(f"BayesianLinearRegression: the learned noise variance stopped at its floor, 1e-10 times the "
                 f"targets' variance ({s2_floor:.3g}): the features fit the targets to within that, and the evidence "
                 "would grow without bound below it. noise_var_, the evidence and the predictive sds are those at "
                 "the floor (the sds wider than an unfloored optimum's); if the targets are that precise, pass "
                 "learn_noise=False with the known noise_var", UserWarning)
        with torch.no_grad():
            Phi = self._design(X)
            self.noise_var_ = float(noise())
            self.prior_var_ = float(log_lam.exp())
            self.log_marginal_likelihood_ = float(blr_log_marginal_likelihood(Phi, y, self.noise_var_, self.prior_var_,
                                                                              weight))
            m, C = blr_posterior(Phi, y, self.noise_var_, self.prior_var_, weight)
        from .infer.posterior import GaussianPosterior

        self.posterior_ = GaussianPosterior(m, covariance=C)
        w = m.numpy()
        self.coef_ = w[:-1].copy() if self.fit_intercept else w.copy()
        self.intercept_ = float(w[-1]) if self.fit_intercept else 0.0
        self.covariance_ = C.numpy().copy()
        self.history_ = history
        return self

    def predict(self, X, return_std=False, include_noise=True):
        """Predictive mean ``phi*^T m`` (Eq. 16) and optionally std ``sqrt(sigma^2 + phi*^T C phi*)`` (Eq. 17).

        :param X: ``(M, d)`` inputs.
        :param bool return_std: return the predictive standard deviation as well.
        :param bool include_noise: include ``sigma^2`` in the predictive variance (else the latent variance); it
            shapes the std only, so ``include_noise=False`` without ``return_std=True`` is a ``ValueError``.
        :returns: NumPy ``mean (M,)`` or ``(mean, std)``.
        """
        check_is_fitted(self, "posterior_")
        if not return_std and not include_noise:
            raise ValueError("include_noise=False: it chooses the variance behind the predictive std, which "
                             "return_std=False does not return; pass return_std=True (or leave include_noise)")
        X = validate_dense(self, X)
        with torch.no_grad():
            Phi = self._design(X)
            m = self.posterior_.loc
            mean = Phi @ m
            if not return_std:
                return mean.numpy()
            C = self.posterior_.covariance()
            var = ((Phi @ C) * Phi).sum(-1).clamp_min(0)
            if include_noise:
                var = var + self.noise_var_
        return mean.numpy(), var.sqrt().numpy()
