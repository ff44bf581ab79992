"""Bernoulli-logit sites: the family, its super-Gaussian potential, its local bounds and its predictive
probabilities."""
import functools
import math

import pyro.distributions as dist
import torch

from ...errors import UnsupportedModelError
from .base import SiteFamily, _check_values, gauss_hermite
from .bound import LocalBound, WeightedBound, QuadraticBound, _entropy_terms, _kappas
from .potential import SuperGaussianPotential, WeightedPotential

__all__ = ["BernoulliLogit", "LogisticPotential", "LogitJensenBound", "LogitBohningBound", "LogitJaakkolaBound",
           "LogitTightBound", "LOGIT_BOUNDS", "logit_bound", "predictive_log_probs",
           "SPLIT_VAR", "ADAPTIVE_QUADRATURE_VAR"]

LOGIT_BOUNDS = ("tight", "jensen", "bohning", "jaakkola")


class _ExpectedSoftplus(torch.autograd.Function):
    """``E_{N(eta | mean, var)}[softplus(eta)]`` by Gauss-Hermite, with both derivatives from the same pass.

    ``d/dmean = E[sigmoid(eta)]`` and ``d/dvar = E[sigmoid'(eta)] / 2 = E[sigmoid(eta) x] / (2 sd)`` (Stein's
    lemma, ``eta = mean + sd x``): one evaluation of ``softplus`` and ``sigmoid`` on the ``(q, P)`` nodes, and
    a backward of ``O(q)`` instead of autograd's pass back through the nodes. Differentiable once (a
    second derivative raises).
    """

    @staticmethod
    def terms(mean, var, x, w):
        """``(E softplus, d/dmean, d/dvar)`` on the nodes ``x``, weights ``w`` (variances above
        :data:`SPLIT_VAR`: :func:`_split_softplus_terms`): the derivatives are those of the quadrature value
        itself."""
        sd = var.clamp_min(0).sqrt()
        eta = mean.unsqueeze(-1) + sd.unsqueeze(-1) * x
        sp = torch.nn.functional.softplus(eta)
        sig = torch.exp(eta - sp)  # sigmoid(eta), stable at both ends
        value = sp @ w
        d_mean = sig @ w
        # Stein: E[sigmoid'(eta)] = E[sigmoid(eta) x] / sd; at sd = 0 use sigmoid'(mean) directly
        s0 = torch.sigmoid(mean)
        d_var = torch.where(sd > 0, (sig @ (w * x)) / (2 * sd.clamp_min(1e-300)), 0.5 * s0 * (1 - s0))
        wide = var > SPLIT_VAR
        if bool(wide.any()):
            split = _split_softplus_terms(mean[wide], var[wide])
            value, d_mean, d_var = (t.index_put((wide,), u) for t, u in zip((value, d_mean, d_var), split))
        return value, d_mean, d_var

    @staticmethod
    def forward(ctx, mean, var, x, w):
        value, d_mean, d_var = _ExpectedSoftplus.terms(mean, var, x, w)
        ctx.save_for_backward(d_mean, d_var)
        return value

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        d_mean, d_var = ctx.saved_tensors
        return grad * d_mean, grad * d_var, None, None


