r"""Importance-sampling proposals built from a fitted posterior.

Every proposal draws the model's latent sites in unconstrained coordinates and returns the exact log density
``log q`` of each draw, so that ``log p(y, x) - log q(x)`` are importance ratios with all constants.

* ``"fitted"``: the engine's posterior as it is: a :class:`~pyro_convexvb.GaussianPosterior`, a
  :class:`~pyro_convexvb.infer.diag_mixture.DiagMixturePosterior`, or, for hyper-latents integrated
  INLA-style, the :class:`~pyro_convexvb.infer.hyper.HyperPosterior` mixture: ``theta`` from its smooth density
  (the interpolated surface of a grid design, the split normal of a central composite design) and the field
  from the Gaussian of the design point nearest to ``theta`` (the same rule its guide samples by), so
  ``q(z, u) = q(z) q_{k(z)}(u)``.
* ``"widened"``: the defensive mixture ``(q + q_c) / 2`` (Hesterberg 1995), ``q_c`` the same Gaussians with every
  scale multiplied by ``c = 1.5`` (for hyper-latents: ``theta`` from a normal of scale ``c`` in the standardised
  coordinates of the integration design, or the split normal widened by ``c``).
* ``"student_t"``: the defensive mixture ``(q + t_5) / 2`` with ``t_5`` the multivariate Student-t of 5 degrees
  of freedom with the Gaussian's location and scale matrix (hyper-latents as for ``"widened"``).
"""
import math

import torch

__all__ = ["PROPOSALS", "make_proposal"]

PROPOSALS = ("fitted", "widened", "student_t")
WIDEN = 1.5
T_DF = 5.0


#: largest latent dimension at which a matrix-free precision is densified for its log density
DENSE_MAX = 4000


def _with_density(post):
    """``post``, or for a matrix-free precision ``A`` (covariance ``precision_scale * A^{-1}``) up to
    :data:`DENSE_MAX` latents the same Gaussian with its dense precision (exact samples and log density)."""
    from ..infer.posterior import GaussianPosterior

    if getattr(post, "kind", None) == "precision_operator" and post.n <= DENSE_MAX:
        A = post.precision_operator.to_dense()
        A = 0.5 * (A + A.transpose(0, 1)) / post.precision_scale
        return GaussianPosterior(post.loc, precision=A, layout=post.layout)
    return post


class _GaussianParts:
    """Log densities of the fitted Gaussian ``q``, its widened version and the matching Student-t, at draws."""

    def __init__(self, post):
        if getattr(post, "kind", None) in ("precision_operator", "low_rank"):
            raise NotImplementedError(
                f"importance diagnostics need the posterior's log density, which a {post.kind} posterior of "
                f"{post.n} latents does not give (a matrix-free precision is densified up to {DENSE_MAX} latents; a "
                "Lanczos factor is not a distribution); refit with a dense or Cholesky representation")
        self.post = post
        self.n = post.n
        self.lp_loc = float(post.log_prob(post.loc))  # = -n/2 log 2 pi - 1/2 log det Sigma

    def log_prob(self, u):
        return self.post.log_prob(u)

    def sample(self, m, generator, kind):
        """``m`` draws of the kind's *second* component (``"widened"``: scale c; ``"student_t"``: t_5)."""
        g = self.post.sample(m, generator=generator).reshape(m, self.n) - self.post.loc
        if kind == "widened":
            return self.post.loc + WIDEN * g
        chi2 = torch.distributions.Chi2(torch.tensor(T_DF, dtype=torch.float64)).sample((m,))
        return self.post.loc + g * torch.sqrt(T_DF / chi2).to(g.dtype).reshape(m, 1)

    def log_prob_second(self, u, kind, lp=None):
        if lp is None:
            lp = self.post.log_prob(u)
        maha = (-2.0 * (lp - self.lp_loc)).clamp_min(0)  # (u - m)^T Sigma^{-1} (u - m)
        if kind == "widened":
            return self.lp_loc - self.n * math.log(WIDEN) - 0.5 * maha / WIDEN**2
        n, nu = self.n, T_DF
        return (self.lp_loc + 0.5 * n * math.log(2 * math.pi) + math.lgamma(0.5 * (nu + n)) - math.lgamma(0.5 * nu)
                - 0.5 * n * math.log(nu * math.pi) - 0.5 * (nu + n) * torch.log1p(maha / nu))


class Proposal:
    """Base class: ``sample(S, generator) -> ({site: (S, *ushape)}, log_q (S,))``."""

    name = "fitted"
    #: whether the draws cover the hyper-latents (``False`` for a ``hyper="map"`` result: theta is fixed)
    covers_hyper = True
    fixed = None


class GaussianProposal(Proposal):
    def __init__(self, post, kind):
        self.layout = post.layout
        post = _with_density(post)
        self.post, self.name = post, kind
        if self.layout is None:
            raise ValueError("the posterior has no latent layout (it was not fitted on a Pyro model)")
        self.parts = None if kind == "fitted" and not hasattr(post, "kind") else _GaussianParts(post)
        if kind != "fitted" and not hasattr(post, "kind"):
            raise NotImplementedError(f"the {kind!r} proposal is built from a Gaussian posterior, not from a "
                                      f"{type(post).__name__}")

    def sample_flat(self, S, generator):
        if self.name == "fitted":
            u = self.post.sample(S, generator=generator).reshape(S, -1)
            return u, self.post.log_prob(u)
        second = torch.rand(S, generator=generator) < 0.5
        u = self.post.sample(S, generator=generator).reshape(S, -1)
        m = int(second.sum())
        if m:
            u[second] = self.parts.sample(m, generator, self.name)
        lp = self.parts.log_prob(u)
        lq = torch.logaddexp(lp, self.parts.log_prob_second(u, self.name, lp)) - math.log(2.0)
        return u, lq

    def sample(self, S, generator=None):
        u, lq = self.sample_flat(S, generator)
        return self.layout.unflatten(u), lq.double()


