r"""The ``dual_vg`` engine and the :class:`DualVG` Pyro autoguide (Khan et al. 2013).

``fit_dual_vg(lgm, ...)`` builds the storage form of the dual that fits the model (``N x N``
site space, ``L x L`` latent space, or a banded GMRF precision), minimises the reduced dual with
:func:`~.optim.solve_dual`, recovers ``q = N(m*, V*)`` (Khan et al. 2013, Eqs. 17-18) and reports the exact
variational-Gaussian bound of that ``q`` (closed-form or Gauss-Hermite site expectations; never
``-g``), with the duality gap of every iteration in the history.
"""
import math
import typing
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from pyro.infer.autoguide import AutoMultivariateNormal
from pyro.nn.module import PyroParam

from ...errors import UnsupportedModelError
from ...linalg.operators import IdentityOperator, SparseOperator
from ..engine import Criterion, Engine, LGMEngineOptions, Optimality, Solution, option
from ...lgm.stack import Stacked
from .bounds import LOGIT_BOUNDS, LogitJaakkolaBound, make_bound
from .objective import BandedPrecisionBackend, LatentSpaceBackend, SiteSpaceBackend, exact_elbo
from .optim import refine_exact, solve_dual
from .sharding import sharded_design

__all__ = ["DualVG", "DualVGEngine", "DualVGOptions", "fit_dual_vg", "site_space_predictive", "dual_vg_applies",
           "build_dual_problem"]

#: largest accepted relative change of a site natural parameter by one more full CVI step after ``refine``
REFINE_RESIDUAL_TOL = 1e-8


def dual_vg_applies(lgm):
    """``None`` if DualVG fits ``lgm`` (Gaussian priors on every block, and sites whose family has a convex local
    bound, :meth:`~pyro_convexvb.lgm.families.SiteFamily.local_bound`), else the
    :class:`~pyro_convexvb.UnsupportedModelError` naming the site and the reason."""
    for p in lgm.priors:
        if p.flat:
            return UnsupportedModelError(p.name, f"latent '{p.name}' has no Gaussian prior (flat block, e.g. a "
                                                 "Laplace prior)")
    for g in lgm.sites:
        try:
            g.family.local_bound()
        except ValueError as e:  # UnsupportedModelError, or data outside the family's support
            return UnsupportedModelError(g.name, getattr(e, "reason", str(e)))
    if not lgm.sites:
        return UnsupportedModelError("<model>", "the model has no likelihood sites")
    return None


def _is_identity(op, n):
    return isinstance(op, IdentityOperator) and op.shape == (n, n)


def _one_per_row(op):
    if not isinstance(op, SparseOperator):
        return False
    crow = op.matrix.crow_indices()
    return bool(((crow[1:] - crow[:-1]) == 1).all())