class BernoulliLogit(SiteFamily):
    """``t_i(eta) = sigmoid(eta)^{y_i} sigmoid(-eta)^{1 - y_i}``, ``y_i in {0, 1}``.

    :param torch.Tensor y: ``(q,)`` labels in {0, 1}.
    """

    name = "bernoulli_logit"
    distributions = (dist.Bernoulli, torch.distributions.Bernoulli)
    pyro_form = "Bernoulli(logits=...)"

    def __init__(self, y):
        _check_values("y", y, lambda v: (v >= 0) & (v <= 1), "labels in {0, 1} (a rate in [0, 1] for binomial rows)")
        super().__init__(y=y)

    @property
    def y(self):
        return self.params["y"]

    def log_prob(self, eta):
        y = self.params["y"]
        return y * eta - torch.nn.functional.softplus(eta)

    def expected_log_prob(self, mean, var, num_points=64):
        """``E[y eta - softplus(eta)] = y mean - E[softplus(eta)]``, the expectation by Gauss-Hermite with
        derivatives from the same pass (:class:`_ExpectedSoftplus`; differentiable once)."""
        x, w = gauss_hermite(num_points, mean.dtype, mean.device)
        mean, var = torch.broadcast_tensors(mean, var)
        return self.params["y"] * mean - _ExpectedSoftplus.apply(mean, var, x, w)

    def expected_log_prob_terms(self, mean, var, num_points=32):
        """``E log p`` and its derivatives in ``mean`` and ``var``, the derivatives those of the quadrature value
        (:meth:`expected_log_prob` at the same ``num_points``) rather than quadratures of ``d log p`` and
        ``d2 log p`` (Price's theorem), which agree with it only as the quadrature's error vanishes: the exact-VG
        fixed point (``refine``) then lies at the maximum of the bound it reports, also for the wide site
        variances of a weakly determined fit, where the two quadratures part by 1e-4."""
        x, w = gauss_hermite(num_points, mean.dtype, mean.device)
        mean, var = torch.broadcast_tensors(mean, var)
        value, d_mean, d_var = _ExpectedSoftplus.terms(mean, var, x, w)
        y = self.params["y"]
        return y * mean - value, y - d_mean, -d_var

    def predictive_mean(self, mean, var, num_points=64):
        """``E[sigmoid(eta)]``, ``eta ~ N(mean, var)``: :func:`predictive_log_probs` (nodes centred at the
        integrand's mode for wide predictives)."""
        var = torch.as_tensor(var, dtype=mean.dtype, device=mean.device)
        return predictive_log_probs(mean, var, num_points)[1].exp()

    def super_gaussian(self):
        return LogisticPotential(self.params["y"])

    def local_bound(self, kind="tight", xi=None):
        y = self.params["y"]
        if not bool(((y == 0) | (y == 1)).all()):
            raise ValueError("y: Bernoulli-logit labels must be in {0, 1}")
        return logit_bound(self, kind, xi)

    @classmethod
    def predictor(cls, dist):
        return dist.logits if isinstance(dist, cls.distributions) else None

    @classmethod
    def from_site(cls, site, y):
        check_labels(site, y)
        return cls(y)


def predictive_log_probs(mean, var, num_points=64):
    """``log E[sigmoid(-eta)]`` and ``log E[sigmoid(eta)]`` for ``eta ~ N(mean, var)``, by Gauss-Hermite.

    The expectations are summed in log space (log-sum-exp over the nodes), so both stay accurate when one of them
    is tiny. For a predictive variance above :data:`SPLIT_VAR` plain nodes miss the soft step of the sigmoid
    (``log p`` off by 4e-3 to 2e-2 at a variance of 90, by 0.1 at 400); there the smaller probability splits the
    step off in closed form and integrates the smooth rest on panels (:func:`_split_log_sigmoid`; within 1e-12 of
    adaptive quadrature at any variance), and the larger one is its complement, ``log1p(-p)``.  Leading dimensions
    are kept (e.g. mixture components, which the caller averages with :func:`torch.logsumexp` minus ``log K``).

    :param torch.Tensor mean: ``(..., m)`` predictive means of the linear predictor.
    :param torch.Tensor var: ``(..., m)`` predictive variances (nonnegative).
    :param int num_points: Gauss-Hermite nodes.
    :returns: ``(log_p0, log_p1)``, each ``(..., m)``.

    Example::

        >>> import torch
        >>> lp0, lp1 = predictive_log_probs(torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64))
        >>> round(float(lp0.exp() + lp1.exp()), 12)
        1.0
    """
    mean, v = torch.broadcast_tensors(mean, var.clamp_min(0))
    x, w = gauss_hermite(num_points, mean.dtype, mean.device)
    eta = mean.unsqueeze(-1) + v.sqrt().unsqueeze(-1) * x
    lw = torch.log(w)
    logsig = torch.nn.functional.logsigmoid
    lp0, lp1 = torch.logsumexp(lw + logsig(-eta), -1), torch.logsumexp(lw + logsig(eta), -1)
    wide = v > SPLIT_VAR
    if bool(wide.any()):
        m, vw = mean[wide].double(), v[wide].double()
        first = m >= 0  # the smaller probability: P(y = 0) for a nonnegative mean
        small = _split_log_sigmoid(torch.where(first, -m, m), vw).clamp_max(math.log(0.5))
        large = torch.log1p(-torch.exp(small))
        lp0, lp1 = lp0.clone(), lp1.clone()
        lp0[wide] = torch.where(first, small, large).to(lp0.dtype)
        lp1[wide] = torch.where(first, large, small).to(lp1.dtype)
    return lp0.clamp_max(0.0), lp1.clamp_max(0.0)


