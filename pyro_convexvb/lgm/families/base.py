"""The site-family protocol, quadrature helpers and weighted (tempered) sites.

A site family holds the per-row data (labels, counts, observations) and parameters of one group of
sites ``t_i(eta_i)`` and answers every engine's question about them (see :class:`SiteFamily`).
"""
import math

import numpy as np
import torch

from ...errors import UnsupportedModelError
from .potential import WeightedPotential, check_weight

__all__ = ["SiteFamily", "Weighted", "tempered", "gauss_hermite", "gaussian_expectation", "panel_expectation",
           "normal_panels"]

_GH_CACHE = {}


def gauss_hermite(num_points, dtype=torch.float64, device=None):
    """Nodes ``x`` and weights ``w`` with ``E_{N(0,1)}[f] ~= sum_k w_k f(x_k)`` (probabilists' rule)."""
    key = num_points
    if key not in _GH_CACHE:
        x, w = np.polynomial.hermite_e.hermegauss(num_points)
        _GH_CACHE[key] = (x, w / math.sqrt(2 * math.pi))
    x, w = _GH_CACHE[key]
    return torch.as_tensor(x, dtype=dtype, device=device), torch.as_tensor(w, dtype=dtype, device=device)


def _check_values(name, value, ok, what):
    """Refuse data outside a family's support (a hand-built family skips the extraction's checks): labels {1, 2}
    were fitted as a likelihood that is no Bernoulli's, negative counts failed deep in an engine."""
    if torch.is_tensor(value) and value.numel() and not bool(ok(value).all()):
        bad = value[~ok(value)][:3].tolist()
        raise ValueError(f"{name}: expected {what}, got {bad}")


#: Gauss-Legendre nodes per panel of :func:`panel_expectation`
PANEL_NODES = 16
_GL_CACHE = {}


def normal_panels(cuts, nodes):
    """Nodes ``t`` and weights of ``E_{N(0, 1)}[f(t)] ~= sum_k w_k f(t_k)`` on ``[cuts_0, cuts_-1]`` by composite
    Gauss-Legendre quadrature: ``nodes`` per panel between consecutive sorted ``cuts`` ``(..., C)``, each weight
    times the standard normal density. Differentiable in ``cuts``.

    :returns: ``(t, w)``, each ``(..., (C - 1) nodes)``.
    """
    if nodes not in _GL_CACHE:
        _GL_CACHE[nodes] = np.polynomial.legendre.leggauss(nodes)
    x, w = (torch.as_tensor(a, dtype=cuts.dtype, device=cuts.device) for a in _GL_CACHE[nodes])
    lo, hi = cuts[..., :-1], cuts[..., 1:]
    t = (lo[..., None] + (hi - lo)[..., None] * (x + 1) / 2).flatten(-2)
    wt = ((hi - lo)[..., None] / 2 * w).flatten(-2) * torch.exp(-0.5 * t ** 2) / math.sqrt(2 * math.pi)
    return t, wt


def panel_expectation(fn, mean, var, center, width, num_sd=12.0):
    """``E_{N(eta | mean, var)}[fn(eta)]`` elementwise by composite Gauss-Legendre quadrature, for a ``fn`` smooth
    except for a feature of scale ``width`` around ``center`` (a Student-t's core) that a wide Gaussian's
    Gauss-Hermite nodes step over (64 nodes at a site sd of 30 scales: 1e-2 off, either sign).

    In ``t = (eta - mean) / sd`` on ``[-num_sd, num_sd]`` the panels end at every unit of ``t`` (the Gaussian) and at
    ``center +- width 2^k`` (``k = -3 .. 40``, the feature and the logarithmic growth around it), each with
    :data:`PANEL_NODES` nodes. Differentiable in ``mean`` and ``var`` (through the nodes).

    :param fn: elementwise function of ``eta`` ``(q, K)`` (the parameters broadcast over the last axis).
    :param torch.Tensor mean: ``(q,)``; ``var``: ``(q,)`` positive; ``center``, ``width``: ``(q,)``.
    :returns: ``(q,)``.
    """
    sd = var.clamp_min(1e-300).sqrt()
    t0 = ((center - mean) / sd).unsqueeze(-1)
    rel = (width / sd).unsqueeze(-1) * torch.as_tensor(2.0 ** np.arange(-3, 41), dtype=mean.dtype, device=mean.device)
    grid = torch.arange(-int(num_sd), int(num_sd) + 1, dtype=mean.dtype, device=mean.device).expand(mean.shape[0], -1)
    cuts = torch.cat([grid, t0 - rel, t0, t0 + rel], -1).clamp(-num_sd, num_sd)
    t, wt = normal_panels(torch.sort(cuts, -1).values, PANEL_NODES)  # (q, P * nodes)
    return (fn(mean.unsqueeze(-1) + sd.unsqueeze(-1) * t) * wt).sum(-1)


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


