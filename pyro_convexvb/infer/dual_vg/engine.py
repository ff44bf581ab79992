"""The ``dual_vg`` engine (Khan et al. 2013): the storage form of the dual, the solve, the recovered ``q``
(:class:`DualVGEngine`); its :class:`DualState` resumes a fit (``init=``)."""
import dataclasses
import math
import typing
from dataclasses import dataclass

import torch

from ...errors import NotPositiveDefiniteError, UnsupportedModelError, warn
from ...linalg.operators import DENSE_LIMIT, IdentityOperator, SparseOperator
from ..engine import Criterion, Engine, LGMEngineOptions, Optimality, Solution, option
from ...lgm.stack import Stacked
from .bounds import LogitJaakkolaBound, make_bound
from .objective import LatentSpaceBackend, SiteSpaceBackend, SparsePrecisionBackend, exact_elbo
from .optim import FAR_START, refine_exact, solve_dual
from .sharding import sharded_design

__all__ = ["DualVGEngine", "DualVGOptions", "DualState", "fit_dual_vg", "site_space_predictive", "dual_vg_applies",
           "build_dual_problem"]

#: largest accepted relative change of a site natural parameter by one more full CVI step after ``refine``
REFINE_RESIDUAL_TOL = 1e-8
#: the hyper-latents' mode search takes envelope gradients (:meth:`DualVGEngine.envelope_bound`) only for posteriors of
#: at most this many coordinates: each forms the posterior's dense covariance, ``O(n^3)``, while the ``2 d`` fits it
#: replaces need not. Measured on a Poisson lattice GMRF with one precision scale (19-20 fits against 25-28): 9-14%
#: faster at 64 and 144 coordinates, even at 256 and 400, 1.85 times slower at 900
ENVELOPE_MAX_N = 200


def dual_vg_applies(lgm):
    """``None`` if DualVG fits ``lgm`` (Gaussian priors on every block, and sites whose family has a convex local
    bound, :meth:`~pyro_convexvb.lgm.families.SiteFamily.local_bound`), else the
    :class:`~pyro_convexvb.UnsupportedModelError` naming the site and the reason."""
    for p in lgm.priors:
        if p.flat:
            return UnsupportedModelError(p.name, f"latent '{p.name}' has no Gaussian prior (flat block, e.g. a "
                                                 "Laplace prior)")
    surrogate = None
    for g in lgm.sites:
        try:
            if getattr(g.family.local_bound(), "surrogate", False) and surrogate is None:  # block bounds have none
                surrogate = g
        except ValueError as e:  # UnsupportedModelError, or data outside the family's support
            return UnsupportedModelError(g.name, getattr(e, "reason", str(e)))
    if surrogate is not None and sharded_design(lgm.design())[1] is not None:
        return _sharded_surrogate(surrogate)
    if not lgm.sites:
        return UnsupportedModelError("<model>", "the model has no likelihood sites")
    vector = [g for g in lgm.sites if g.family.vector_site]
    if vector and len(vector) < len(lgm.sites):
        scalar = next(g for g in lgm.sites if not g.family.vector_site)
        return UnsupportedModelError(scalar.name, f"dual_vg fits vector (Categorical) sites such as '{vector[0].name}' "
                                                  "only in models whose likelihood sites are all vector sites; "
                                                  f"'{scalar.name}' is a scalar '{scalar.family.name}' site")
    if vector and sharded_design(lgm.design())[1] is not None:
        return UnsupportedModelError(vector[0].name, "dual_vg does not fit vector (Categorical) sites on row-sharded "
                                                     "data")
    return None


def _sharded_surrogate(g):
    return UnsupportedModelError(g.name, f"dual_vg fits {g.family.name} sites by refining to the exact "
                                         "variational-Gaussian optimum, which is not available on row-sharded data; "
                                         "fit without sharding, or with engine='convex_relaxation'")


def _is_identity(op, n):
    return isinstance(op, IdentityOperator) and op.shape == (n, n)


def _row_counts(op):
    """Nonzeros per row of a sparse or dense design operator, read from its entries (a sparse one is not
    densified), or ``None`` for another operator."""
    from ...linalg.operators import DenseOperator

    if isinstance(op, SparseOperator):
        crow = op.matrix.crow_indices()
        return crow[1:] - crow[:-1]
    if isinstance(op, DenseOperator):
        return (op.matrix != 0).sum(1)
    return None


def _one_per_row(op):
    """Whether every row of a sparse or dense design has exactly one nonzero (a gather ``x[idx]`` is extracted as a
    dense design below a thousand latents)."""
    counts = _row_counts(op)
    return counts is not None and bool((counts == 1).all())