#: variances above which the Gaussian integrals of the logistic function (:meth:`BernoulliLogit.expected_log_prob`,
#: :func:`predictive_log_probs`) split off its kink (``softplus``) or step (``sigmoid``) at 0 and integrate the
#: smooth rest on panels (:func:`_split_softplus_terms`, :func:`_split_log_sigmoid`): at a site sd of 10-30 the
#: step falls between Gauss-Hermite nodes (64 nodes: ``E log p`` off by 2e-3 at a variance of 100 and 7e-2 at
#: 1000; a class probability 0.50000 for 0.50399 at 2500)
SPLIT_VAR = 4.0
#: the former name of :data:`SPLIT_VAR`
ADAPTIVE_QUADRATURE_VAR = SPLIT_VAR
#: composite Gauss-Legendre rule of the split integrals on ``[0, SPLIT_RANGE]`` (``softplus(-t) < 5e-18`` beyond):
#: ``SPLIT_PANELS`` panels of ``SPLIT_NODES`` nodes, each panel short against the distance ``pi`` of the logistic
#: function's complex singularities from the real axis (a rule error below 1e-14 for sds from 2)
SPLIT_RANGE, SPLIT_PANELS, SPLIT_NODES = 40.0, 8, 16


@functools.lru_cache(maxsize=1)
def _split_rule_numpy():
    import numpy as np

    x, w = np.polynomial.legendre.leggauss(SPLIT_NODES)
    h = SPLIT_RANGE / SPLIT_PANELS
    return np.concatenate([h * (k + 0.5 * (x + 1.0)) for k in range(SPLIT_PANELS)]), np.tile(0.5 * h * w, SPLIT_PANELS)


def _split_rule(dtype, device):
    """Nodes ``t`` and weights ``W`` ``(SPLIT_PANELS * SPLIT_NODES,)`` of the composite rule on ``[0, SPLIT_RANGE]``
    (computed once, as :func:`~.base.gauss_hermite`'s nodes)."""
    t, w = _split_rule_numpy()
    return torch.as_tensor(t, dtype=dtype, device=device), torch.as_tensor(w, dtype=dtype, device=device)


def _split_softplus_terms(mean, var):
    r"""``(E softplus(eta), d/dmean, d/dvar)`` for ``eta ~ N(mean, var)``, ``var > 0``, ``(k,)`` each, by
    ``softplus(eta) = max(eta, 0) + softplus(-|eta|)``: the first in closed form
    (``m Phi(m/s) + s phi(m/s)``), the second, smooth on each side of 0 and bounded by ``log 2``, by the composite
    rule on ``|eta| = t`` against the Gaussian density at ``+-t``; the derivatives are those of this value (the
    rule's nodes do not move with ``mean`` and ``var``)."""
    t, W = _split_rule(mean.dtype, mean.device)
    sd = var.sqrt()
    z = mean / sd
    Phi, phi = torch.special.ndtr(z), torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    g = W * torch.nn.functional.softplus(-t)  # (P,)
    value, d_mean, d_var = mean * Phi + sd * phi, Phi, phi / (2 * sd)
    for eta in (t, -t):
        r = eta - mean.unsqueeze(-1)  # (k, P)
        dens = torch.exp(-0.5 * r * r / var.unsqueeze(-1)) / (sd.unsqueeze(-1) * math.sqrt(2 * math.pi))
        value = value + dens @ g
        d_mean = d_mean + (dens * r) @ g / var
        d_var = d_var + (dens * (r * r / var.unsqueeze(-1) - 1)) @ g / (2 * var)
    return value, d_mean, d_var


