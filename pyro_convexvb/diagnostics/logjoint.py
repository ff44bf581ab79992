r"""The model's log joint density, evaluated through the Pyro model as written.

For draws of every latent site in Pyro's unconstrained coordinates (``biject_to`` of each support, as the
posteriors are packed), :class:`ModelLogJoint` returns

.. math:: \log p(y, x) = \log p\big(y, T(x)\big) + \log\left|\det \partial T(x) / \partial x\right|,

with every normalising constant (the model's ``log_prob_sum`` under ``poutine.condition``, every plate at
its full size), and, on request, the pointwise log-likelihood of each observation, its predictive CDF (for
PIT values) and a replicated observation.

The evaluation loops over draws: one trace of the model per draw. A vectorised evaluation (an outer plate
over draws) would need every model to broadcast over a leading batch dimension, which models written with
``X @ w`` do not; on the small models of the test suite the loop costs about 1 ms per draw.
"""
import numpy as np
import pyro.poutine as poutine
import torch
from torch.distributions import biject_to

__all__ = ["ModelLogJoint"]


def _base(fn):
    """``(base distribution, reinterpreted event dims)`` under ``Independent``/``MaskedDistribution`` wrappers."""
    while True:
        if hasattr(fn, "base_dist"):
            fn = fn.base_dist
        else:
            return fn


def _cdf_pair(fn, y):
    """``(P(Y < y), P(Y = y))`` elementwise for the supported observation families, else ``None``."""
    import pyro.distributions as dist

    b = _base(fn)
    if isinstance(b, (dist.Normal, torch.distributions.Normal)):
        return b.cdf(y), torch.zeros_like(y)
    if isinstance(b, (dist.Bernoulli, torch.distributions.Bernoulli)):
        p1 = b.probs
        below = torch.where(y > 0.5, 1 - p1, torch.zeros_like(p1))
        at = torch.where(y > 0.5, p1, 1 - p1)
        return below, at
    if isinstance(b, (dist.Poisson, torch.distributions.Poisson)):
        rate = b.rate.expand_as(y)
        at = torch.exp(b.log_prob(y))
        # P(Y <= y) = Q(y + 1, rate), the regularised upper incomplete gamma function
        cdf = torch.special.gammaincc(y + 1, rate)
        return cdf - at, at
    return None