class HyperProposal(Proposal):
    """Draws of the hyper-latents ``z`` and the field ``u`` from a :class:`~pyro_convexvb.infer.hyper.HyperPosterior`."""

    def __init__(self, hp, kind):
        self.hp, self.name = hp, kind
        self.density = hp.density
        self.covers_hyper = hp.density.kind != "point"
        self.components = [_with_density(c) for c in hp.components]
        self.parts = [_GaussianParts(c) for c in self.components]
        if hp.layout is None:
            raise ValueError("the hyper-latent posterior has no field layout")
        if not self.covers_hyper:
            theta, _ = hp.space.unpack(hp.z[0])
            self.fixed = theta
        else:
            self.log_det_A_inv = float(torch.linalg.slogdet(hp.density.A_inv)[1])

    # ---- theta part, in the standardised coordinates x of the design
    def _log_qx(self, x):
        d = self.density
        if d.kind == "split-normal":
            s = torch.where(x > 0, d.s_plus, d.s_minus)
            return (-0.5 * (x / s) ** 2 - torch.log(s) - 0.5 * math.log(2 * math.pi)).sum(1)
        # the surface: uniform within the fine-grid cell of the nearest grid point
        dist_, j = torch.cdist(x, d.xs).min(1)
        inside = (x - d.xs[j]).abs().max(1).values <= 0.5 * d.cell + 1e-12
        lq = torch.log(d.probs[j]) - x.shape[1] * math.log(d.cell)
        return torch.where(inside, lq, torch.full_like(lq, -math.inf))

    def _wide_x(self, m, generator):
        d = self.density
        e = torch.randn(m, self.hp.space.dim, dtype=torch.float64, generator=generator)
        if d.kind == "split-normal":
            return torch.where(e > 0, e * d.s_plus, e * d.s_minus) * WIDEN
        return e * WIDEN

    def _log_q_wide_x(self, x):
        d = self.density
        if d.kind == "split-normal":
            s = torch.where(x > 0, d.s_plus, d.s_minus) * WIDEN
            return (-0.5 * (x / s) ** 2 - torch.log(s) - 0.5 * math.log(2 * math.pi)).sum(1)
        return (-0.5 * (x / WIDEN) ** 2 - math.log(WIDEN) - 0.5 * math.log(2 * math.pi)).sum(1)

    def sample(self, S, generator=None):
        hp = self.hp
        second = (torch.rand(S, generator=generator) < 0.5) if self.name != "fitted" else torch.zeros(S, dtype=torch.bool)
        if self.covers_hyper:
            x = self.density.sample_x(S, generator)
            m = int(second.sum())
            if m:
                x[second] = self._wide_x(m, generator)
            k = torch.cdist(x, hp.x).argmin(1)
            z = self.density.to_z(x)
        else:
            x = torch.zeros(S, 0, dtype=torch.float64)
            k = torch.zeros(S, dtype=torch.long)
            z = hp.z[0].reshape(1, -1).expand(S, -1)  # theta fixed at its mode; q covers the field only
        u = torch.empty(S, hp.n, dtype=hp.dtype, device=hp.device)
        lu1 = torch.empty(S, dtype=torch.float64)
        lu2 = torch.empty(S, dtype=torch.float64)
        for j in k.unique().tolist():
            idx = (k == j).nonzero().reshape(-1)
            parts = self.parts[j]
            draw = self.components[j].sample(len(idx), generator=generator).reshape(len(idx), hp.n)
            sec = second[idx]
            if self.name != "fitted" and bool(sec.any()):
                draw[sec] = parts.sample(int(sec.sum()), generator, self.name)
            u[idx] = draw
            lp = parts.log_prob(draw).double()
            lu1[idx] = lp
            if self.name != "fitted":
                lu2[idx] = parts.log_prob_second(draw, self.name, lp).double()
        if self.covers_hyper:
            lq1 = self._log_qx(x) + lu1
            if self.name == "fitted":
                lq = lq1
            else:
                lq = torch.logaddexp(lq1, self._log_q_wide_x(x) + lu2) - math.log(2.0)
            lq = lq - self.log_det_A_inv
        else:
            lq = lu1 if self.name == "fitted" else torch.logaddexp(lu1, lu2) - math.log(2.0)
        values = dict(hp.layout.unflatten(u))
        start = 0
        for n, us, size in zip(hp.space.names, hp.space.ushapes, hp.space.sizes):
            values[n] = z[:, start:start + size].reshape((S,) + tuple(us))
            start += size
        return values, lq


def make_proposal(posterior, kind="fitted"):
    """The proposal ``kind`` (one of :data:`PROPOSALS`) built from a fitted posterior."""
    from ..infer.hyper import HyperPosterior

    if kind not in PROPOSALS:
        raise ValueError(f"proposal: expected one of {PROPOSALS}, got {kind!r}")
    if isinstance(posterior, HyperPosterior):
        return HyperProposal(posterior, kind)
    if not (hasattr(posterior, "sample") and hasattr(posterior, "log_prob")):
        raise NotImplementedError(f"importance diagnostics need a posterior with sample() and log_prob(), got "
                                  f"{type(posterior).__name__}")
    return GaussianProposal(posterior, kind)
