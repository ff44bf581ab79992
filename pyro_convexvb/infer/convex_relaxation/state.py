"""The criterion ``phi`` and the immutable state in and out of the double loop (Nickisch & Seeger 2009, §2.1-2.2)."""
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Optional

import torch

from .problem import RelaxationProblem

__all__ = ["RelaxationState", "h_value", "phi_value"]


def h_value(prob, gamma, x_star=None):
    """``h(gamma) = sum_i h_i(gamma_i)``; closed form ``-(x_*/gamma + 2 g(x_*))`` when ``x_*(gamma)`` is known."""
    if not prob.q:
        return 0.0
    if x_star is None:
        return float(prob.site_sum(prob.pot.h(gamma).sum()))
    return float(prob.site_sum((-(x_star / gamma + 2 * prob.pot.g(x_star))).sum()))


def phi_value(prob, gamma, u, logdet, x_star=None):
    """``phi(gamma) = log|A| + h(gamma) + R(u, gamma)`` (Nickisch & Seeger 2009, §2.1), ``u`` a (near-)minimiser of ``R``."""
    return float(logdet) + h_value(prob, gamma, x_star) + float(prob.R(u, gamma))


@dataclass(frozen=True)
class RelaxationState:
    r"""One outer iteration of the double loop: ``pcv.fit(..., init=state)`` resumes from it.

    :ivar gamma: ``(q,)`` site widths (sites ordered as :func:`~.api.site_designs`); :ivar u: ``(n,)`` mean
        ``argmin_u R(u, gamma)`` or ``None``; :ivar z: ``(q,)`` ``diag(B A^{-1} B^T)`` at ``gamma`` or ``None``
        (given, a fit skips its first variance step: Nickisch & Seeger 2009, §3); :ivar logdet: ``log|A|`` (or
        a rigorous upper bound) or ``None``.
    :ivar cholesky: ``(n, n)`` Cholesky factor of ``A``, else ``None``; :ivar lanczos: else the variance step's
        Lanczos result (``LanczosResult`` or :class:`~.outer.WhitenedLanczos`).
    :ivar variance_method: ``"exact"``, ``"lanczos"``, ``"pca"`` (``pca_rank`` ``L``) or ``"given"`` (by hand).

    Example::

        >>> import torch, pyro_convexvb as pcv
        >>> from pyro_convexvb.lgm.sites import BernoulliLogit
        >>> X = torch.randn(40, 3, dtype=torch.float64); y = (X[:, 0] > 0).double()
        >>> lgm = pcv.LatentGaussianModel.from_design(X, BernoulliLogit(y), prior_scale=1.0)
        >>> res = pcv.fit(lgm, engine="convex_relaxation", options={"variance": "exact", "max_outer": 30},
        ...               progress=False)
        >>> abs(float(res.state.bound_at(lgm)) - res.log_evidence_bound) < 1e-8
        True
        >>> again = pcv.fit(lgm, engine="convex_relaxation", options={"variance": "exact"}, init=res.state,
        ...                 progress=False)
        >>> again.converged, len(again.history["objective"])
        (True, 2)
    """

    engine: ClassVar[str] = "convex_relaxation"
    #: the options a state replaces (an inner fit warm-started from a state resets them)
    options: ClassVar[tuple] = ("gamma_init", "z_init", "u_init", "logdet_init")

    gamma: torch.Tensor
    u: Optional[torch.Tensor] = None
    z: Optional[torch.Tensor] = None
    logdet: Optional[float] = None
    cholesky: Optional[torch.Tensor] = None
    lanczos: Any = None
    variance_method: str = "given"
    pca_rank: Optional[int] = None

    def warm_start(self):
        """The widths only (``z``, ``u``, ``log|A|`` belong to this model), for a fit of a nearby model."""
        g = self.gamma
        return RelaxationState(g) if g.numel() and bool((g > 0).all()) else None

    def checked(self, prob, names=None):
        """This state in ``prob``'s dtype and device; :raises ValueError: naming the field (``names``, default
        ``init.gamma``, ...) for a wrong shape or non-finite (or nonpositive ``gamma``) entries."""
        names = names or {f: f"init.{f}" for f in ("gamma", "z", "u")}
        dt, dev, q, n = prob.dtype, prob.device, prob.q, prob.n
        gamma = torch.as_tensor(self.gamma, dtype=dt, device=dev)
        if gamma.numel() == 1:  # one width for every site
            gamma = gamma.reshape(()).expand(q)
        if gamma.shape != (q,) or not bool((gamma > 0).all()) or not bool(torch.isfinite(gamma).all()):
            raise ValueError(f"{names['gamma']}: must be positive and finite, one width per site ({q},); got shape "
                             f"{tuple(gamma.shape)}")
        out = {"gamma": gamma.clone()}
        for f, size, what in (("z", q, "site variances"), ("u", n, "mean")):
            v = getattr(self, f)
            if v is not None:
                v = torch.as_tensor(v, dtype=dt, device=dev)
                if v.shape != (size,) or not bool(torch.isfinite(v).all()):
                    raise ValueError(f"{names[f]}: expected a finite ({size},) {what}, got shape {tuple(v.shape)}")
                out[f] = v
        if self.u is not None and self.z is None:
            raise ValueError(f"{names['u']}: a mean needs the site variances {names['z']} valid at {names['gamma']}")
        return replace(self, **out)

    def bound_at(self, lgm):
        r"""``C(theta) - phi(gamma, u; theta)/2`` at this ``(gamma, u)`` on ``lgm`` (the model at other
        hyperparameters ``theta``; Nickisch & Seeger 2009, §2.1) with the exact ``log|A|``: the type-II envelope."""
        prob = RelaxationProblem(lgm)
        st = self.checked(prob)
        A = prob.dense_a(1.0 / st.gamma if prob.q else None)
        logdet = 2 * torch.log(torch.diagonal(torch.linalg.cholesky(A))).sum()
        return prob.log_const() - 0.5 * phi_value(prob, st.gamma, st.u, logdet)
