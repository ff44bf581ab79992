"""Student-t observation sites: the family and its super-Gaussian (not log-concave) potential.

Robust regression ``y ~ StudentT(nu, loc=eta, scale=b)`` is read from a Pyro site (predictor ``loc``; ``df`` and
``scale`` fixed, or hyper-latents integrated over as in ``docs/hyperparameters.md``). The site is super-Gaussian in
``s = eta - y`` (Nickisch & Seeger 2009, §2 and §2.3: ``h`` and ``h^*`` implicit), so ``convex_relaxation`` takes
it; it is not log-concave, so ``dual_vg`` has no convex local bound for it and refuses.
"""
import math

import pyro.distributions as dist
import torch

from ...errors import UnsupportedModelError
from .base import SiteFamily, gaussian_expectation, panel_expectation
from .potential import SuperGaussianPotential, _t

__all__ = ["StudentT", "StudentTPotential"]


class StudentT(SiteFamily):
    """``t_i(eta) = StudentT(y_i | df_i, loc=eta, scale=scale_i)``: robust regression.

    Read from an observed Pyro site ``StudentT(df, loc=..., scale)`` (the predictor is ``loc``) or built by hand in
    a :class:`~pyro_convexvb.SiteGroup`.  Its super-Gaussian form (``convex_relaxation`` engine) is
    :class:`StudentTPotential`, which is not log-concave (the relaxation warns with
    :class:`~pyro_convexvb.errors.NonConvexWarning`); ``dual_vg`` refuses it.

    :param torch.Tensor y: ``(q,)`` observations.
    :param df: degrees of freedom ``nu > 0``, number or ``(q,)``.
    :param scale: scales ``b > 0``, number or ``(q,)``.

    Example::

        >>> import torch
        >>> fam = StudentT(torch.zeros(2, dtype=torch.float64), 3.0, 1.0)
        >>> round(float(fam.log_prob(torch.zeros(2, dtype=torch.float64))[0]), 6)
        -1.000889
    """

    name = "student_t"
    log_concave = False
    distributions = (dist.StudentT, torch.distributions.StudentT)
    pyro_form = "StudentT(df, loc=..., scale)"
    no_bound = ("Student-t sites are not log-concave, so -E log p has no convex local bound (the dual of Khan et al. "
                "2013, Eq. 10 needs one); they are super-Gaussian sites of the relaxation (Nickisch & Seeger 2009, "
                "§2.3)")

    def __init__(self, y, df, scale):
        super().__init__(y=y, df=_t(df, y).expand_as(y).clone(), scale=_t(scale, y).expand_as(y).clone())

    def log_prob(self, eta):
        y, nu, b = self.params["y"], self.params["df"], self.params["scale"]
        return torch.distributions.StudentT(nu, y, b).log_prob(eta)

    def peaks(self):
        """``(q,)``: each site's density in ``eta`` peaks at its observation."""
        return self.params["y"]

    def expected_log_prob(self, mean, var, num_points=64):
        """``E log t`` under ``N(mean, var)``: Gauss-Hermite where the site sd is at most
        :data:`WIDE_SCALES` scales, else composite Gauss-Legendre panels around the density's core
        (:func:`~pyro_convexvb.lgm.families.base.panel_expectation`; plain Gauss-Hermite was 1e-2 off at 30 scales
        and 0.2 at 1,000, either sign)."""
        return self._expect(_log_t, mean, var, num_points)

    def expected_log_prob_terms(self, mean, var, num_points=32):
        """``E log t`` and its derivatives ``dE/dmean = E[d log t]``, ``dE/dvar = E[d2 log t] / 2`` (Bonnet, Price)
        by the quadrature of :meth:`expected_log_prob`, with the Student-t's closed-form derivatives."""
        n = max(num_points, 64)
        return (self._expect(_log_t, mean, var, n), self._expect(_d1_log_t, mean, var, n),
                0.5 * self._expect(_d2_log_t, mean, var, n))

    def _expect(self, fn, mean, var, num_points):
        """``E fn(params, eta)``: Gauss-Hermite, replaced by panels on the sites wider than :data:`WIDE_SCALES`."""
        p = {k: v.unsqueeze(-1) for k, v in self.params.items()}
        out = gaussian_expectation(lambda e: fn(p, e), mean, var, num_points)
        wide = var > (WIDE_SCALES * self.params["scale"]) ** 2
        if not bool(wide.any()):
            return out
        pw = {k: v[wide] for k, v in p.items()}
        width = (self.params["scale"] * self.params["df"].sqrt())[wide]
        got = panel_expectation(lambda e: fn(pw, e), mean[wide], var[wide], self.params["y"][wide], width)
        return out.masked_scatter(wide, got)

    def predictive_mean(self, mean, var, num_points=64):
        """``E[y] = E[eta]`` where it exists (``df > 1``); ``nan`` where ``df <= 1`` (no mean, as
        ``torch.distributions.StudentT.mean``)."""
        return torch.where(self.params["df"] > 1, mean, torch.full_like(mean, float("nan")))

    def super_gaussian(self):
        p = self.params
        return StudentTPotential(p["y"], p["df"], p["scale"])

    @classmethod
    def predictor(cls, d):
        return d.loc if isinstance(d, cls.distributions) else None

    @classmethod
    def fixed_params(cls, d):
        return {"df": (d.df, "Student-t degrees of freedom"), "scale": (d.scale, "Student-t scale")}

    @classmethod
    def from_site(cls, site, y, df, scale):
        for value, what in ((df, "degrees of freedom df"), (scale, "scale")):
            if not bool(torch.isfinite(value).all()) or not bool((value > 0).all()):
                raise UnsupportedModelError(site, f"the Student-t {what} must be positive and finite in every row")
        return cls(y, df, scale)