#: smallest latent dimension at which ``form='auto'`` prefers the sparse latent form (a sparse prior precision and a
#: sparse design) to the dense ``L x L`` form; below it a dense Cholesky of ``L x L`` is cheap (docs/dual_vg.md)
SPARSE_MIN_LATENTS = 1000
#: largest fraction of nonzeros in the design for which ``form='auto'`` picks the sparse latent form
SPARSE_MAX_DENSITY = 0.05


def sparse_prior_precision(lgm):
    """The block-diagonal prior precision of ``lgm`` as a SciPy CSR matrix, or ``None`` when a block is given
    only by a covariance (or is flat): nothing is densified except blocks already dense."""
    import scipy.sparse as sp

    from ...linalg.operators import DenseOperator, DiagonalOperator
    from ...linalg.sparse_cholesky import as_scipy_csc

    blocks = []
    for p in lgm.priors:
        if p.flat or p.prec is None:
            return None
        if isinstance(p.prec, DiagonalOperator):
            blocks.append(sp.diags(p.prec.diag.detach().cpu().double().numpy()))
        elif isinstance(p.prec, SparseOperator):
            blocks.append(as_scipy_csc(p.prec, f"prior precision of '{p.name}'"))
        elif isinstance(p.prec, DenseOperator):  # its nonzeros only
            blocks.append(as_scipy_csc(p.prec.matrix, f"prior precision of '{p.name}'"))
        else:
            return None
    return sp.block_diag(blocks, format="csr")


def sparse_design(lgm):
    """The stacked design of ``lgm`` as a SciPy CSR matrix when every group's design is an explicit sparse,
    diagonal or embedded matrix (dense ones are converted), else ``None`` (matrix-free designs)."""
    import scipy.sparse as sp

    from ...lgm.chains import _scipy_csr

    parts = [_scipy_csr(g.design) for g in lgm.sites]
    if any(p is None for p in parts):
        return None
    return sp.vstack(parts, format="csr") if len(parts) > 1 else parts[0].tocsr()


def _bound_kind(b):
    """The class of a local bound under its weighting wrappers (``WeightedBound.base``)."""
    while hasattr(b, "base") and hasattr(b, "weight"):
        b = b.base
    return type(b)


