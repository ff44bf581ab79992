"""The immutable state in and out of the ``dual_vg`` engine: its dual variables and problem (Khan et al. 2013)."""
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .bounds import make_bound
from .sharding import sharded_design

__all__ = ["DualState"]


@dataclass(frozen=True)
class DualState:
    r"""The dual optimum of a ``dual_vg`` fit: ``alpha`` determines ``lambda`` and ``q`` (Khan et al. 2013, Eqs.
    17-18), so ``pcv.fit(..., init=state)`` resumes from it.

    :ivar alpha: ``(N,)`` dual variables (Eq. 20); :ivar lam: ``(N,)`` site precisions ``ell(alpha)``.
    :ivar form: ``"site"`` (``N x N``), ``"latent"`` (``L x L``) or ``"banded"``; :ivar backend: the dual problem
        in that form (:mod:`~.objective`); :ivar bound: and
        :ivar xi: the ``bound`` and ``xi`` options; :ivar posterior: ``q(u) = N(m*, V*)`` of the fitted model.

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
    bound: str = "tight"
    xi: Any = None
    posterior: Any = None

    def warm_start(self):
        """``alpha`` alone, for a fit of a nearby model (clipped into its domain by :func:`~.optim.solve_dual`)."""
        return DualState(self.alpha)

    def bound_at(self, lgm):
        r"""``ELBO_LVB(q*; theta)`` of the fitted ``q*`` on ``lgm`` (the model at other hyperparameters; Khan et al.
        2013, §5: the type-II envelope), a 0-d tensor carrying ``lgm``'s graph; refused for ``bound='jaakkola'``
        (its ``xi`` depend on ``theta``) and row-sharded data."""
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
        r"""Latent predictive ``(mean (m,), var (m,))`` at test inputs of a site-form GP fit (identity design),
        without inverting ``K``: ``mu_* - k_*^T alpha`` and ``k_** - ||R^{-1} Lambda^{1/2} k_*||^2``,
        ``R R^T = I + Lambda^{1/2} K Lambda^{1/2}`` (docs/dual_vg.md, § Algorithm and recovery);
        ``K_cross`` ``(m, N)``, ``k_test_diag`` ``(m,)``."""
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
