"""Per-row site families t_i(s_i) of a latent Gaussian model.

A site family holds the per-row data (labels, counts, observations) and parameters of one
group of sites and evaluates, vectorised over the rows,

* ``log_prob(eta)``: ``log t_i(eta_i)`` with every normalising constant of the Pyro
  distribution it came from (so bounds are bounds on ``log p(y)`` of the model as written);
* ``expected_log_prob(mean, var)``: ``E_{N(eta | mean, var)}[log t_i(eta)]`` in closed form where
  one exists, else by Gauss-Hermite quadrature;
* ``predictive_mean(mean, var)``: the predictive mean of the observation under a Gaussian
  marginal of the predictor (e.g. ``P(y = 1)`` for Bernoulli sites).

Engines add their own bound machinery (local variational bounds, super-Gaussian
representations) keyed on ``family.name``.
"""
import math

import numpy as np
import torch

__all__ = [
    "SiteFamily",
    "BernoulliLogit",
    "BernoulliProbit",
    "Poisson",
    "Gaussian",
    "Laplace",
    "StudentT",
    "StochasticVolatility",
    "Weighted",
    "tempered",
    "gauss_hermite",
    "gaussian_expectation",
]

_GH_CACHE = {}


def gauss_hermite(num_points, dtype=torch.float64, device=None):
    """Nodes ``x`` and weights ``w`` with ``E_{N(0,1)}[f] ~= sum_k w_k f(x_k)`` (probabilists' rule)."""
    key = num_points
    if key not in _GH_CACHE:
        x, w = np.polynomial.hermite_e.hermegauss(num_points)
        _GH_CACHE[key] = (x, w / math.sqrt(2 * math.pi))
    x, w = _GH_CACHE[key]
    return torch.as_tensor(x, dtype=dtype, device=device), torch.as_tensor(w, dtype=dtype, device=device)


def gaussian_expectation(fn, mean, var, num_points=64):
    """``E_{N(eta | mean, var)}[fn(eta)]`` elementwise by Gauss-Hermite quadrature.

    :param fn: elementwise function; receives ``eta`` of shape ``mean.shape + (num_points,)``.
    :param torch.Tensor mean: ``(q,)``.
    :param torch.Tensor var: ``(q,)``, nonnegative.
    :returns: ``(q,)``.
    """
    x, w = gauss_hermite(num_points, mean.dtype, mean.device)
    eta = mean.unsqueeze(-1) + var.clamp_min(0).sqrt().unsqueeze(-1) * x
    return (fn(eta) * w).sum(-1)


def _normal_abs_moment(mean, var):
    """``E|eta|`` for ``eta ~ N(mean, var)``."""
    sd = var.clamp_min(1e-300).sqrt()
    z = mean / sd
    return sd * math.sqrt(2 / math.pi) * torch.exp(-0.5 * z * z) + mean * torch.erf(z / math.sqrt(2))


class SiteFamily:
    """Base class of a vectorised group of sites ``t_i(eta_i)``."""

    name = "base"
    log_concave = True

    def __init__(self, **params):
        self.params = params

    def __len__(self):
        return int(next(iter(self.params.values())).shape[0])

    def log_prob(self, eta):
        raise NotImplementedError

    def expected_log_prob(self, mean, var, num_points=64):
        return gaussian_expectation(lambda e: self._broadcast_log_prob(e), mean, var, num_points)

    def _broadcast_log_prob(self, eta):
        # eta: (q, K); parameters are (q,) -> add a trailing axis
        saved = self.params
        self.params = {k: (v.unsqueeze(-1) if torch.is_tensor(v) and v.dim() == 1 else v) for k, v in saved.items()}
        try:
            return self.log_prob(eta)
        finally:
            self.params = saved

    def predictive_mean(self, mean, var, num_points=64):
        raise NotImplementedError

    def subset(self, index):
        """The same family restricted to rows ``index``."""
        return type(self)(**{k: (v[index] if torch.is_tensor(v) and v.dim() >= 1 else v) for k, v in self.params.items()})

    def to(self, dtype=None, device=None):
        return type(self)(
            **{k: (v.to(dtype=dtype, device=device) if torch.is_tensor(v) and v.is_floating_point() else v)
               for k, v in self.params.items()}
        )

    def __repr__(self):
        return f"{type(self).__name__}(rows={len(self)})"