#: site sd, in Student-t scales, above which :meth:`StudentT.expected_log_prob` integrates on panels (64 Gauss-Hermite
#: nodes are within about 2e-11 of adaptive quadrature below it)
WIDE_SCALES = 1.5


def _log_t(p, eta):
    return torch.distributions.StudentT(p["df"], p["y"], p["scale"]).log_prob(eta)


def _d1_log_t(p, eta):
    r = eta - p["y"]
    return -(p["df"] + 1) * r / (p["df"] * p["scale"] ** 2 + r**2)


def _d2_log_t(p, eta):
    r2 = (eta - p["y"]) ** 2
    c = p["df"] * p["scale"] ** 2
    return -(p["df"] + 1) * (c - r2) / (c + r2) ** 2


class StudentTPotential(SuperGaussianPotential):
    r"""Student-t observations ``t(eta) = St(y | eta, b, nu)``, super-Gaussian in ``s = eta - y``.

    ``log t = kappa + g(s^2)``, ``g(x) = -(nu+1)/2 log(1 + x/(nu b^2))``,
    ``kappa = log Gamma((nu+1)/2) - log Gamma(nu/2) - log(sqrt(nu pi) b)``.  ``g`` is convex and
    decreasing, but ``s -> log t`` is not concave (for ``s^2 > nu b^2``): by Nickisch & Seeger 2009 Theorem 2 the
    relaxation is not convex, so using it warns with :class:`~pyro_convexvb.errors.NonConvexWarning`.

    :param y: ``(q,)`` observations.
    :param df: degrees of freedom ``nu > 0`` (number or ``(q,)``).
    :param scale: ``b > 0`` (number or ``(q,)``).
    """

    name = "student_t"
    log_concave = False

    def __init__(self, y, df, scale):
        self.df = _t(df, y).expand_as(y)
        self.scale = _t(scale, y).expand_as(y)
        nu, b = self.df, self.scale
        kappa = torch.lgamma((nu + 1) / 2) - torch.lgamma(nu / 2) - 0.5 * torch.log(nu * math.pi) - torch.log(b)
        super().__init__(torch.zeros_like(y), kappa, shift=y)

    def g(self, x):
        nu, b = self.df, self.scale
        return -0.5 * (nu + 1) * torch.log1p(x / (nu * b * b))

    def dg(self, x):
        nu, b = self.df, self.scale
        return -0.5 * (nu + 1) / (nu * b * b + x)

    def d2g(self, x):
        nu, b = self.df, self.scale
        return 0.5 * (nu + 1) / (nu * b * b + x) ** 2

    def curv(self, x):
        nu, b = self.df, self.scale
        a = nu * b * b
        return (nu + 1) * (a - x) / (a + x) ** 2