class SiteFamily:
    """Base class of a vectorised group of sites ``t_i(eta_i)``: the one object every engine asks about them.

    * ``log_prob(eta)``: ``log t_i(eta_i)`` with every normalising constant of the Pyro distribution it came from
      (so bounds are bounds on ``log p(y)`` of the model as written);
    * ``expected_log_prob(mean, var)``: ``E_{N(eta | mean, var)}[log t_i(eta)]`` in closed form where one exists,
      else by Gauss-Hermite quadrature (``diag_mixture``, the exact VG bounds); ``predictive_mean(mean, var)``;
    * :meth:`super_gaussian`: its potential for ``convex_relaxation`` (Nickisch & Seeger 2009, §2);
    * :meth:`local_bound`: its local variational bound for ``dual_vg`` (Khan et al. 2013, Eq. 10);
    * for extraction from a Pyro model: :attr:`distributions`, :meth:`predictor`, :meth:`fixed_params` and
      :meth:`from_site` (the families extraction reads are listed in
      :data:`pyro_convexvb.lgm.families.LIKELIHOODS`).

    Both engine hooks raise :class:`~pyro_convexvb.errors.UnsupportedModelError` with the reason (class attributes
    :attr:`no_potential`, :attr:`no_bound`) when the family has no such form.

    Example::

        >>> import torch
        >>> from pyro_convexvb.lgm.families import Poisson
        >>> fam = Poisson(torch.tensor([2.0, 0.0], dtype=torch.float64))
        >>> type(fam.local_bound()).__name__, fam.no_potential[:36]
        ('PoissonBound', 'Poisson sites are not super-Gaussian')
    """

    name = "base"
    log_concave = True
    #: Pyro/torch distribution classes whose observed sites this family reads (empty: built by hand only), and
    #: how a model writes such a site (named when extraction refuses a likelihood; ``None``: not named)
    distributions = ()
    pyro_form = None
    #: why the family has no super-Gaussian potential / no convex local bound (``None``: a generic reason)
    no_potential = None
    no_bound = None
    #: a vector site reads ``block_size`` consecutive design rows per observation (``Categorical``: ``K`` logits);
    #: its expectations take each row's covariance block (``expected_log_prob(mean, cov (n, K, K))``)
    vector_site = False
    block_size = 1

    def __init__(self, **params):
        if not self.vector_site:  # one value per site: a column (q, 1) would broadcast y - eta to (q, q) silently
            for key, value in params.items():
                if torch.is_tensor(value) and value.dim() > 1:
                    raise ValueError(f"{key}: a {self.name} site family takes one value per site, shape (q,); got "
                                     f"shape {tuple(value.shape)} (flatten a column with .reshape(-1))")
        self.params = params

    def super_gaussian(self):
        """The super-Gaussian potential of these sites (``s = eta - potential.shift``; ``convex_relaxation``).

        :returns: a :class:`~pyro_convexvb.lgm.families.potential.SuperGaussianPotential` of ``len(self)`` sites.
        :raises UnsupportedModelError: naming the family, with the reason it has none.
        """
        raise UnsupportedModelError(self.name, self.no_potential or f"site family '{self.name}' has no super-Gaussian "
                                    "representation (give it a super_gaussian() method returning a potential)")

    def local_bound(self, kind="tight", xi=None):
        """The convex local variational bound of these sites (``dual_vg``).

        :param str kind: which bound where a family has several (Bernoulli-logit: ``"tight"``, ``"jensen"``,
            ``"bohning"``, ``"jaakkola"``); the exact families ignore it.
        :param xi: fixed tangent points of the Jaakkola bound (``None``: from the prior marginals).
        :returns: a :class:`~pyro_convexvb.lgm.families.bound.LocalBound` of ``len(self)`` sites.
        :raises UnsupportedModelError: naming the family, with the reason it has none.
        """
        raise UnsupportedModelError(self.name, self.no_bound or f"site family '{self.name}' has no convex local bound")

    @classmethod
    def predictor(cls, dist):
        """The linear predictor ``eta`` of an observed site of distribution ``dist`` if it is of this family, else
        ``None`` (e.g. ``dist.logits`` of a ``Bernoulli``)."""
        return None

    @classmethod
    def refusal(cls, dist):
        """Why extraction refuses a site this family recognises (``None``: it does not), e.g. a vector site the
        engines cannot take yet (:class:`~pyro_convexvb.lgm.families.categorical.Categorical`)."""
        return None

    @classmethod
    def fixed_params(cls, dist):
        """``{name: (tensor, description)}``: the distribution's parameters besides ``eta`` that the family keeps
        (e.g. a Gaussian's noise scale); extraction refuses the site if one depends on a latent site."""
        return {}

    @classmethod
    def from_site(cls, site, y, **params):
        """The family of an observed site's rows: data ``y`` ``(q,)`` and :meth:`fixed_params` ``(q,)`` each.

        :param str site: the site's name (for errors).
        :raises UnsupportedModelError: naming ``site`` for data outside the family's support.
        """
        return cls(y, **params)

    def __len__(self):
        return int(next(iter(self.params.values())).shape[0])

    def log_prob(self, eta):
        raise NotImplementedError

    def peaks(self):
        """``(q,)`` the predictor values at which each site's factor ``t_i`` peaks: where a second posterior mode can
        sit when the family is not log-concave (:mod:`~pyro_convexvb.diagnostics.modes`). Such a family must give
        them; a log-concave one need not."""
        raise NotImplementedError(f"site family '{self.name}' does not give the peaks of its sites")

    def expected_log_prob(self, mean, var, num_points=64):
        return gaussian_expectation(lambda e: self._broadcast_log_prob(e), mean, var, num_points)

    def expected_log_prob_terms(self, mean, var, num_points=32):
        """``E log p`` under ``eta ~ N(mean, var)`` and its derivatives ``dE/dmean``, ``dE/dvar``, each ``(q,)``: by
        Gauss-Hermite quadrature of ``d log p / d eta`` and ``d2 log p / d eta2`` (Bonnet's and Price's theorems,
        ``dE/dvar = E[d2 log p / d eta2] / 2``; Opper & Archambeau 2009). The exact-VG fixed point of ``dual_vg``
        (``refine``) reads them. A family whose ``log p`` has a kink (where quadrature of the second derivative
        misses the curvature) overrides this with closed forms."""
        x, w = gauss_hermite(num_points, mean.dtype, mean.device)
        eta = (mean[:, None] + var.clamp_min(0).sqrt()[:, None] * x).detach().requires_grad_(True)
        with torch.enable_grad():
            lp = self._broadcast_log_prob(eta)
            g1 = torch.autograd.grad(lp.sum(), eta, create_graph=True)[0]
            g2 = torch.autograd.grad(g1.sum(), eta)[0]
        return (lp.detach() * w).sum(-1), (g1.detach() * w).sum(-1), 0.5 * (g2 * w).sum(-1)

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

    def tempered(self, weight):
        """``(family', log_const)`` of the sites ``t_i^{w_i}`` (:func:`tempered`): by default :class:`Weighted`."""
        return Weighted(self, weight), 0.0

    def __repr__(self):
        return f"{type(self).__name__}(rows={len(self)})"


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
        >>> from pyro_convexvb.lgm.families import BernoulliLogit
        >>> fam = Weighted(BernoulliLogit(torch.tensor([1., 0.], dtype=torch.float64)),
        ...                torch.tensor([2., 0.5], dtype=torch.float64))
        >>> fam.name
        'weighted_bernoulli_logit'
        >>> eta = torch.tensor([0.3, -1.0], dtype=torch.float64)
        >>> bool(torch.allclose(fam.log_prob(eta), fam.weight * fam.base.log_prob(eta)))
        True
    """

    def __init__(self, base, weight):
        weight = check_weight(torch.as_tensor(weight), len(base))
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

    def expected_log_prob_terms(self, mean, var, num_points=32):
        return tuple(self.weight * t for t in self.base.expected_log_prob_terms(mean, var, num_points))

    def predictive_mean(self, mean, var, num_points=64):
        return self.base.predictive_mean(mean, var, num_points)

    def super_gaussian(self):
        """:class:`WeightedPotential` of the base family's potential: ``t(s)^w`` is super-Gaussian exactly when
        ``t(s)`` is."""
        try:
            base = self.base.super_gaussian()
        except UnsupportedModelError as e:
            raise UnsupportedModelError(self.name, f"the site is weighted by poutine.scale and {e.reason}; t(s)^w is "
                                                   "super-Gaussian exactly when t(s) is") from None
        return WeightedPotential(base, self.weight)

    def local_bound(self, kind="tight", xi=None):
        """:class:`WeightedBound` of the base family's bound (``w f``, its conjugate ``w f*(alpha / w, lambda / w)``)."""
        try:
            base = self.base.local_bound(kind, xi)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(self.name, f"the site is weighted by poutine.scale and its family "
                                                   f"'{self.base.name}' has no convex local bound ({e.reason}); a "
                                                   "weighted site takes its family's bound scaled by the weight") from None
        return base.weighted(self.weight, self)

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
        >>> from pyro_convexvb.lgm.families import Gaussian
        >>> fam, c = tempered(Gaussian(torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)),
        ...                   torch.tensor([4.0], dtype=torch.float64))
        >>> float(fam.params["scale"][0]), round(c, 6)
        (0.5, -3.449963)
    """
    weight = torch.as_tensor(weight, dtype=next(iter(family.params.values())).dtype)
    if bool((weight == 1).all()):
        return family, 0.0
    return family.tempered(weight)