class _ExpectedSoftplus(torch.autograd.Function):
    """``E_{N(eta | mean, var)}[softplus(eta)]`` by Gauss-Hermite, with both derivatives from the same pass.

    ``d/dmean = E[sigmoid(eta)]`` and ``d/dvar = E[sigmoid'(eta)] / 2 = E[sigmoid(eta) x] / (2 sd)`` (Stein's
    lemma, ``eta = mean + sd x``): one evaluation of ``softplus`` and ``sigmoid`` on the ``(q, P)`` nodes, and
    a backward of ``O(q)`` instead of autograd's pass back through the nodes. Differentiable once (a
    second derivative raises).
    """

    @staticmethod
    def forward(ctx, mean, var, x, w):
        sd = var.clamp_min(0).sqrt()
        eta = mean.unsqueeze(-1) + sd.unsqueeze(-1) * x
        sp = torch.nn.functional.softplus(eta)
        sig = torch.exp(eta - sp)  # sigmoid(eta), stable at both ends
        value = sp @ w
        d_mean = sig @ w
        # Stein: E[sigmoid'(eta)] = E[sigmoid(eta) x] / sd; at sd = 0 use sigmoid'(mean) directly
        s0 = torch.sigmoid(mean)
        d_var = torch.where(sd > 0, (sig @ (w * x)) / (2 * sd.clamp_min(1e-300)), 0.5 * s0 * (1 - s0))
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

    def __init__(self, y):
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

    def predictive_mean(self, mean, var, num_points=64):
        return gaussian_expectation(torch.sigmoid, mean, var, num_points)