def build_dual_problem(lgm, bound="tight", form="auto", xi=None):
    """``(backend, local bound, latent-space kind)`` for a :class:`~pyro_convexvb.LatentGaussianModel`.

    :param str form: ``"site"`` (``N x N``), ``"latent"`` (``L x L``), ``"banded"`` (sparse
        precision) or ``"auto"``: banded when the prior is a sparse precision only and every site
        reads one latent; else latent space when ``L < N``; else site space.

    Row-sharded data (a design wrapped by :func:`pyro_convexvb.distributed.row_sharded` under an
    initialised process group) runs in the ``L x L`` form only: each rank keeps its own sites, ``W^T u``
    and ``W^T Lambda W`` are all-reduced (:mod:`.sharding`). ``form="auto"`` then selects it; the
    site and banded forms raise, since their ``N x N`` (or site-indexed sparse) matrices couple the
    sites of all ranks.
    """
    err = dual_vg_applies(lgm)
    if err is not None:
        raise err
    if form not in ("auto", "site", "latent", "banded"):
        raise ValueError(f"form: expected 'auto', 'site', 'latent' or 'banded', got {form!r}")
    bounds = [make_bound(g.family, bound, xi) for g in lgm.sites]
    lb = bounds[0] if len(bounds) == 1 else Stacked(bounds)
    W, comm = sharded_design(lgm.design())
    d = lgm.offset()
    mu = lgm.prior_loc
    N, L = W.shape
    precision_only = lgm.prior_cov is None
    if comm is not None:
        if form in ("site", "banded"):
            raise ValueError(f"dual_vg: form='{form}' cannot run on row-sharded data (its matrices couple the sites of "
                             f"every rank); use form='latent' (the L x L form, or form='auto', which selects it)")
        form = "latent"
    if form == "auto":
        if precision_only and len(lgm.priors) == 1 and isinstance(lgm.priors[0].prec, SparseOperator) \
                and (_is_identity(W, L) or _one_per_row(W)):
            form = "banded"
        elif L < N:
            form = "latent"
        else:
            form = "site"
    if form == "banded":
        Q = lgm.priors[0].prec if len(lgm.priors) == 1 else None
        if Q is None:
            raise ValueError("form='banded' needs a single prior block given by a sparse precision")
        backend = BandedPrecisionBackend(Q, mu, None if _is_identity(W, L) else W, d)
    elif form == "latent":
        backend = LatentSpaceBackend(W, mu, d, prior_cov=None if precision_only else lgm.dense_prior_cov(),
                                     prior_prec=lgm.dense_prior_prec(), prior_logdet_cov=lgm.prior_logdet_cov(),
                                     comm=comm)
    else:
        S = lgm.dense_prior_cov()
        if _is_identity(W, L):
            St, latent = S, None
        else:
            Wd = W.to_dense()
            WS = Wd @ S
            St, latent = WS @ Wd.transpose(0, 1), (WS, mu, S)
        backend = SiteSpaceBackend(0.5 * (St + St.transpose(0, 1)), W.mv(mu) + d)
        backend.latent = latent
        # the site backend works on eta = W z + d; with W = I the latent is eta - d
        backend.site_offset = d
    if isinstance(lb, LogitJaakkolaBound) or any(isinstance(b, LogitJaakkolaBound) for b in lb.split()):
        h, rho = backend.prior_marginals()
        parts = lb.split()
        for b, hh, rr in zip(parts, h.split([len(b) for b in parts]), rho.split([len(b) for b in parts])):
            if isinstance(b, LogitJaakkolaBound) and b.xi is None:
                b.set_xi(torch.sqrt(hh**2 + rr))
    return backend, lb, form


def _posterior(backend, alpha, lam):
    """``q(z)`` over the latent ``z`` from the dual optimum (Khan et al. 2013, Eqs. 17-18) in the backend's form.

    The site form works on the predictors ``eta = W z + d``: with a general design the latent moments
    are ``m = mu - Sigma W^T alpha``, ``V = Sigma - Sigma W^T Lam^1/2 B^{-1} Lam^1/2 W Sigma``; with
    ``W = I`` its Gaussian over ``eta`` is shifted back by the offset, ``z = eta - d``.
    """
    from ..posterior import GaussianPosterior

    if backend.kind == "site" and getattr(backend, "latent", None) is not None:
        WS, mu, S = backend.latent  # WS = W Sigma  (N, L)
        R, s = backend._chol(lam)
        T = torch.linalg.solve_triangular(R, s[:, None] * WS, upper=False)  # R^{-1} Lam^1/2 W Sigma  (N, L)
        V = S - T.transpose(0, 1) @ T
        return GaussianPosterior(mu - WS.transpose(0, 1) @ alpha, covariance=0.5 * (V + V.transpose(0, 1)))
    q = backend.posterior(alpha, lam)
    d = getattr(backend, "site_offset", None) if backend.kind == "site" else None
    if d is not None and bool((d != 0).any()):
        q = GaussianPosterior(q.loc - d, covariance=q.covariance(force=True))
    return q