def _split_log_sigmoid(mean, var):
    r"""``log E[sigmoid(eta)]``, ``eta ~ N(mean, var)``, ``var > 0``, ``(k,)`` float64, in log space:
    ``E sigmoid = [Phi(m/s) - I_+] + I_-`` with ``I_+- = int_0^inf sigmoid(-t) N(+-t; m, var) dt`` by the
    composite rule (the step at 0 in closed form; ``sigmoid >= 1/2`` on ``eta > 0`` keeps ``Phi - I_+ >= Phi / 2``,
    so nothing cancels; beyond the rule's range ``sigmoid(-t) = e^{-t}`` in closed form), accurate for probabilities
    down to the float range of their logarithms."""
    t, W = _split_rule(mean.dtype, mean.device)
    sd = var.sqrt()
    logsig = torch.nn.functional.logsigmoid
    base = torch.log(W) + logsig(-t) - math.log(math.sqrt(2 * math.pi)) - torch.log(sd).unsqueeze(-1)

    def log_integral(m):
        """``log int_0^inf sigmoid(-t) N(t; m, var) dt``: the rule on ``[0, SPLIT_RANGE]``, and beyond it
        ``sigmoid(-t) = e^{-t}`` to a relative ``e^{-40}``, ``int_R^inf e^{-t} N(t; m, v) dt = e^{v/2 - m}
        Phi((m - v - R) / s)`` (a far Gaussian's tiny probabilities)."""
        tail = 0.5 * var - m + torch.special.log_ndtr((m - var - SPLIT_RANGE) / sd)
        rule = torch.logsumexp(base - 0.5 * (t - m.unsqueeze(-1)) ** 2 / var.unsqueeze(-1), -1)
        return torch.logaddexp(rule, tail)

    log_Phi = torch.special.log_ndtr(mean / sd)
    log_plus = log_Phi + torch.log1p(-torch.exp(log_integral(mean) - log_Phi))  # I_+
    return torch.logaddexp(log_plus, log_integral(-mean))  # I_-: N(-t; m, v) = N(t; -m, v)


def check_labels(site, y):
    """Refuse Bernoulli labels outside ``{0, 1}``, naming the site."""
    if not bool(((y == 0) | (y == 1)).all()):
        bad = y[(y != 0) & (y != 1)][:3].tolist()
        raise UnsupportedModelError(site, f"Bernoulli labels must be in {{0, 1}}, found {bad}")


def logit_bound(family, kind="tight", xi=None):
    """The Bernoulli-logit local bound ``kind`` (one of :data:`LOGIT_BOUNDS`) of ``family.params["y"]``; labels
    may be fractions in ``[0, 1]`` (every bound here stays valid: ``f`` is affine in ``y``)."""
    if kind == "tight":
        return LogitTightBound(family)
    if kind == "jensen":
        return LogitJensenBound(family)
    if kind == "bohning":
        return LogitBohningBound(family)
    if kind == "jaakkola":
        return LogitJaakkolaBound(family, xi)
    raise ValueError(f"bound: unknown Bernoulli-logit bound {kind!r}; choose one of {LOGIT_BOUNDS}")


# series of tanh(v)/v and (tanh(v)/v + tanh(v)^2 - 1)/v^2 at v = 0 (exact rational coefficients)
_TANH_OVER_V = (1.0, -1.0 / 3, 2.0 / 15, -17.0 / 315, 62.0 / 2835)
_F_SERIES = (2.0 / 3, -8.0 / 15, 34.0 / 105, -496.0 / 2835, 2764.0 / 31185)
_SMALL_V = 0.05


def _poly(coefs, w):
    out = torch.full_like(w, coefs[-1])
    for c in reversed(coefs[:-1]):
        out = out * w + c
    return out