def build_dual_problem(lgm, bound="tight", form="auto", xi=None, reuse=None):
    """``(backend, local bound, latent-space kind)`` for a :class:`~pyro_convexvb.LatentGaussianModel`.

    :param reuse: a backend of an earlier fit (``None``: none); in the sparse latent form, when its design is this
        model's, its structure is taken over (:meth:`~.sparse.SparseLatentBackend.reuse`), the result being the
        backend a fresh build would give.

    :param str form: ``"site"`` (``N x N``), ``"latent"`` (``L x L``), ``"banded"`` (sparse
        precision, one latent per site), ``"sparse"`` (sparse precision and sparse design:
        :class:`~.sparse.SparseLatentBackend`) or ``"auto"``: banded when the prior is a sparse precision only
        and every site reads one latent; sparse when every prior block has a diagonal or sparse precision, the
        prior precision and the designs have at most :data:`SPARSE_MAX_DENSITY` nonzeros and
        ``L >=`` :data:`SPARSE_MIN_LATENTS` (a random-intercept model with many groups); else latent space when
        ``L < N``; else site space.

    Row-sharded data (a design wrapped by :func:`pyro_convexvb.distributed.row_sharded` under an
    initialised process group) runs in the ``L x L`` form only: each rank keeps its own sites, ``W^T u``
    and ``W^T Lambda W`` are all-reduced (:mod:`.sharding`). ``form="auto"`` then selects it; the
    site and banded forms raise, since their ``N x N`` (or site-indexed sparse) matrices couple the
    sites of all ranks.
    """
    err = dual_vg_applies(lgm)
    if err is not None:
        raise err
    if form not in ("auto", "site", "latent", "banded", "sparse"):
        raise ValueError(f"form: expected 'auto', 'site', 'latent', 'banded' or 'sparse', got {form!r}")
    sizes = [len(g.family) for g in lgm.sites]
    xis = _split_xi(xi, sizes, lgm) if xi is not None else [None] * len(sizes)
    bounds = [make_bound(g.family, bound, x) for g, x in zip(lgm.sites, xis)]
    if bound != "tight" and all(_bound_kind(b) is _bound_kind(make_bound(g.family, "tight"))
                                for g, b in zip(lgm.sites, bounds)):
        warn(f"engine 'dual_vg': option bound={bound!r} has no effect: the model has no logit-family sites "
             "(Bernoulli-logit, Binomial, NegativeBinomial), and its other sites use their own bounds; drop the "
             "option", UserWarning)
    lb = bounds[0] if len(bounds) == 1 else Stacked(bounds)
    W, comm = sharded_design(lgm.design())
    d = lgm.offset()
    mu = lgm.prior_loc
    N, L = W.shape
    precision_only = lgm.prior_cov is None
    form = _choose_form(lgm, W, form, comm, precision_only)
    if form == "sparse":
        from .sparse import SparseLatentBackend

        Q, Ws = sparse_prior_precision(lgm), sparse_design(lgm)
        if Q is None:
            raise ValueError("dual_vg: form='sparse' needs every prior block given by a precision (diagonal, sparse "
                             "or dense); this model has a block given only by its covariance; use form='latent'")
        if Ws is None:
            raise ValueError("dual_vg: form='sparse' needs explicit (sparse or dense) designs; this model has a "
                             "matrix-free design; use form='latent' or 'site'")
        backend = SparseLatentBackend.reuse(reuse, Q, mu, Ws, d) if isinstance(reuse, SparseLatentBackend) else None
        if backend is None:
            backend = SparseLatentBackend(Q, mu, Ws, d)
    elif form == "banded":
        _check_banded(lgm, W)
        Q = lgm.priors[0].prec
        backend = SparsePrecisionBackend(Q, mu, None if _is_identity(W, L) else W, d)
    elif form == "latent":
        backend = LatentSpaceBackend(W, mu, d, prior_cov=None if precision_only else lgm.dense_prior_cov(),
                                     prior_prec=lgm.dense_prior_prec(), prior_logdet_cov=lgm.prior_logdet_cov(),
                                     comm=comm)
    else:
        S = lgm.dense_prior_cov()
        if _is_identity(W, L):
            St, latent = S, None
        else:
            Wd = W.to_dense()
            WS = Wd @ S
            St, latent = WS @ Wd.transpose(0, 1), (WS, mu, S)
        # the site backend works on eta = W z + d; with W = I the latent is eta - d
        backend = SiteSpaceBackend(0.5 * (St + St.transpose(0, 1)), W.mv(mu) + d, latent=latent, site_offset=d)
    if isinstance(lb, LogitJaakkolaBound) or any(isinstance(b, LogitJaakkolaBound) for b in lb.split()):
        h, rho = backend.prior_marginals()
        parts = lb.split()
        for b, hh, rr in zip(parts, h.split([len(b) for b in parts]), rho.split([len(b) for b in parts])):
            if isinstance(b, LogitJaakkolaBound) and b.xi is None:
                b.set_xi(torch.sqrt(hh**2 + rr))
    return backend, lb, form


def _as_real_tensor(value, name, expected, dtype, device):
    """``value`` as a real tensor of ``dtype``, or a ``TypeError`` naming the option ``name``, the ``expected``
    input and what was given."""
    try:
        out = torch.as_tensor(value, dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError):
        out = None
    if out is None or (torch.is_tensor(value) and (value.is_complex() or value.is_sparse)):
        raise TypeError(f"{name} expects {expected}, got {value!r:.60} ({type(value).__name__})")
    return out


def _split_xi(xi, sizes, lgm):
    """Option ``xi`` checked and split by site group: a scalar for every site, or one value per observed site entry
    (``(N,)``, in the order of the sites)."""
    num_sites = sum(sizes)
    expected = f"a finite scalar or a ({num_sites},) tensor, one Jaakkola tangent point per observed site entry"
    xi = _as_real_tensor(xi, "engine 'dual_vg': option 'xi'", expected, lgm.dtype, lgm.device)
    if xi.dim() == 0 and bool(torch.isfinite(xi)):
        return [xi] * len(sizes)
    if xi.shape != (num_sites,) or not bool(torch.isfinite(xi).all()):
        raise ValueError(f"engine 'dual_vg': option 'xi' must be {expected}; got shape {tuple(xi.shape)}"
                         + (" with non-finite entries" if xi.shape in ((), (num_sites,)) else ""))
    return list(xi.split(sizes))