@dataclass(frozen=True)
class DualVGOptions(LGMEngineOptions):
    bound: typing.Literal["tight", "jensen", "bohning", "jaakkola"] = option(
        "tight", "Bernoulli-logit local bound (other families use their own bounds: exact for Poisson, Gaussian and "
                 "stochastic volatility, the tight probit bound for probit)")
    method: typing.Literal["newton", "lbfgs"] = option("newton", "dual minimiser")
    form: typing.Literal["auto", "site", "latent", "banded"] = option(
        "auto", "storage form: N x N site space, L x L latent space, a GMRF's sparse precision ('banded': sparse "
                "Cholesky), or auto")
    newton_solver: typing.Literal["auto", "dense", "cg"] = option(
        "auto", "Newton systems in the L x L form: dense Cholesky, matrix-free CG, or the cheaper by a flop count")
    gap_tol: typing.Optional[float] = option(None, "convergence: duality gap in nats (default 1e-8 N)", gt=0)
    max_iter: typing.Optional[int] = option(None, "iteration cap (default 100 Newton / 2000 L-BFGS)", min=1)
    alpha0: typing.Any = option(None, "(N,) warm start of the dual variables")
    xi: typing.Any = option(None, "Jaakkola variational parameters (default: at the prior marginals)")
    refine: bool = option(False, "polish q by natural-gradient (CVI) steps with exact expectations (site form)")