class LogisticPotential(SuperGaussianPotential):
    r"""Bernoulli (logistic) sites ``t(s) = (1 + exp(-c tau s))^{-1}``, ``c in {-1, +1}`` (Nickisch & Seeger 2009, Eq. (3)).

    Appendix of Nickisch & Seeger 2009: ``beta = c tau / 2``, ``g(x) = -log cosh(v) - log 2`` with
    ``v = tau sqrt(x) / 2``, ``g'(x) = -C tanh(v)/v``, ``g''(x) = (C/2) x^{-1} (tanh(v)/v + tanh(v)^2 - 1)``,
    ``C = tau^2/8``, ``gamma_0 = 1/(2C)``, ``xi_0 = 3/(2C)``.  For ``v < 0.05`` the ratios are
    evaluated by their Taylor series (the direct formula cancels catastrophically at ``x ~ 0``).

    :param y: ``(q,)`` labels in ``{0, 1}`` (``c = 2 y - 1``).
    :param tau: scale ``tau`` (the LGM's ``BernoulliLogit`` has ``tau = 1``).

    Example::

        >>> import torch
        >>> pot = LogisticPotential(torch.tensor([1.0, 0.0], dtype=torch.float64))
        >>> pot.gamma0(), pot.xi0()
        (tensor([4., 4.], dtype=torch.float64), tensor([12., 12.], dtype=torch.float64))
    """

    name = "bernoulli_logit"

    def __init__(self, y, tau=1.0):
        c = 2 * y - 1
        self.tau = float(tau)
        self.C = self.tau**2 / 8
        super().__init__(0.5 * self.tau * c, torch.zeros_like(y))

    def _v(self, x):
        return 0.5 * self.tau * torch.sqrt(x)

    def g(self, x):
        v = self._v(x)
        return -(v + torch.log1p(torch.exp(-2 * v)))

    def dg(self, x):
        v = self._v(x)
        small = v < _SMALL_V
        vs = torch.where(small, torch.ones_like(v), v)
        ratio = torch.where(small, _poly(_TANH_OVER_V, v * v), torch.tanh(vs) / vs)
        return -self.C * ratio

    def d2g(self, x):
        v = self._v(x)
        small = v < _SMALL_V
        vs = torch.where(small, torch.ones_like(v), v)
        th = torch.tanh(vs)
        direct = (th / vs + th * th - 1) / (vs * vs)
        f = torch.where(small, _poly(_F_SERIES, v * v), direct)
        # g'' = (C/2) x^{-1} (...) = (C tau^2 / 8) f(v) with x = 4 v^2 / tau^2
        return (self.C * self.tau**2 / 8) * f

    def curv(self, x):
        # -(d^2/ds^2) g(s^2) = (tau^2/4) sech^2(v), written without overflow
        e = torch.exp(-2 * self._v(x))
        return (self.tau**2 / 4) * 4 * e / (1 + e) ** 2


class _LogitBound(LocalBound):
    """Bernoulli-logit bounds whose conjugate is ``H(kappa)``, ``kappa = alpha + y`` in ``(0, 1)``."""

    def __init__(self, family):
        super().__init__(family)
        self.y = family.params["y"]

    def psi(self, alpha):
        return _entropy_terms(*_kappas(alpha, self.y))

    def alpha_domain(self, like):
        return -self.y.to(like), 1 - self.y.to(like)


class LogitJensenBound(_LogitBound):
    """Bernoulli-logit "log" (Jensen) bound ``log(1 + e^{h + rho/2}) - y h``.

    ``docs/dual_vg.md``, § Fenchel conjugates of the local bounds, ``"jensen"`` row.

    The bound of the paper's Table 2 as reimplemented elsewhere: fastest, but loose, and its
    ``lambda = sigmoid(m + v/2)`` overstates the site precisions.
    """

    name = "jensen"

    def f(self, h, rho):
        return torch.nn.functional.softplus(h + 0.5 * rho) - self.y * h

    def ell(self, alpha):
        return alpha + self.y, torch.ones_like(alpha), torch.zeros_like(alpha)

    def alpha_star(self, h, rho):
        return torch.sigmoid(h + 0.5 * rho) - self.y