def _check_banded(lgm, W):
    """Refuse ``form='banded'`` for a model that is not a GMRF read one latent per site, naming the option, the
    reason and the forms that do run it."""
    if len(lgm.priors) != 1:
        why = f"this model has {len(lgm.priors)} prior blocks"
    elif lgm.priors[0].flat or not isinstance(lgm.priors[0].prec, SparseOperator):
        p = lgm.priors[0]
        given = ("is flat" if p.flat else "is given only by a covariance" if p.prec is None
                 else f"has a precision of type {type(p.prec).__name__}, not a sparse matrix")
        why = f"the prior of '{p.name}' {given}"
    else:
        if _is_identity(W, W.shape[1]):
            return
        rows = _row_counts(W)
        if rows is None:
            why = f"the design is a {type(W).__name__}, not a matrix with one nonzero per row"
        elif bool((rows == 1).all()):
            return
        else:
            bad = int((rows != 1).nonzero()[0, 0])
            why = f"site row {bad} reads {int(rows[bad])} latents"
    works = "'sparse', " if sparse_prior_precision(lgm) is not None and sparse_design(lgm) is not None else ""
    raise ValueError(f"engine 'dual_vg': option form='banded' needs a Gaussian Markov random field prior (one prior "
                     f"block given by a sparse precision) with every site reading one latent; {why}. Use "
                     f"form='auto' (it picks the form that fits), or one of {works}'latent', 'site'")


def _choose_form(lgm, W, form, comm, precision_only):
    """The form :func:`build_dual_problem` runs in: ``form`` itself, or for ``"auto"`` the rule of its docstring;
    row-sharded data runs in the latent form only."""
    N, L = W.shape
    if comm is not None:
        if form in ("site", "banded", "sparse"):
            raise ValueError(f"dual_vg: form='{form}' cannot run on row-sharded data (its matrices couple the sites of "
                             f"every rank); use form='latent' (the L x L form, or form='auto', which selects it)")
        return "latent"
    if form != "auto":
        return form
    if precision_only and len(lgm.priors) == 1 and isinstance(lgm.priors[0].prec, SparseOperator) \
            and (_is_identity(W, L) or _one_per_row(W)):
        return "banded"
    if L >= SPARSE_MIN_LATENTS and _sparse_form_fits(lgm, W):
        return "sparse"
    return "latent" if L < N else "site"


def _sparse_form_fits(lgm, W):
    """Whether ``form='auto'`` should pick the sparse latent form (see :func:`build_dual_problem`)."""
    from ...linalg.operators import DenseOperator

    if any(isinstance(g.design, DenseOperator) for g in lgm.sites):
        return False
    Q = sparse_prior_precision(lgm)
    if Q is None or Q.nnz > SPARSE_MAX_DENSITY * Q.shape[0] * Q.shape[1]:  # a dense precision (a GP's): L x L form
        return False
    Ws = sparse_design(lgm)
    return Ws is not None and Ws.nnz <= SPARSE_MAX_DENSITY * W.shape[0] * W.shape[1]


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

    engine: typing.ClassVar[str] = "dual_vg"
    #: the options a state replaces (an inner fit warm-started from a state resets them)
    options: typing.ClassVar[tuple] = ("alpha0",)

    alpha: torch.Tensor
    lam: torch.Tensor = None
    form: str = ""
    backend: typing.Any = None
    bound: str = "tight"
    xi: typing.Any = None
    posterior: typing.Any = None
    #: a backend of an earlier fit whose data-sized structure a fit of a nearby model may reuse (:meth:`reusing`)
    structure: typing.Any = None

    def warm_start(self):
        """``alpha`` alone, for a fit of a nearby model (clipped into its domain by :func:`~.optim.solve_dual`)."""
        return DualState(self.alpha)

    def mismatch(self, lgm):
        """Why this state cannot warm-start a fit of ``lgm``, or ``None`` when it can: ``alpha`` must hold one dual
        variable per observed site entry of ``lgm``, shape ``(lgm.num_sites,)`` (Khan et al. 2013, Eq. 20), the
        Gaussian it carries must be over ``lgm``'s ``lgm.n`` latent coordinates, and a fit of vector (Categorical)
        sites resumes only a ``"block"`` state (and the other way round). ``lgm`` is not fitted."""
        if tuple(self.alpha.shape) != (lgm.num_sites,):
            return (f"the state has {tuple(self.alpha.shape)} dual variables, the model {lgm.num_sites} observed "
                    "site entries")
        n = getattr(self.posterior, "n", None)
        if n is not None and n != lgm.n:
            return f"the state's Gaussian is over {n} latent coordinates, the model's over {lgm.n}"
        block = any(g.family.vector_site for g in lgm.sites)
        if self.form and (self.form == "block") != block:
            return (f"the state is of the {self.form!r} form, the model has "
                    + ("vector (Categorical) sites, fitted in the 'block' form" if block else "no vector sites"))
        return None

    def reusing(self, state):
        """This warm start with the backend of ``state`` (a full state of another fit) offered for reuse: a fit
        in the sparse latent form whose design equals that backend's takes its site pairs, ordering and symbolic
        factorisations and refactors only the new values (:meth:`~.sparse.SparseLatentBackend.reuse`; the
        hyper-latent design points of a model whose ``theta`` enters only the prior). Anything else ignores it."""
        backend = getattr(state, "backend", None)
        return dataclasses.replace(self, structure=backend) if backend is not None else self

    def bound_at(self, lgm):
        r"""``ELBO_LVB(q*; theta)`` of the fitted ``q*`` on ``lgm`` (the model at other hyperparameters; Khan et al.
        2013, §5: the type-II envelope), a 0-d tensor carrying ``lgm``'s graph; refused for ``bound='jaakkola'``
        (its ``xi`` depend on ``theta``) and row-sharded data."""
        if self.bound == "jaakkola":
            raise ValueError("engine 'dual_vg': learn_params differentiates the bound at the fitted q as the "
                             "maximum over q and the local bounds' variational parameters, and the 'jaakkola' bound's "
                             "tangent points xi are not fitted (set from the prior marginals, which move with the "
                             "params, or fixed by the option xi) -- use bound='tight', 'jensen' or 'bohning', or "
                             "learn_params=False")
        if sharded_design(lgm.design())[1] is not None:
            raise ValueError("engine 'dual_vg': type-II learning of model parameters (learn_params) is not "
                             "available on row-sharded data; learn them with engine 'convex_relaxation' or "
                             "'laplace' (which reduce type-II over ranks), or keep them fixed (learn_params=False)")
        q = self.posterior
        m = q.loc.to(lgm.dtype)
        V = q.covariance().to(lgm.dtype)
        L = torch.linalg.cholesky(V)
        val = lgm.expected_log_prior(m, V) + torch.log(torch.diagonal(L)).sum() + \
            0.5 * lgm.n * (1 + math.log(2 * math.pi)) + lgm.log_const
        marginals = lgm.site_marginals(m, V)  # block means and covariances for vector sites
        for g in lgm.sites:
            bound = g.family.local_bound(self.bound) if g.family.vector_site else make_bound(g.family, self.bound,
                                                                                               self.xi)
            val = val - bound.f(*marginals[g.name]).sum()
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