class DualVGEngine(Engine):
    r"""The ``dual_vg`` engine: the convex Fenchel dual of the variational-Gaussian bound (Khan et al. 2013).

    Builds the storage form of the dual that fits the model (``N x N`` site space, ``L x L`` latent
    space, or a banded GMRF precision; :func:`build_dual_problem`), minimises the reduced dual with
    :func:`~.optim.solve_dual`, recovers ``q = N(m*, V*)`` (Khan et al. 2013, Eqs. 17-18) and reports
    the exact variational-Gaussian bound of that ``q`` (closed-form or Gauss-Hermite site
    expectations; never ``-g``), with the duality gap of every iteration in the history.

    Convergence: the duality gap ``g(alpha) - ELBO_LVB`` (a sum of Fenchel-Young residuals, in nats)
    ``<= gap_tol``.

    :meth:`run` returns an :class:`~pyro_convexvb.InferenceResult` whose ``info`` holds ``alpha``,
    ``lam``, ``gap``, ``dual_objective``, ``lvb_elbo`` (the local bound's own ELBO),
    ``site_mean``/``site_var``, ``iterations``, ``form``, and ``backend``/``local_bound`` (the dual
    problem, used by :func:`site_space_predictive`).

    Example::

        >>> import torch
        >>> from pyro_convexvb import LatentGaussianModel
        >>> from pyro_convexvb.lgm.sites import Poisson
        >>> X = torch.randn(30, 3, dtype=torch.float64)
        >>> y = torch.poisson(torch.exp(X @ torch.tensor([.3, -.2, .1], dtype=torch.float64)))
        >>> res = DualVGEngine(LatentGaussianModel.from_design(X, Poisson(y)), progress=False).run()
        >>> res.converged, res.info["gap"] < 1e-6
        (True, True)
    """

    name = "dual_vg"
    description = ("Dual variational Gaussian (Khan et al. 2013): convex Fenchel dual, Newton/L-BFGS, stops on the "
                   "duality gap")
    Options = DualVGOptions
    optimality_measure = "duality gap (nats) <= gap_tol"
    distributed = True  # row-sharded data in the L x L form (build_dual_problem)

    @classmethod
    def applies(cls, lgm):
        return dual_vg_applies(lgm)

    def extract(self, *args, **kwargs):
        """The latent Gaussian model; on row-sharded data with a predictor whose Jacobian extraction probed into
        local rows (``pcv.linear(Xs, w) + b``), its designs are marked row-sharded again
        (:func:`~pyro_convexvb.infer.sharded_svi.reshard_lgm`)."""
        from ..sharded_svi import reshard_lgm

        return reshard_lgm(super().extract(*args, **kwargs), args, kwargs)

    def warm_start_options(self, result):
        return {"alpha0": result.info["alpha"]} if "alpha" in result.info else {}

    def precise_options(self):
        return {"gap_tol": 1e-9}

    # ------------------------------------------------------------------ type-II maximum likelihood
    def type2_value(self, result):
        """The dual's own bound: the local-bound ELBO at the dual optimum (``max_q ELBO_LVB``)."""
        return float(result.info["lvb_elbo"])

    def lvb_elbo_at(self, lgm, result):
        """``ELBO_LVB(q*; theta)`` of the fitted ``q*`` on ``lgm`` (the model at other hyperparameters), a 0-d tensor
        (differentiable in the params when ``lgm`` keeps their graph)."""
        o = self.options
        if o.bound == "jaakkola":
            raise ValueError(f"engine '{self.name}': learn_params needs a local bound that does not depend on "
                             "theta through its variational parameters; the 'jaakkola' bound fixes xi at the prior "
                             "marginals -- use bound='tight', 'jensen' or 'bohning', or learn_params=False")
        if sharded_design(lgm.design())[1] is not None:
            raise ValueError(f"engine '{self.name}': type-II learning of model parameters (learn_params) is not "
                             "available on row-sharded data; fit with learn_params=False")
        q = result.posterior
        if q.n != lgm.n or getattr(q, "coordinates", None) == "model":
            q = lgm.latent_marginal(q)
        m = q.loc.to(lgm.dtype)
        V = q.covariance().to(lgm.dtype)
        L = torch.linalg.cholesky(V)
        val = lgm.expected_log_prior(m, V) + torch.log(torch.diagonal(L)).sum() + \
            0.5 * lgm.n * (1 + math.log(2 * math.pi)) + lgm.log_const
        for g in lgm.sites:
            b = make_bound(g.family, o.bound, o.xi)
            val = val - b.f(g.eta(m), lgm._marginal_var(g, V)).sum()
        return val

    def type2_gradient(self, params, x, result, args, kwargs, h):
        """Envelope theorem (Khan et al. 2013, §5): ``d/dtheta ELBO_LVB(q*; theta)`` at the fixed ``q*``."""
        from ..type2 import envelope_gradient

        if result.posterior.n > 5000:
            return super().type2_gradient(params, x, result, args, kwargs, h)
        return envelope_gradient(params, x, self.model, args, kwargs, lambda lgm: self.lvb_elbo_at(lgm, result), h,
                                 autograd=True)

    def solve(self, lgm, run):
        o = self.options
        backend, lb, form = build_dual_problem(lgm, o.bound, o.form, o.xi)
        bar = run.bar(unit="iter")

        def callback(alpha, val, gap):
            bar.update(1)
            bar.set_postfix(gap=f"{gap:.3g}")

        alpha0 = None if o.alpha0 is None else torch.as_tensor(o.alpha0, dtype=lgm.dtype, device=lgm.device)
        if alpha0 is not None and (alpha0.shape != (len(lb),) or not bool(torch.isfinite(alpha0).all())):
            raise ValueError(f"engine '{self.name}': option 'alpha0' must be a finite vector of one dual variable per "
                             f"observed site entry, shape ({len(lb)},); got shape {tuple(alpha0.shape)}"
                             + ("" if alpha0.shape != (len(lb),) else " with non-finite entries"))
        sol = solve_dual(backend, lb, alpha0, method=o.method, gap_tol=o.gap_tol, max_iter=o.max_iter,
                         history=run.history, on_fail="ignore", newton_solver=o.newton_solver, callback=callback)
        alpha, lam = sol.alpha, sol.lam
        info = {}
        if o.refine:
            if form != "site":
                raise ValueError(f"engine '{self.name}': option 'refine' needs the N x N site form (form='site'); "
                                 f"this model uses form='{form}'")
            alpha, lam, _, rit, rconv, resid = refine_exact(backend, lb, alpha, lam, tol=1e-15,
                                                             residual_tol=REFINE_RESIDUAL_TOL, return_residual=True)
            info.update(refine_iterations=rit, refine_converged=rconv, refine_residual=resid)
        terms = backend.evaluate(alpha, lam)
        bound_value = float(exact_elbo(backend, lb, alpha, lam, terms, lgm.log_const))
        posterior = _posterior(backend, alpha, lam)
        posterior.layout = lgm.layout
        info.update(alpha=alpha, lam=lam, gap=sol.gap, dual_objective=sol.g, lvb_elbo=sol.g - sol.gap + lgm.log_const,
                    site_mean=terms.m_tilde, site_var=terms.v_tilde, iterations=sol.iterations,
                    evaluations=sol.evaluations, cg_iterations=sol.cg_iterations, form=form, bound=o.bound,
                    method=o.method, refine=o.refine, backend=backend, local_bound=lb)
        opt = Optimality.single("duality gap (nats)", sol.gap, sol.gap_tol)
        if o.refine:  # the returned q is the refined one: judged by the exact VG fixed point as well
            opt = Optimality(opt.criteria + (Criterion("exact-VG fixed-point residual (relative change of the site natural parameters)",
                                                       info["refine_residual"], REFINE_RESIDUAL_TOL),))
        reason = "duality gap" if sol.converged else "max_iter"
        return Solution(posterior, bound_value, opt, reason, info)