class BernoulliProbit(SiteFamily):
    """``t_i(eta) = Phi(eta)^{y_i} Phi(-eta)^{1 - y_i}``, ``y_i in {0, 1}``.

    ``log_prob`` is ``log_ndtr(c eta)`` with ``c = 2 y - 1``, accurate in both tails.
    ``expected_log_prob(mean, var)`` is ``E_{N(eta | mean, var)} log Phi(c eta)``: Gauss-Hermite with
    ``num_points`` nodes where ``var <= 1`` (the integrand varies on the scale of the spread there),
    and otherwise a composite Gauss-Legendre rule in the standardised variable ``e = (eta - mean) / sd``
    on ``|e| <= 12``, with unit panels and panels graded geometrically (ratio 2.5) away from the point
    ``c eta = 0`` where ``log Phi`` turns from quadratic to flat; 12 nodes per panel. With the default
    ``num_points`` both agree with adaptive 20-digit quadrature to about 1e-15 relative for
    ``|mean| <= 40``, ``var <= 1e6`` (``tests/test_probit.py``; 64-point Gauss-Hermite alone is off by
    3e-3 nats at ``var = 100``). The panel ends are held fixed under autograd, so gradients are those
    of the same rule applied to the derivative.

    :param torch.Tensor y: ``(q,)`` labels in {0, 1}.

    Example::

        >>> import torch
        >>> fam = BernoulliProbit(torch.tensor([1.], dtype=torch.float64))
        >>> m, v = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
        >>> round(float(fam.expected_log_prob(m, v)), 12)  # E log Phi(eta), eta ~ N(0, 1), is exactly -1
        -1.0
    """

    name = "bernoulli_probit"
    _GL_CACHE = {}
    _PANEL_NODES = 12
    _HALF_WIDTH = 12.0
    _GRADING = 2.5
    _CHUNK = 2048

    def __init__(self, y):
        super().__init__(y=y)

    def log_prob(self, eta):
        c = 2 * self.params["y"] - 1
        return torch.special.log_ndtr(c * eta)

    def expected_log_prob(self, mean, var, num_points=64):
        c = 2 * self.params["y"] - 1
        m = c * mean
        sd = var.clamp_min(0).sqrt()
        out = gaussian_expectation(torch.special.log_ndtr, m, var.clamp_min(0), num_points)
        wide = torch.nonzero(sd.detach() > 1.0).reshape(-1)
        if wide.numel() == 0:
            return out
        parts = [self._composite(m[idx], sd[idx]) for idx in wide.split(self._CHUNK)]
        return out.index_put((wide,), torch.cat(parts))

    @classmethod
    def _composite(cls, m, sd):
        """``E log Phi(m + sd e)``, ``e ~ N(0, 1)``, by the graded composite Gauss-Legendre rule (``sd > 0``)."""
        dtype, device = m.dtype, m.device
        n = cls._PANEL_NODES
        if n not in cls._GL_CACHE:
            cls._GL_CACHE[n] = np.polynomial.legendre.leggauss(n)
        xg, wg = (torch.as_tensor(a, dtype=dtype, device=device) for a in cls._GL_CACHE[n])
        E, ratio = cls._HALF_WIDTH, cls._GRADING
        s_det = sd.detach()
        # panel ends at e0 +- 0.5 * 2.5^j / sd (e0: where c eta = 0), out to beyond |e| = 2E for the widest site
        k = max(1, math.ceil(math.log(4 * E * float(s_det.max())) / math.log(ratio)) + 1)
        grade = 0.5 * ratio ** torch.arange(k + 1, dtype=dtype, device=device)
        uniform = torch.linspace(-E, E, int(2 * E) + 1, dtype=dtype, device=device)
        e0 = (-m.detach() / s_det)[:, None]
        ends = torch.cat([uniform.expand(m.shape[0], -1), e0, e0 + grade / s_det[:, None],
                          e0 - grade / s_det[:, None]], 1).clamp(-E, E)
        ends = torch.sort(ends, 1).values
        half = 0.5 * (ends[:, 1:] - ends[:, :-1])
        e = (0.5 * (ends[:, 1:] + ends[:, :-1]))[..., None] + half[..., None] * xg
        w = half[..., None] * wg * torch.exp(-0.5 * e * e) / math.sqrt(2 * math.pi)
        return (w * torch.special.log_ndtr(m[:, None, None] + sd[:, None, None] * e)).sum((-1, -2))

    def predictive_mean(self, mean, var, num_points=64):
        return torch.special.ndtr(mean / torch.sqrt(1 + var))


class Poisson(SiteFamily):
    """``t_i(eta) = Poisson(y_i | exp(eta))``, counts ``y_i >= 0``."""

    name = "poisson"

    def __init__(self, y):
        super().__init__(y=y)

    def log_prob(self, eta):
        y = self.params["y"]
        return y * eta - torch.exp(eta) - torch.lgamma(y + 1)

    def expected_log_prob(self, mean, var, num_points=64):
        y = self.params["y"]
        return y * mean - torch.exp(mean + 0.5 * var) - torch.lgamma(y + 1)

    def predictive_mean(self, mean, var, num_points=64):
        return torch.exp(mean + 0.5 * var)


class Gaussian(SiteFamily):
    """``t_i(eta) = N(y_i | eta, scale_i^2)`` (the Gaussian part of the model).

    :param torch.Tensor y: ``(q,)`` observations.
    :param torch.Tensor scale: ``(q,)`` noise standard deviations (fixed).
    """

    name = "gaussian"

    def __init__(self, y, scale):
        super().__init__(y=y, scale=scale)

    def log_prob(self, eta):
        y, s = self.params["y"], self.params["scale"]
        return -0.5 * ((y - eta) / s) ** 2 - torch.log(s) - 0.5 * math.log(2 * math.pi)

    def expected_log_prob(self, mean, var, num_points=64):
        y, s = self.params["y"], self.params["scale"]
        return -0.5 * ((y - mean) ** 2 + var) / s**2 - torch.log(s) - 0.5 * math.log(2 * math.pi)

    def predictive_mean(self, mean, var, num_points=64):
        return mean