class LogitBohningBound(_LogitBound):
    """Böhning's bound with its centre optimised: ``log(1 + e^h) + rho / 8 - y h`` (``lambda = 1/4`` pinned)."""

    name = "bohning"

    def f(self, h, rho):
        return torch.nn.functional.softplus(h) + rho / 8 - self.y * h

    def ell(self, alpha):
        z = torch.zeros_like(alpha)
        return z + 0.25, z, z

    def alpha_star(self, h, rho):
        return torch.sigmoid(h) - self.y


class LogitJaakkolaBound(QuadraticBound):
    r"""Jaakkola-Jordan bound with fixed ``xi``: ``lambda_xi (h^2 + rho - xi^2) + (h - xi)/2 + log(1 + e^xi) - y h``.

    ``lambda_xi = tanh(xi/2) / (4 xi)``. With ``xi`` optimised the bound is not jointly convex
    (``docs/dual_vg.md``, § Primal variational-Gaussian problem), so ``xi`` stays fixed;
    ``xi=None`` sets ``xi_n = sqrt(h_n^2 + rho_n)`` at the prior marginals once (:meth:`set_xi`).
    """

    name = "jaakkola"

    def __init__(self, family, xi=None):
        super().__init__(family)
        self.y = family.params["y"]
        self.xi = None
        if xi is not None:
            self.set_xi(torch.as_tensor(xi, dtype=self.y.dtype, device=self.y.device).expand_as(self.y))

    def set_xi(self, xi):
        xi = xi.abs().clamp_min(1e-6)
        self.xi = xi
        lam_xi = torch.tanh(0.5 * xi) / (4 * xi)
        self._coef = (2 * lam_xi, self.y - 0.5,
                      -lam_xi * xi**2 - 0.5 * xi + torch.nn.functional.softplus(xi))

    def weighted(self, weight, family=None, log_const=None):
        return _WeightedJaakkolaBound(self, weight, family, log_const)

    def _abc(self):
        if self.xi is None:
            raise RuntimeError("jaakkola bound: xi is not set (call set_xi or pass xi=...)")
        return self._coef


def _tight_kappa(h, rho, iters=100):
    """``kappa*(h, rho) = argmax_k k h + k (1 - k) rho / 2 - H(k)`` by monotone Newton in ``z = logit(k)``.

    ``z*`` is the root of the increasing ``G(z) = z + rho sigmoid(z) - h - rho / 2`` (``G' = 1 + rho s (1 - s)``
    with ``s = sigmoid(z)``), which is convex for ``z < 0`` and concave for ``z > 0``. ``G(0) = -h``, so for
    ``h >= 0`` the root lies in the concave half, at or above ``max(0, h - rho/2)`` (where ``G <= 0``); Newton
    started there stays below the root and rises to it monotonically (a concave function lies below its
    tangents). For ``h < 0`` the mirror image holds from ``min(0, h + rho/2)`` in the convex half. No bracket
    or bisection safeguard is needed, and from these starts 16 steps reach rounding level for every
    ``|h|, rho`` in ``[1e-4, 1e12]`` (``tests/test_dual_vg.py``). The loop stops when ``|G|`` is within a few
    units in the last place of its terms.

    :param h: ``(N,)`` means of the site's linear predictor.
    :param rho: ``(N,)`` its variances (``>= 0``).
    :returns: ``(kappa, z)``, each ``(N,)``.
    """
    c = h + 0.5 * rho
    z = torch.where(h >= 0, (h - 0.5 * rho).clamp_min(0), c.clamp_max(0))
    tol = 4.5 * torch.finfo(z.dtype).eps
    for _ in range(iters):
        s = torch.sigmoid(z)
        rs = rho * s
        G = z + rs - c
        z = z - G / (1 + rs * (1 - s))
        if bool((G.abs() <= tol * (z.abs() + rs + c.abs())).all()):
            break
    return torch.sigmoid(z), z