@dataclass(frozen=True)
class DualVGOptions(LGMEngineOptions):
    bound: typing.Literal["tight", "jensen", "bohning", "jaakkola"] = option(
        "tight", "local bound of the logit families: Bernoulli-logit, Binomial and NegativeBinomial/GammaPoisson "
                 "(log link) sites; the other families use their own: exact for Gaussian, Poisson, Gamma (log "
                 "link) and stochastic-volatility sites, the tight probit bound for probit, a quadratic surrogate "
                 "refined to the exact VG optimum for Laplace sites; Student-t sites have none (convex_relaxation "
                 "fits them)")
    method: typing.Literal["newton", "lbfgs"] = option("newton", "dual minimiser")
    form: typing.Literal["auto", "site", "latent", "banded", "sparse"] = option(
        "auto", "storage form: N x N site space, L x L latent space, a GMRF's sparse precision read one latent per "
                "site ('banded'), a sparse precision with a sparse design ('sparse'; both by sparse Cholesky), or "
                "auto")
    newton_solver: typing.Literal["auto", "dense", "cg"] = option(
        "auto", "Newton systems in the L x L form: dense Cholesky, matrix-free CG, or the cheaper by a flop count")
    gap_tol: typing.Optional[float] = option(None, "convergence: duality gap in nats (default 1e-8 N; Newton holds "
                                                   "it to at least the gap's rounding floor: the value used is "
                                                   "res.optimality's tolerance)", gt=0)
    max_iter: typing.Optional[int] = option(None, "iteration cap (default 100 Newton / 2000 L-BFGS)", min=1)
    alpha0: typing.Any = option(None, "(N,) warm start of the dual variables, one per observed site entry")
    xi: typing.Any = option(None, "Jaakkola variational parameters (bound='jaakkola'): a scalar for every site or one "
                                  "per observed site entry, (N,) in site order (default: at the prior marginals)")
    refine: typing.Optional[bool] = option(
        None, "polish q by natural-gradient (CVI) steps with exact expectations to the exact variational-Gaussian "
              "optimum; None: only when a site's local bound is a surrogate (Laplace likelihoods), where it is "
              "required")

    def check(self):
        if self.xi is not None and self.bound != "jaakkola":  # the other bounds have no xi: it was ignored
            raise ValueError(f"option 'xi' (the Jaakkola bound's variational parameters) needs bound='jaakkola'; "
                             f"bound={self.bound!r} has none")
        if self.newton_solver != "auto" and self.method != "newton":
            raise ValueError(f"option 'newton_solver' sets how method='newton' solves its systems; method="
                             f"{self.method!r} has none")