class Laplace(SiteFamily):
    """``t_i(eta) = exp(-|eta| / scale_i) / (2 scale_i)`` (a sparsity potential; a location goes in the offset).

    In Nickisch & Seeger's (2009) notation (Eq. 2) ``tau_i / sigma = 1 / scale_i``.
    """

    name = "laplace"

    def __init__(self, scale):
        super().__init__(scale=scale)

    def log_prob(self, eta):
        b = self.params["scale"]
        return -eta.abs() / b - torch.log(2 * b)

    def expected_log_prob(self, mean, var, num_points=64):
        b = self.params["scale"]
        return -_normal_abs_moment(mean, var) / b - torch.log(2 * b)

    def predictive_mean(self, mean, var, num_points=64):
        return mean


def _param(value, like):
    """``value`` (number or ``(q,)``) as a ``(q,)`` tensor of ``like``'s dtype and device."""
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).expand_as(like).clone()


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

    def __init__(self, y, df, scale):
        super().__init__(y=y, df=_param(df, y), scale=_param(scale, y))

    def log_prob(self, eta):
        y, nu, b = self.params["y"], self.params["df"], self.params["scale"]
        return torch.distributions.StudentT(nu, y, b).log_prob(eta)

    def predictive_mean(self, mean, var, num_points=64):
        return mean


class StochasticVolatility(SiteFamily):
    """Stochastic-volatility sites ``t_n(eta) = N(y_n | 0, e^{eta})`` (Khan et al. 2013, §5).

    :param torch.Tensor y: ``(q,)`` observations (exact zeros are replaced by ``zero_jitter``,
        since ``log(1/y^2)`` enters the conjugate of its local bound).
    :param float zero_jitter: the magnitude that replaces ``|y_n| < zero_jitter``.
    :raises ValueError: if ``y`` contains NaN or inf.

    Example::

        >>> import torch
        >>> fam = StochasticVolatility(torch.tensor([0.3, -1.2], dtype=torch.float64))
        >>> fam.expected_log_prob(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)).shape
        torch.Size([2])
    """

    name = "stochastic_volatility"

    def __init__(self, y, zero_jitter=1e-8):
        y = torch.as_tensor(y)
        if not torch.isfinite(y).all():
            raise ValueError("y: stochastic-volatility observations contain NaN or inf")
        y = torch.where(y.abs() < zero_jitter, torch.full_like(y, zero_jitter), y)
        super().__init__(y=y)

    def log_prob(self, eta):
        y = self.params["y"]
        return -0.5 * math.log(2 * math.pi) - 0.5 * eta - 0.5 * y**2 * torch.exp(-eta)

    def expected_log_prob(self, mean, var, num_points=64):
        y = self.params["y"]
        return -0.5 * math.log(2 * math.pi) - 0.5 * mean - 0.5 * y**2 * torch.exp(-mean + 0.5 * var)

    def predictive_mean(self, mean, var, num_points=64):
        """Mean of ``y`` (zero); the predictive variance of ``y`` is ``exp(mean + var / 2)``."""
        return torch.zeros_like(mean)