def fit_dual_vg(lgm, progress=True, **options):
    """``DualVGEngine(lgm, progress=progress, **options).run()``: the ``dual_vg`` engine on a latent Gaussian model."""
    return DualVGEngine(lgm, progress=progress, **options).run()


def site_space_predictive(result, K_cross, k_test_diag, prior_mean_test=0.0):
    r"""Latent predictive at test inputs from a site-form ``dual_vg`` fit of a GP, without inverting ``K``.

    Mean ``mu_* - k_*^T alpha`` and variance ``k_** - ||R^{-1} Lambda^{1/2} k_*||^2`` with ``R`` the
    Cholesky factor of ``I + Lambda^{1/2} K Lambda^{1/2}`` (docs/dual_vg.md, § Algorithm and recovery).

    :param result: an :class:`~pyro_convexvb.InferenceResult` of ``dual_vg`` in the ``"site"`` form with
        an identity design (the latent is the GP's ``f`` at the training inputs).
    :param torch.Tensor K_cross: ``(m, N)`` test-train kernel matrix.
    :param torch.Tensor k_test_diag: ``(m,)`` prior variances at the test inputs.
    :param prior_mean_test: prior mean at the test inputs (number or ``(m,)``).
    :returns: ``(mean (m,), var (m,))``.
    """
    backend = result.info.get("backend")
    if result.engine != "dual_vg" or backend is None or backend.kind != "site" or \
            getattr(backend, "latent", None) is not None:
        raise ValueError("site_space_predictive needs a dual_vg result in the N x N site form with an identity "
                         "design (a GP over the training inputs)")
    lam, alpha = result.info["lam"], result.info["alpha"]
    R, s = backend._chol(lam)
    Z = torch.linalg.solve_triangular(R, s[:, None] * K_cross.transpose(0, 1), upper=False)
    return prior_mean_test - K_cross @ alpha, (k_test_diag - (Z * Z).sum(0)).clamp_min(0)


