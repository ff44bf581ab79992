r"""``DualState``: the immutable state of the ``dual_vg`` engine (Khan et al. 2013), in and out.

The dual variables ``alpha`` (one per observed site entry) determine the fit: ``lambda = ell(alpha)`` and
``q = N(m*, V*)`` (Khan et al. 2013, Eqs. 17-18) follow from them, so a fit resumes from ``alpha``.
"""
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .bounds import make_bound
from .sharding import sharded_design

__all__ = ["DualState"]


@dataclass(frozen=True)
class DualState:
    r"""The dual optimum of a ``dual_vg`` fit and the problem it belongs to.

    :ivar alpha: ``(N,)`` dual variables (Khan et al. 2013, Eq. 20), one per observed site entry.
    :ivar lam: ``(N,)`` site precisions ``lambda = ell(alpha)``.
    :ivar form: storage form of the dual: ``"site"`` (``N x N``), ``"latent"`` (``L x L``) or ``"banded"``.
    :ivar backend: the dual problem in that form (:mod:`~.objective`).
    :ivar local_bound: the local bound of the sites (:mod:`~.bounds`).
    :ivar bound: the Bernoulli-logit bound option (``"tight"``, ...) and :ivar xi: the Jaakkola parameters option.
    :ivar posterior: ``q(u) = N(m*, V*)`` over the latent vector of the fitted model.

    Example::

        >>> import torch, pyro_convexvb as pcv
        >>> from pyro_convexvb.lgm.sites import Poisson
        >>> X = torch.randn(30, 3, dtype=torch.float64)
        >>> y = torch.poisson(torch.exp(X @ torch.tensor([.3, -.2, .1], dtype=torch.float64)))
        >>> lgm = pcv.LatentGaussianModel.from_design(X, Poisson(y))
        >>> res = pcv.fit(lgm, engine="dual_vg", progress=False)
        >>> res.state.alpha.shape, res.state.form
        (torch.Size([30]), 'latent')
        >>> again = pcv.fit(lgm, engine="dual_vg", init=res.state, progress=False)
        >>> again.info["iterations"], abs(again.log_evidence_bound - res.log_evidence_bound) < 1e-9
        (0, True)
    """

    engine: ClassVar[str] = "dual_vg"
    #: the options a state replaces (an inner fit warm-started from a state resets them)
    options: ClassVar[tuple] = ("alpha0",)

    alpha: torch.Tensor
    lam: torch.Tensor = None
    form: str = ""
    backend: Any = None
    local_bound: Any = None
    bound: str = "tight"
    xi: Any = None
    posterior: Any = None

    def warm_start(self):
        """The state a fit of a nearby model (other hyperparameters) starts from: ``alpha`` (clipped into the
        new bound's domain by :func:`~.optim.solve_dual`)."""
        return DualState(self.alpha)

    def checked_alpha(self, num_sites, dtype, device, name="init.alpha"):
        """``alpha`` in ``dtype``/``device``; :raises ValueError: naming ``name`` unless it is a finite ``(N,)``."""
        alpha = torch.as_tensor(self.alpha, dtype=dtype, device=device)
        if alpha.shape != (num_sites,) or not bool(torch.isfinite(alpha).all()):
            raise ValueError(f"engine 'dual_vg': {name} must be a finite vector of one dual variable per observed "
                             f"site entry, shape ({num_sites},); got shape {tuple(alpha.shape)}"
                             + ("" if alpha.shape != (num_sites,) else " with non-finite entries"))
        return alpha

    def bound_at(self, lgm):
        r"""``ELBO_LVB(q*; theta)``: the local-bound ELBO of the fitted ``q*`` on ``lgm`` (the model at other
        hyperparameters ``theta``; Khan et al. 2013, §5, the type-II envelope), a 0-d tensor, differentiable in
        the params when ``lgm`` keeps their graph.

        :raises ValueError: for the ``"jaakkola"`` bound (its ``xi`` depend on ``theta``) and row-sharded data.
        """
        if self.bound == "jaakkola":
            raise ValueError("engine 'dual_vg': learn_params needs a local bound that does not depend on theta "
                             "through its variational parameters; the 'jaakkola' bound fixes xi at the prior "
                             "marginals -- use bound='tight', 'jensen' or 'bohning', or learn_params=False")
        if sharded_design(lgm.design())[1] is not None:
            raise ValueError("engine 'dual_vg': type-II learning of model parameters (learn_params) is not "
                             "available on row-sharded data; fit with learn_params=False")
        q = self.posterior
        m = q.loc.to(lgm.dtype)
        V = q.covariance().to(lgm.dtype)
        L = torch.linalg.cholesky(V)
        val = lgm.expected_log_prior(m, V) + torch.log(torch.diagonal(L)).sum() + \
            0.5 * lgm.n * (1 + math.log(2 * math.pi)) + lgm.log_const
        marginals = lgm.site_marginals(m, V)
        for g in lgm.sites:
            val = val - make_bound(g.family, self.bound, self.xi).f(*marginals[g.name]).sum()
        return val

    def site_predictive(self, K_cross, k_test_diag, prior_mean_test=0.0):
        r"""Latent predictive at test inputs of a site-form fit of a GP (identity design), without inverting ``K``.

        Mean ``mu_* - k_*^T alpha`` and variance ``k_** - ||R^{-1} Lambda^{1/2} k_*||^2`` with ``R`` the
        Cholesky factor of ``I + Lambda^{1/2} K Lambda^{1/2}`` (docs/dual_vg.md, § Algorithm and recovery).

        :param torch.Tensor K_cross: ``(m, N)`` test-train kernel matrix.
        :param torch.Tensor k_test_diag: ``(m,)`` prior variances at the test inputs.
        :param prior_mean_test: prior mean at the test inputs (number or ``(m,)``).
        :returns: ``(mean (m,), var (m,))``.
        :raises ValueError: unless the fit is in the ``N x N`` site form with an identity design.
        """
        if not self.gp_site_form:
            raise ValueError("site_predictive needs a dual_vg fit in the N x N site form with an identity design (a GP "
                             "over the training inputs)")
        R, s = self.backend.factor(self.lam)
        Z = torch.linalg.solve_triangular(R, s[:, None] * K_cross.transpose(0, 1), upper=False)
        return prior_mean_test - K_cross @ self.alpha, (k_test_diag - (Z * Z).sum(0)).clamp_min(0)

    @property
    def gp_site_form(self):
        """Whether the fit is in the ``N x N`` site form with an identity design (the latent is the sites)."""
        return self.form == "site" and self.backend is not None and self.backend.latent is None