class DualVGEngine(Engine):
    r"""The ``dual_vg`` engine: the convex Fenchel dual of the variational-Gaussian bound (Khan et al. 2013).

    Builds the storage form of the dual that fits the model (``N x N`` site space, ``L x L`` latent
    space, or a banded GMRF precision; :func:`build_dual_problem`), minimises the reduced dual with
    :func:`~.optim.solve_dual`, recovers ``q = N(m*, V*)`` (Khan et al. 2013, Eqs. 17-18) and reports
    the exact variational-Gaussian bound of that ``q`` (closed-form or Gauss-Hermite site
    expectations; never ``-g``), with the duality gap of every iteration in the history.

    Convergence: the duality gap ``g(alpha) - ELBO_LVB`` (a sum of Fenchel-Young residuals, in nats)
    ``<= gap_tol``.

    :meth:`run` returns an :class:`~pyro_convexvb.InferenceResult` whose ``state`` is a
    :class:`DualState` (``alpha``, ``lam``, ``form``, the dual problem; ``init=`` resumes from it) and
    whose ``info`` holds ``gap``, ``dual_objective``, ``lvb_elbo`` (the local bound's own ELBO),
    ``site_mean``/``site_var``, ``iterations`` and ``form``.

    Example::

        >>> import torch
        >>> from pyro_convexvb import LatentGaussianModel
        >>> from pyro_convexvb.lgm.sites import Poisson
        >>> X = torch.randn(30, 3, dtype=torch.float64)
        >>> y = torch.poisson(torch.exp(X @ torch.tensor([.3, -.2, .1], dtype=torch.float64)))
        >>> res = DualVGEngine(LatentGaussianModel.from_design(X, Poisson(y)), progress=False).run()
        >>> res.converged, res.info["gap"] < 1e-6
        (True, True)
    """

    name = "dual_vg"
    description = ("Dual variational Gaussian (Khan et al. 2013): convex Fenchel dual, Newton/L-BFGS, stops on the "
                   "duality gap")
    Options = DualVGOptions
    State = DualState
    type2 = "outer"
    integrates_hyper = True
    optimality_measure = "duality gap (nats) <= gap_tol"
    distributed = True  # row-sharded data in the L x L form (build_dual_problem)

    @classmethod
    def applies(cls, lgm):
        return dual_vg_applies(lgm)

    def extract(self, *args, **kwargs):
        """The latent Gaussian model; on row-sharded data with a predictor whose Jacobian extraction probed into
        local rows (``pcv.linear(Xs, w) + b``), its designs are marked row-sharded again
        (:func:`~pyro_convexvb.infer.sharded_svi.reshard_lgm`)."""
        from ..sharded_svi import reshard_lgm

        return reshard_lgm(super().extract(*args, **kwargs), args, kwargs)

    def precise_options(self):
        return {"gap_tol": 1e-9}

    # ------------------------------------------------------------------ type-II maximum likelihood
    def type2_value(self, result):
        """The dual's own bound: the local-bound ELBO at the dual optimum (``max_q ELBO_LVB``); for a refined fit the
        exact VG bound it reports (the optimum of that bound over ``q``)."""
        return float(result.log_evidence_bound if result.info.get("refine") else result.info["lvb_elbo"])

    def type2_gradient(self, params, x, result, args, kwargs, h):
        """Envelope theorem (Khan et al. 2013, §5): ``d/dtheta ELBO_LVB(q*; theta)`` at the fixed ``q*``
        (:meth:`DualState.bound_at`)."""
        from ..type2 import envelope_gradient

        if result.posterior.n > DENSE_LIMIT or result.info.get("refine"):  # refined: q* is not the LVB's optimum
            return super().type2_gradient(params, x, result, args, kwargs, h)
        return envelope_gradient(params, x, self.model, args, kwargs, result.state.bound_at, h, autograd=True)

    def envelope_bound(self, result, lgm):
        """``ELBO_LVB(q*; theta)`` (:meth:`DualState.bound_at`) when it is the reported bound's envelope: every
        site's local bound is exact (``-E log p`` itself: Poisson, Gaussian, stochastic volatility), so ``q*``
        maximises the reported exact VG bound too and ``dB/dtheta = dELBO_LVB(q*; theta)/dtheta`` (Khan et al.
        2013, §5); ``None`` for a refined fit, a block (vector-site) or Jaakkola fit, a posterior above
        :data:`ENVELOPE_MAX_N` coordinates (where differences of fits are cheaper) or any inexact local bound
        (e.g. Bernoulli's, whose LVB lies below the reported bound)."""
        st = result.state
        if not isinstance(st, DualState) or st.form == "block" or st.bound == "jaakkola" \
                or result.info.get("refine") or result.posterior.n > min(DENSE_LIMIT, ENVELOPE_MAX_N) \
                or sharded_design(lgm.design())[1] is not None:
            return None
        if any(g.family.vector_site or not make_bound(g.family, st.bound, None).exact for g in lgm.sites):
            return None
        return st.bound_at(lgm)

    def initial_alpha(self, lgm, num_sites):
        """``alpha`` the fit starts from: ``init.alpha``, else option ``alpha0``, else ``None`` (checked)."""
        o = self.options
        if self.init is not None and o.alpha0 is not None:
            raise ValueError(f"engine '{self.name}': give init or option 'alpha0', not both")
        if self.init is None and o.alpha0 is None:
            return None
        alpha, name = (self.init.alpha, "init.alpha") if o.alpha0 is None else (o.alpha0, "option 'alpha0'")
        alpha = _as_real_tensor(alpha, f"engine '{self.name}': {name}", f"a ({num_sites},) tensor of real numbers",
                                lgm.dtype, lgm.device)
        if alpha.shape != (num_sites,) or not bool(torch.isfinite(alpha).all()):
            raise ValueError(f"engine '{self.name}': {name} must be a finite vector of one dual variable per observed "
                             f"site entry, shape ({num_sites},); got shape {tuple(alpha.shape)}"
                             + ("" if alpha.shape != (num_sites,) else " with non-finite entries"))
        return alpha

    def solve(self, lgm, run):
        o = self.options
        if any(g.family.vector_site for g in lgm.sites):
            err = dual_vg_applies(lgm)
            if err is not None:
                raise err
            return self._solve_block(lgm, run)
        reuse = getattr(self.init, "structure", None)
        backend, lb, form = build_dual_problem(lgm, o.bound, o.form, o.xi, reuse=reuse)
        bar = run.bar(unit="iter")

        def callback(alpha, val, gap):
            bar.update(1)
            bar.set_postfix(gap=f"{gap:.3g}")

        try:
            sol = solve_dual(backend, lb, self.initial_alpha(lgm, len(lb)), method=o.method, gap_tol=o.gap_tol,
                             max_iter=o.max_iter, history=run.history, on_fail="ignore",
                             newton_solver=o.newton_solver, callback=callback)
        except torch.linalg.LinAlgError as e:
            raise NotPositiveDefiniteError(f"dual_vg: {e}. {FAR_START}") from None
        if not (math.isfinite(sol.gap) and bool(torch.isfinite(sol.alpha).all())):
            # the iteration left the conjugate's domain (its posterior means of 1e17 are no answer to report)
            raise NotPositiveDefiniteError(f"dual_vg: the dual iteration diverged (duality gap {sol.gap}). "
                                           f"{FAR_START}")
        alpha, lam = sol.alpha, sol.lam
        info = {}
        refine = self._refine(lgm, lb)
        if refine:
            alpha, lam, _, rit, rconv, resid = refine_exact(backend, lb, alpha, lam, tol=1e-15,
                                                             residual_tol=REFINE_RESIDUAL_TOL, return_residual=True)
            info.update(refine_iterations=rit, refine_converged=rconv, refine_residual=resid)
        terms = backend.evaluate(alpha, lam)
        bound_value = float(exact_elbo(backend, lb, alpha, lam, terms, lgm.log_const))
        posterior = backend.posterior(alpha, lam)
        posterior.layout = lgm.layout
        info.update(gap=sol.gap, dual_objective=sol.g, lvb_elbo=sol.g - sol.gap + lgm.log_const,
                    site_mean=terms.m_tilde, site_var=terms.v_tilde, iterations=sol.iterations,
                    evaluations=sol.evaluations, cg_iterations=sol.cg_iterations, form=form, bound=o.bound,
                    method=o.method, refine=refine)
        opt = Optimality.single("duality gap (nats)", sol.gap, sol.gap_tol)
        if refine:  # the returned q is the refined one: judged by the exact VG fixed point as well
            opt = Optimality(opt.criteria + (Criterion("exact-VG fixed-point residual (relative change of the site natural parameters)",
                                                       info["refine_residual"], REFINE_RESIDUAL_TOL),))
        reason = sol.stop_reason
        if refine:  # the refinement decides what is returned: its own stopping rule is part of the reason
            how = ("reached" if info["refine_converged"] else "stopped short of")
            reason = (f"{reason}; refinement: {info['refine_iterations']} CVI steps {how} the exact-VG fixed point "
                      f"(residual {info['refine_residual']:.2g}, tolerance {REFINE_RESIDUAL_TOL:.0e})")
        state = DualState(alpha, lam, form, backend, o.bound, o.xi, posterior)
        return Solution(posterior, bound_value, opt, reason, info, state=state)

    def _refine(self, lgm, lb):
        """Whether the dual's Gaussian is refined to the exact VG optimum (option ``refine``; ``None``: when a site's
        local bound is only a surrogate, :attr:`~pyro_convexvb.lgm.families.bound.LocalBound.surrogate`)."""
        o = self.options
        surrogate = [g for g, b in zip(lgm.sites, lb.split()) if b.surrogate]
        if not surrogate:
            return bool(o.refine)
        g = surrogate[0]
        if o.refine is False:
            raise ValueError(f"engine '{self.name}': option refine=False: site '{g.name}' ({g.family.name}) has no "
                             "exact local bound, only a loose surrogate, so its Gaussian must be refined to the exact "
                             "variational-Gaussian optimum; leave refine at None (or True)")
        if sharded_design(lgm.design())[1] is not None:
            raise _sharded_surrogate(g)
        return True

    def _solve_block(self, lgm, run):
        """Vector (Categorical) sites: the reduced block dual of :mod:`.block` in the dense ``L x L`` form."""
        from .block import BlockDualProblem, block_solution, solve_block_dual

        o = self.options
        for name, value, ok in (("form", o.form, ("auto", "latent")), ("newton_solver", o.newton_solver,
                                                                        ("auto", "dense"))):
            if value not in ok:
                raise ValueError(f"engine '{self.name}': option '{name}'={value!r} is not available for vector "
                                 f"(Categorical) sites, which use the dense L x L form; use {name}='auto'")
        if o.refine:
            raise ValueError(f"engine '{self.name}': option 'refine' (CVI steps on scalar sites in the N x N form) is "
                             "not available for vector (Categorical) sites")
        if o.bound not in ("tight", "bohning"):
            raise ValueError(f"engine '{self.name}': option bound={o.bound!r} has no Categorical (softmax) form; use "
                             "bound='tight' (default) or 'bohning'")
        if o.xi is not None:
            raise ValueError(f"engine '{self.name}': option 'xi' (Jaakkola tangent points) does not apply to "
                             "Categorical sites")
        prob = BlockDualProblem(lgm, o.bound)
        alpha0 = self.initial_alpha(lgm, prob.num_rows)
        bar = run.bar(unit="iter")

        def callback(val, gap):
            bar.update(1)
            bar.set_postfix(gap=f"{gap:.3g}")

        sol = solve_block_dual(prob, None if alpha0 is None else prob.from_alpha(alpha0), method=o.method,
                               gap_tol=o.gap_tol, max_iter=o.max_iter, callback=callback, history=run.history)
        posterior, (exact, why), lvb, (alpha, lam) = block_solution(prob, sol)
        posterior.layout = lgm.layout
        bound_value = exact if exact is not None else lvb
        info = dict(gap=sol.gap, dual_objective=sol.g, lvb_elbo=lvb, iterations=sol.iterations,
                    evaluations=sol.evaluations, form="block", bound=o.bound, method=o.method, refine=False,
                    reported_bound="exact" if exact is not None else f"local bound ({why})")
        opt = Optimality.single("duality gap (nats)", sol.gap, sol.gap_tol)
        state = DualState(alpha, lam, "block", None, o.bound, None, posterior)
        return Solution(posterior, bound_value, opt, "duality gap" if sol.converged else "max_iter", info,
                        state=state)


def fit_dual_vg(lgm, progress=True, **options):
    """``DualVGEngine(lgm, progress=progress, **options).run()``: the ``dual_vg`` engine on a latent Gaussian model."""
    return DualVGEngine(lgm, progress=progress, **options).run()


def site_space_predictive(result, K_cross, k_test_diag, prior_mean_test=0.0):
    """Latent predictive ``(mean (m,), var (m,))`` at test inputs of a site-form ``dual_vg`` fit of a GP:
    :meth:`DualState.site_predictive` of ``result.state``."""
    if not isinstance(result.state, DualState):
        raise ValueError("site_space_predictive needs a dual_vg result in the N x N site form with an identity "
                         "design (a GP over the training inputs)")
    return result.state.site_predictive(K_cross, k_test_diag, prior_mean_test)