class ModelLogJoint:
    """Evaluate ``log p(y, x)`` of a Pyro model at draws ``x`` of its latent sites (unconstrained coordinates).

    :param model: the Pyro model.
    :param tuple args: its positional arguments; ``kwargs`` its keyword arguments (the data).

    Example::

        >>> import pyro, pyro.distributions as dist
        >>> def model(y=None):
        ...     s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=torch.float64)))
        ...     pyro.sample("y", dist.Normal(torch.tensor(0.0, dtype=torch.float64), s), obs=y)
        >>> lj = ModelLogJoint(model, (), {"y": torch.tensor(0.5, dtype=torch.float64)})
        >>> out = lj.evaluate({"s": torch.zeros(3, dtype=torch.float64)})   # s = exp(0) = 1
        >>> float(out["log_joint"][0]) == float(dist.HalfNormal(1.).log_prob(torch.tensor(1.))
        ...                                     + dist.Normal(0., 1.).log_prob(torch.tensor(0.5)))
        True
    """

    def __init__(self, model, args=(), kwargs=None):
        from ..lgm.extract import latent_sites

        self.model, self.args, self.kwargs = model, tuple(args), dict(kwargs or {})
        sites = latent_sites(model, self.args, self.kwargs)
        self.names = [n for n, _ in sites]
        self.transforms = {n: biject_to(s["fn"].support) for n, s in sites}
        self.shapes = {n: tuple(s["value"].shape) for n, s in sites}

    def constrain(self, name, x):
        """Constrained values of site ``name`` from unconstrained draws ``x`` ``(S, *ushape)``."""
        return self.transforms[name](x)

    def _check(self, values):
        missing = [n for n in self.names if n not in values]
        extra = [n for n in values if n not in self.transforms]
        if missing or extra:
            raise ValueError(f"draws must cover exactly the model's latent sites {self.names}; "
                             f"missing {missing}, unknown {extra}")
        sizes = {int(v.shape[0]) for v in values.values()}
        if len(sizes) != 1:
            raise ValueError(f"draws of every site need the same leading number of draws, got {sorted(sizes)}")
        return sizes.pop()

    def evaluate(self, values, *, pointwise=False, pit=False, predictive=False, progress=False):
        """Evaluate the model at ``S`` draws.

        :param dict values: ``{site: (S, *unconstrained shape) tensor}`` for every latent site.
        :param bool pointwise: also return ``log_lik``: ``{observed site: (S, N_site) array}`` of the
            observations' own log densities (unscaled; masked entries dropped).
        :param bool pit: also return ``cdf``: ``{site: ((S, N_site), (S, N_site))}`` of ``P(Y < y)`` and
            ``P(Y = y)`` (Normal, Bernoulli and Poisson sites; others are left out).
        :param bool predictive: also return ``y_rep``: ``{site: (S, *shape)}`` replicated observations.
        :returns: dict with ``log_joint`` ``(S,)`` numpy array (unconstrained density, all constants) and
            the requested extras.
        """
        from tqdm.auto import tqdm

        from ..lgm.extract import full_data_plates

        S = self._check(values)
        lj = np.empty(S)
        ll, cdf, rep = {}, {}, {}
        it = range(S)
        if progress:
            it = tqdm(it, desc="log joint", unit="draw", leave=False)
        with torch.no_grad(), full_data_plates():
            for s in it:
                data, ldj = {}, 0.0
                for n in self.names:
                    x = values[n][s]
                    t = self.transforms[n]
                    v = t(x)
                    data[n] = v
                    ldj = ldj + float(t.log_abs_det_jacobian(x, v).sum())
                tr = poutine.trace(poutine.condition(self.model, data=data)).get_trace(*self.args, **self.kwargs)
                lp = float(tr.log_prob_sum())
                lj[s] = lp + ldj
                if not (pointwise or pit or predictive):
                    continue
                for name, site in tr.nodes.items():
                    if site["type"] != "sample" or not site["is_observed"] or name in self.transforms:
                        continue  # latent sites are observed here only because they are conditioned on
                    if site.get("infer", {}).get("_deterministic") or site["fn"].__class__.__name__ == "Delta":
                        continue
                    fn, y = site["fn"], site["value"]
                    keep = None
                    if pointwise or pit:
                        lpy = fn.log_prob(y)
                        mask = site.get("mask")
                        if isinstance(mask, torch.Tensor):
                            keep = mask.expand_as(lpy).reshape(-1)
                        elif mask is False:
                            keep = torch.zeros(lpy.numel(), dtype=torch.bool)
                        flat = lpy.reshape(-1)
                        if keep is not None:
                            flat = flat[keep]
                        ll.setdefault(name, []).append(flat.double().cpu().numpy())
                    if pit:
                        pair = _cdf_pair(fn, y)
                        if pair is not None and pair[0].shape == lpy.shape:
                            below, at = (p.reshape(-1) for p in pair)
                            if keep is not None:
                                below, at = below[keep], at[keep]
                            cdf.setdefault(name, ([], []))
                            cdf[name][0].append(below.double().cpu().numpy())
                            cdf[name][1].append(at.double().cpu().numpy())
                    if predictive:
                        rep.setdefault(name, []).append(fn.sample().double().cpu().numpy())
        out = {"log_joint": lj}
        if pointwise or pit:
            out["log_lik"] = {k: np.stack(v) for k, v in ll.items()}
        if pit:
            out["cdf"] = {k: (np.stack(a), np.stack(b)) for k, (a, b) in cdf.items() if len(a) == S}
        if predictive:
            out["y_rep"] = {k: np.stack(v) for k, v in rep.items()}
        return out

    def observed(self):
        """``{observed site: flat numpy array}`` of the observations (masked entries dropped)."""
        from ..lgm.extract import full_data_plates

        with torch.no_grad(), full_data_plates():
            tr = poutine.trace(self.model).get_trace(*self.args, **self.kwargs)
        out = {}
        for name, site in tr.nodes.items():
            if site["type"] == "sample" and site["is_observed"] and name not in self.transforms:
                y = site["value"]
                mask = site.get("mask")
                flat = y.reshape(-1)
                if isinstance(mask, torch.Tensor) and mask.numel() > 1:
                    flat = flat[mask.expand(y.shape).reshape(-1)]
                out[name] = flat.double().cpu().numpy()
        return out