class Weighted(SiteFamily):
    r"""Tempered sites ``t_i(eta)^{w_i}`` of a base family, per-row weights ``w_i > 0``.

    A Pyro likelihood site under ``poutine.scale(scale=w)`` contributes ``w log t(eta)`` to the log
    joint; this family evaluates exactly that (``log_prob`` and ``expected_log_prob`` are the base
    family's times ``w``; ``predictive_mean`` is the base family's). Its ``name`` is
    ``"weighted_" + base.name``, so an engine whose site terms do not take weights does not mistake it
    for the base family: it refuses the site instead.

    :param SiteFamily base: the unweighted family (holds the data).
    :param torch.Tensor weight: ``(q,)`` positive weights.
    :raises ValueError: for weights that are not positive and finite or of the wrong length.

    Example::

        >>> import torch
        >>> fam = Weighted(BernoulliLogit(torch.tensor([1., 0.], dtype=torch.float64)),
        ...                torch.tensor([2., 0.5], dtype=torch.float64))
        >>> fam.name
        'weighted_bernoulli_logit'
        >>> eta = torch.tensor([0.3, -1.0], dtype=torch.float64)
        >>> bool(torch.allclose(fam.log_prob(eta), fam.weight * fam.base.log_prob(eta)))
        True
    """

    def __init__(self, base, weight):
        weight = torch.as_tensor(weight)
        if weight.dim() != 1 or weight.shape[0] != len(base):
            raise ValueError(f"weight: expected shape ({len(base)},), got {tuple(weight.shape)}")
        if not bool(torch.isfinite(weight).all()) or not bool((weight > 0).all()):
            raise ValueError("weight: site weights must be positive and finite")
        self.base = base
        self.params = {"weight": weight}
        self.name = "weighted_" + base.name
        self.log_concave = base.log_concave

    @property
    def weight(self):
        return self.params["weight"]

    def __len__(self):
        return len(self.base)

    def log_prob(self, eta):
        w = self.weight if eta.dim() == 1 else self.weight.unsqueeze(-1)
        return w * self.base.log_prob(eta)

    def _broadcast_log_prob(self, eta):
        return self.weight.unsqueeze(-1) * self.base._broadcast_log_prob(eta)

    def expected_log_prob(self, mean, var, num_points=64):
        return self.weight * self.base.expected_log_prob(mean, var, num_points)

    def predictive_mean(self, mean, var, num_points=64):
        return self.base.predictive_mean(mean, var, num_points)

    def subset(self, index):
        return Weighted(self.base.subset(index), self.weight[index])

    def to(self, dtype=None, device=None):
        return Weighted(self.base.to(dtype=dtype, device=device), self.weight.to(dtype=dtype, device=device))

    def __repr__(self):
        return f"Weighted({self.base!r})"


def tempered(family, weight):
    r"""``(family', log_const)`` with ``prod_i t_i(eta_i)^{w_i} = exp(log_const) prod_i t'_i(eta_i)`` exactly.

    Gaussian sites stay Gaussian: ``N(y | eta, s^2)^w = N(y | eta, s^2 / w)`` times the constant
    ``-(w - 1) log s - log(w) / 2 - (w - 1) log(2 pi) / 2``, so every engine fits them unchanged.
    Other families become :class:`Weighted`. Rows of weight one need nothing: with all weights equal
    to one the family is returned as it is.

    :param SiteFamily family: the unweighted family.
    :param torch.Tensor weight: ``(q,)`` positive weights.
    :returns: ``(SiteFamily, float)``.

    Example::

        >>> import torch
        >>> fam, c = tempered(Gaussian(torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)),
        ...                   torch.tensor([4.0], dtype=torch.float64))
        >>> float(fam.params["scale"][0]), round(c, 6)
        (0.5, -3.449963)
    """
    weight = torch.as_tensor(weight, dtype=next(iter(family.params.values())).dtype)
    if bool((weight == 1).all()):
        return family, 0.0
    if isinstance(family, Gaussian):
        y, s = family.params["y"], family.params["scale"]
        if not bool(torch.isfinite(weight).all()) or not bool((weight > 0).all()):
            raise ValueError("weight: site weights must be positive and finite")
        const = -(weight - 1) * torch.log(s) - 0.5 * torch.log(weight) - 0.5 * (weight - 1) * math.log(2 * math.pi)
        return Gaussian(y, s / weight.sqrt()), float(const.sum())
    return Weighted(family, weight), 0.0
