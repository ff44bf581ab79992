"""Student-t observation sites: the family and its super-Gaussian (not log-concave) potential."""
import math

import torch

from .base import SiteFamily
from .potential import SuperGaussianPotential, _t

__all__ = ["StudentT", "StudentTPotential"]


class StudentT(SiteFamily):
    """``t_i(eta) = StudentT(y_i | eta, scale_i, df_i)`` for explicit latent Gaussian models.

    Not produced by the Pyro extractor; build a :class:`~pyro_convexvb.SiteGroup` with it.  Its
    super-Gaussian form (``convex_relaxation`` engine) is
    :class:`~pyro_convexvb.infer.convex_relaxation.StudentTPotential`, which is not log-concave.

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
    no_bound = "Student-t sites are not log-concave, so -E log p has no convex local bound"

    def __init__(self, y, df, scale):
        super().__init__(y=y, df=_t(df, y).expand_as(y).clone(), scale=_t(scale, y).expand_as(y).clone())

    def log_prob(self, eta):
        y, nu, b = self.params["y"], self.params["df"], self.params["scale"]
        return torch.distributions.StudentT(nu, y, b).log_prob(eta)

    def predictive_mean(self, mean, var, num_points=64):
        return mean

    def super_gaussian(self):
        p = self.params
        return StudentTPotential(p["y"], p["df"], p["scale"])


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