class DualVG(AutoMultivariateNormal):
    r"""A Pyro autoguide fitted through the convex Fenchel dual of the variational-Gaussian bound.

    A full-rank Gaussian guide over the model's latent vector (an :class:`~pyro.infer.autoguide.AutoContinuous`,
    with the parameters of :class:`~pyro.infer.autoguide.AutoMultivariateNormal`: ``loc``, ``scale``,
    ``scale_tril``). :meth:`fit` extracts the latent Gaussian model, minimises the dual objective of
    Khan et al. 2013 (Eq. 20) by Newton's method until the duality gap is below tolerance, and writes the
    optimal ``q`` into the parameters; afterwards the guide samples, gives ``median()``,
    ``quantiles()``, ``get_posterior()``, works with ``Predictive``, and can be trained further with
    ``SVI`` (its parameters live in the Pyro param store).

    :param callable model: a Pyro model that is a latent Gaussian model (Gaussian priors; Bernoulli-logit,
        Bernoulli-probit (``probs=Normal.cdf(...)``), Poisson or Normal likelihoods with affine predictors,
        each also weighted by ``poutine.scale``).
    :param str bound: Bernoulli-logit local bound (``"tight"``, ``"jensen"``, ``"bohning"``, ``"jaakkola"``);
        the other families use their own bounds.
    :param str method: ``"newton"`` or ``"lbfgs"``.
    :param options: further options of the ``dual_vg`` engine (fields of :class:`DualVGOptions`: ``form``,
        ``gap_tol``, ``max_iter``, ``xi``, ...), validated here.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X = torch.randn(50, 2, dtype=torch.float64); y = (X[:, 0] > 0).double()
        >>> guide = DualVG(model)
        >>> res = guide.fit(X, y=y)
        >>> guide.median()["w"].shape
        torch.Size([2])
    """

    def __init__(self, model, bound="tight", method="newton", init_scale=0.1, **options):
        if bound not in LOGIT_BOUNDS:
            raise ValueError(f"bound: expected one of {LOGIT_BOUNDS}, got {bound!r}")
        super().__init__(model, init_scale=init_scale)
        self.bound = bound
        self.method = method
        # validated once, here: unknown or ill-typed options fail at construction, naming the option
        self.engine_options = DualVGOptions.create(DualVGEngine.name, dict(options, bound=bound, method=method))
        self.options = options
        self.result = None

    def fit(self, *args, progress=False, warm_start=True, **kwargs):
        """Minimise the dual for the model's data ``(*args, **kwargs)``; returns the :class:`InferenceResult`."""
        opts = self.engine_options.as_dict()
        if warm_start and self.result is not None and opts["alpha0"] is None:
            opts["alpha0"] = self.result.info["alpha"]
        try:
            res = DualVGEngine(self.model, progress=progress, **opts).run(*args, **kwargs)
        except (ValueError, RuntimeError):
            if opts["alpha0"] is None or self.engine_options.alpha0 is not None:
                raise
            opts["alpha0"] = None  # the warm start belongs to other data: start cold
            res = DualVGEngine(self.model, progress=progress, **opts).run(*args, **kwargs)
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        q = res.posterior
        if self.latent_dim != q.n:
            raise ValueError(f"the model has {self.latent_dim} latent dimensions but the dual posterior has {q.n}")
        self._set_from_posterior(q)
        res.info["guide"] = self
        self.result = res
        return res

    def _set_from_posterior(self, q):
        """Write ``q`` into ``loc``, ``scale``, ``scale_tril`` and make the param store hold these values.

        Store entries of the guide's parameter names (e.g. from SVI steps or an earlier fit) are replaced,
        since a :class:`~pyro.nn.PyroModule` would otherwise take the stale store values at its next call.
        """
        from ..posterior import _write_guide_params

        dtype = self.loc.dtype
        L = q.scale_tril().detach().to(dtype)
        diag = torch.diagonal(L).clone()
        _write_guide_params(self, {
            "loc": nn.Parameter(q.loc.detach().clone().to(dtype)),
            "scale": PyroParam(diag, self.scale_constraint),
            "scale_tril": PyroParam(L / diag[:, None], self.scale_tril_constraint),
        })

    @property
    def posterior(self):
        """The fitted :class:`~pyro_convexvb.GaussianPosterior` (after :meth:`fit`)."""
        if self.result is None:
            raise RuntimeError("call fit(...) first")
        return self.result.posterior