class LogitTightBound(_LogitBound):
    r"""Default Bernoulli-logit bound: ``f(h, rho) = sup_k [k h + k (1 - k) rho / 2 - H(k)] - y h``.

    The conjugate is ``H(kappa)`` on ``{lambda <= kappa (1 - kappa)}``, ``kappa = alpha + y``: the
    site precision at the optimum, ``kappa (1 - kappa)``, is that of the tangent logistic at the
    optimal ``kappa``, exactly like the exact VG fixed point ``lambda = E[sigmoid']`` to second order.
    Convex (a supremum of affine functions), valid (see the module docstring) and tighter than
    the Jensen and Böhning bounds. ``f`` is evaluated by a 1-D safeguarded Newton solve.
    """

    name = "tight"

    def f(self, h, rho):
        # kappa* is detached: by the envelope theorem the first derivatives of f stay exact under autograd
        k, z = _tight_kappa(h.detach(), rho.detach())
        H = _entropy_terms(k)[0]
        return k * h + 0.5 * k * (1 - k) * rho - H - self.y * h

    def ell(self, alpha):
        k1, k0 = _kappas(alpha, self.y)
        return k1 * k0, k0 - k1, torch.full_like(alpha, -2.0)

    def alpha_star(self, h, rho):
        return _tight_kappa(h, rho)[0] - self.y


class _WeightedJaakkolaBound(WeightedBound, LogitJaakkolaBound):
    """:class:`WeightedBound` of a Jaakkola bound; ``xi`` belongs to the base bound (the tangent point of
    ``w f`` optimal for given marginals is that of ``f``), so the prior-marginal default applies unchanged."""

    @property
    def xi(self):
        return self.base.xi

    @xi.setter
    def xi(self, value):  # LogitJaakkolaBound's attribute; kept on the base bound
        if value is not None:
            self.base.set_xi(value)

    def set_xi(self, xi):
        self.base.set_xi(xi)


class CountLogit(SiteFamily):
    r"""Base of the count families whose log density is ``y eta - n softplus(eta) + c``: ``n`` copies of a
    Bernoulli-logit site of fractional label ``y / n``, times ``e^c`` (:class:`~pyro_convexvb.lgm.families.Binomial`:
    ``n`` trials; :class:`~pyro_convexvb.lgm.families.NegativeBinomial`: ``n = y + r``). Every engine question is the
    logit family's answer tempered by ``n``, with ``c`` kept in every bound. Subclasses give :meth:`_n` and
    :meth:`log_norm` (``c``)."""

    def _n(self):
        raise NotImplementedError

    def log_norm(self):
        raise NotImplementedError

    def _rate(self):
        """The Bernoulli-logit family of the fractional labels ``y / n`` (one row per site)."""
        return BernoulliLogit(self.params["y"] / self._n())

    def log_prob(self, eta):
        return self.params["y"] * eta - self._n() * torch.nn.functional.softplus(eta) + self.log_norm()

    def expected_log_prob(self, mean, var, num_points=64):
        return self._n() * self._rate().expected_log_prob(mean, var, num_points) + self.log_norm()

    def expected_log_prob_terms(self, mean, var, num_points=32):
        """``E log p`` and its derivatives in ``mean`` and ``var``: those of the logit sites' quadrature value
        (:meth:`BernoulliLogit.expected_log_prob_terms`, the split rule at wide variances), times ``n``, so that
        ``refine`` meets the maximum of the bound it reports (the generic quadratures of ``d log p`` parted from it
        by half at a site variance of 1,000)."""
        n = self._n()
        value, d_mean, d_var = self._rate().expected_log_prob_terms(mean, var, num_points)
        return n * value + self.log_norm(), n * d_mean, n * d_var

    def super_gaussian(self):
        return WeightedPotential(LogisticPotential(self.params["y"] / self._n()), self._n(), self.log_norm())

    def local_bound(self, kind="tight", xi=None):
        return logit_bound(self._rate(), kind, xi).weighted(self._n(), self, self.log_norm())
