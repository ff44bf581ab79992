r"""Sequential Bayesian design of Cartesian k-space columns ("phase encodes") for real images (Seeger 2010 §5;
the design loop of Seeger, Nickisch, Pohmann & Schölkopf 2009).

Each step refits the convex variational relaxation of the sparse linear model
(:func:`~pyro_convexvb.design.imaging.compressive_sensing_model`) for the current columns, warm-started from the
previous step's state (``gamma``, site variances ``z``, mean ``u``, ``log|A|``), then scores every remaining
candidate column by ``Delta_c = log|I + X_c Cov_Q X_c^T / sigma^2|`` (Seeger 2010 §2.2) from the covariance factor
of the fit's own Lanczos run by FFTs (:func:`~pyro_convexvb.design.imaging.phase_encode_scores`: no linear solve per
candidate, memory ``O(n K)``) and adds the best.

**Conjugate-symmetric columns.** For a real image, column ``W - c`` of the 2-D DFT is the complex conjugate of
column ``c`` with its rows reversed. A candidate is therefore a *pair* ``{c, W - c}``, indexed by
``c = 0 .. W/2`` (:func:`pair_candidates`); measuring ``c`` (``2H`` real numbers, each with noise ``sigma^2``)
determines column ``W - c`` too. ``c = 0`` and ``c = W/2`` are their own mirror. :func:`known_columns` counts the
k-space columns a design determines: 2 per pair, 1 for ``c = 0`` and ``c = W/2``; this is the "number of
columns" of Seeger 2010 Figure 2 here. The start design ``c = 0 .. 16`` (:func:`lowpass_pairs`) determines the
33 columns ``-16 .. 16``, which contain the central 32 (Seeger 2010 footnote 4); each design step adds 2 columns.

Variance methods (Seeger 2010 §3, §5): ``"lanczos"`` (K-Lanczos with ``K_var`` steps for the double loop's
variances and the first ``K_score <= K_var`` of the same run for the scores), ``"pca"`` (L-PCA: ``L`` smallest Ritz
pairs of a ``6L``-step run, Seeger 2010 footnote 5, for both) and ``"exact"`` (dense Cholesky, small images).
"""
import time
import warnings
from dataclasses import dataclass, field

import torch

from ..errors import ConvergenceWarning
from ..infer.convex_relaxation import ConvexVariationalRelaxation
from .imaging import _check_shape, _index_list, compressive_sensing_model, covariance_factor, phase_encode_scores
from .scores import positive_number

__all__ = ["pair_candidates", "known_columns", "lowpass_pairs", "DesignHistory", "PER_STEP_FIELDS",
           "SequentialPhaseEncodeDesign"]

_METHODS = ("lanczos", "pca", "exact")
#: Lanczos steps ``K_var`` of every variance update when ``variance="lanczos"`` and ``k_var`` is not given
DEFAULT_K_VAR = 200


def pair_candidates(W):
    """Candidate conjugate pairs of a real ``W``-column image: ``[0, 1, ..., W // 2]``; ``c`` stands for ``{c, W - c}``.

    Example::

        >>> pair_candidates(8)
        [0, 1, 2, 3, 4]
    """
    _check_shape(2, W)
    return list(range(W // 2 + 1))


def _pair_indices(pairs, W, name="pairs"):
    """``pairs`` as a list of distinct ints in ``[0, W/2]``; a non-integral entry (1.5 was truncated to 1) or an
    index out of range raises naming ``name``."""
    out = _index_list(pairs, name)
    if len(set(out)) != len(out) or any(c < 0 or c > W // 2 for c in out):
        raise ValueError(f"{name}: expected distinct pair indices in [0, {W // 2}]")
    return out


def known_columns(pairs, W):
    """Number of k-space columns determined by the measured pairs ``pairs`` (2 per pair, 1 for ``0`` and ``W/2``).

    Example::

        >>> known_columns([0, 1, 2], 8), known_columns([4], 8)
        (5, 1)
    """
    _check_shape(2, W)
    return sum(1 if c == 0 or 2 * c == W else 2 for c in _pair_indices(pairs, W))


def lowpass_pairs(W, central=32):
    """The low-pass start design: pairs ``0 .. central // 2``, the smallest pair design containing the ``central``
    central columns ``-central/2 .. central/2 - 1`` (Seeger 2010 footnote 4; it determines ``central + 1`` columns
    for even ``central < W``).

    Example::

        >>> lowpass_pairs(256)[-1], known_columns(lowpass_pairs(256), 256)
        (16, 33)
    """
    _check_shape(2, W)
    if isinstance(central, bool) or not isinstance(central, int) or not 1 <= central <= W:
        raise ValueError(f"central: expected an integer in [1, {W}], got {central!r}")
    return list(range(min(central // 2, W // 2) + 1))


@dataclass
class DesignHistory:
    """Outcome of :meth:`SequentialPhaseEncodeDesign.run`.

    :ivar start: the start pairs.
    :ivar added: pairs added, in order (``len = num_steps``).
    :ivar best_scores: ``Delta`` of each added pair at its step.
    :ivar scores: per step, ``{pair: Delta}`` over all remaining candidates.
    :ivar seconds_inference: per step, wall seconds of the refit (double loop) that preceded the choice.
    :ivar seconds_scoring: per step, wall seconds of the covariance factor and the FFT scores.
    :ivar inner_seconds, outer_seconds: per step, the engine's own split of the refit (inner loops, variance steps).
    :ivar newton_steps, cg_iterations: per step, the refit's Newton steps and CG iterations (summed).
    :ivar converged: per step, whether the refit met its tolerances before ``max_outer``.
    :ivar state: the :class:`~pyro_convexvb.infer.convex_relaxation.RelaxationState` (``gamma``, ``z``, ``u``,
        ``logdet``) of the last refit, set after every step: with the lists above, what a run needs to continue
        (``run(..., resume=history)``).
    :ivar settings: the design's settings (image size, noise, scales, variance method and ranks, seed, outer
        budgets, engine options): a run resumes only a history of the same settings.
    """

    start: list
    added: list = field(default_factory=list)
    best_scores: list = field(default_factory=list)
    scores: list = field(default_factory=list)
    seconds_inference: list = field(default_factory=list)
    seconds_scoring: list = field(default_factory=list)
    inner_seconds: list = field(default_factory=list)
    outer_seconds: list = field(default_factory=list)
    newton_steps: list = field(default_factory=list)
    cg_iterations: list = field(default_factory=list)
    converged: list = field(default_factory=list)
    state: object = None
    settings: dict = None

    @property
    def columns(self):
        """All measured pairs: ``start + added``."""
        return list(self.start) + list(self.added)


#: the per-step lists of a :class:`DesignHistory` (one entry per added pair): what a checkpoint of a run holds
#: besides its start, state and settings
PER_STEP_FIELDS = ("added", "best_scores", "scores", "seconds_inference", "seconds_scoring", "inner_seconds",
                   "outer_seconds", "newton_steps", "cg_iterations", "converged")


def _resumed(resume, start, rest, num_steps, settings):
    """The history a run continues: a copy of ``resume``'s per-step lists (checked against the run's ``start``,
    remaining candidates ``rest``, ``num_steps`` and the design's ``settings``), or an empty one."""
    if resume is None or not resume.added:
        return DesignHistory(start=start, settings=settings)
    if resume.settings != settings:
        theirs = resume.settings or {}
        diff = sorted(k for k in set(settings) | set(theirs) if theirs.get(k) != settings.get(k))
        raise ValueError(f"resume: the history was made with other design settings ({diff}); a run continues "
                         "only its own design")
    done = [int(c) for c in resume.added]
    if [int(c) for c in resume.start] != start:
        raise ValueError(f"resume: its start pairs {list(resume.start)} are not start {start}")
    if len(done) > num_steps or not set(done) <= set(rest) or len(set(done)) != len(done):
        raise ValueError(f"resume: its {len(done)} added pairs are not distinct candidates outside start, "
                         f"at most num_steps = {num_steps}")
    if resume.state is None:
        raise ValueError("resume: the history has no state (save history.state in the callback)")
    lengths = {f: len(getattr(resume, f)) for f in PER_STEP_FIELDS}
    if set(lengths.values()) != {len(done)}:
        raise ValueError(f"resume: per-step lists of unequal lengths {lengths}")
    return DesignHistory(start=start, settings=settings, **{f: list(getattr(resume, f)) for f in PER_STEP_FIELDS})


class SequentialPhaseEncodeDesign:
    r"""Sequential Bayesian design of k-space column pairs on the convex relaxation (Seeger 2010 §5).

    :param measure: callable ``measure(pairs) -> y`` with the ``(2 H len(pairs),)`` noisy measurements of the
        pairs, ordered as :func:`~pyro_convexvb.design.imaging.fourier_columns_operator`'s rows (the same noise
        draw every time a pair is asked for).
    :param int H: image height; :param int W: image width (powers of 2).
    :param float noise_var: ``sigma^2``; :param float tau_a: wavelet scale; :param float tau_r: difference scale
        (:func:`~pyro_convexvb.design.imaging.compressive_sensing_model`): positive finite numbers (Python, NumPy or
        one-element torch), checked here.
    :param str variance: ``"lanczos"``, ``"pca"`` or ``"exact"``.
    :param int k_var: Lanczos steps ``K_var`` of every variance update (``"lanczos"`` only; default
        :data:`DEFAULT_K_VAR`).
    :param int k_score: Lanczos steps ``K_score <= K_var`` of the scores (default ``K_var``), the first ``K_score``
        vectors of the same run (:func:`~pyro_convexvb.design.imaging.covariance_factor`); at most ``n = H W``,
        the most steps a run can take (``K_var`` above ``n`` runs ``n``).
    :param int pca_rank: ``L`` of L-PCA (``"pca"``), with ``6 L`` Lanczos steps (Seeger 2010 footnote 5).
    :param int init_outer: outer iterations of the cold fit of the start design.
    :param int refit_outer: outer iterations per step; the first one reuses the previous step's variances
        (``z_init``), so ``refit_outer = 1`` is one inner loop and one Lanczos run per step.
    :param int seed: seeds the Lanczos start vectors (step ``t`` uses ``seed * 1000003 + t``): designs are
        reproducible from it.
    :param dict engine_options: further options of
        :class:`~pyro_convexvb.infer.convex_relaxation.ConvexVariationalRelaxation` (e.g. ``cg_tol``,
        ``max_newton``); the options set here may not be repeated.
    :param bool progress: tqdm bar over design steps.

    Example::

        >>> import torch
        >>> from pyro_convexvb.design.imaging import fourier_columns_operator
        >>> u = torch.rand(8, 8, dtype=torch.float64).reshape(-1)
        >>> measure = lambda pairs: fourier_columns_operator(8, 8, pairs).mv(u)
        >>> d = SequentialPhaseEncodeDesign(measure, 8, 8, 1e-3, 0.08, 0.16, variance="exact", progress=False)
        >>> h = d.run([0, 1], 2)
        >>> len(h.added), sorted(h.columns) == sorted(set(h.columns))
        (2, True)
    """

    def __init__(self, measure, H, W, noise_var, tau_a, tau_r, *, variance="lanczos", k_var=None, k_score=None,
                 pca_rank=None, init_outer=3, refit_outer=1, seed=0, engine_options=None, progress=True):
        _check_shape(H, W, pow2=True)
        if not callable(measure):
            raise TypeError("measure: expected a callable pairs -> measurements")
        noise_var, tau_a, tau_r = (positive_number(v, name) for name, v in (
            ("noise_var", noise_var), ("tau_a", tau_a), ("tau_r", tau_r)))
        if variance not in _METHODS:
            raise ValueError(f"variance: expected one of {_METHODS}, got {variance!r}")
        if k_var is not None and variance != "lanczos":
            raise ValueError(f"k_var: only for variance='lanczos' (got variance={variance!r})")
        k_var = DEFAULT_K_VAR if k_var is None and variance == "lanczos" else k_var
        for name, v, lo in (("init_outer", init_outer, 1), ("refit_outer", refit_outer, 1),
                            ("k_var", 1 if k_var is None else k_var, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}: expected an integer >= {lo}, got {v!r}")
        if k_score is not None:
            if variance != "lanczos":
                raise ValueError(f"k_score: only for variance='lanczos' (got variance={variance!r})")
            if isinstance(k_score, bool) or not isinstance(k_score, int) or not 1 <= k_score <= k_var:
                raise ValueError(f"k_score: expected an integer in [1, k_var = {k_var}], got {k_score!r}")
            if k_score > H * W:
                raise ValueError(f"k_score: a fit runs at most n = H W = {H * W} Lanczos steps, got {k_score}")
        if variance == "pca":
            if isinstance(pca_rank, bool) or not isinstance(pca_rank, int) or pca_rank < 1:
                raise ValueError(f"pca_rank: variance='pca' needs an integer L >= 1, got {pca_rank!r}")
        elif pca_rank is not None:
            raise ValueError(f"pca_rank: only for variance='pca' (got variance={variance!r})")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: expected a nonnegative integer, got {seed!r}")
        self.engine_options = dict(engine_options or {})
        reserved = {"variance", "lanczos_rank", "pca_rank", "max_outer", "gamma_init", "z_init", "u_init",
                    "logdet_init", "seed", "progress", "init"}
        clash = sorted(reserved & set(self.engine_options))
        if clash:
            raise ValueError(f"engine_options: {clash} are set by the design loop (use its own arguments)")
        self.measure, self.H, self.W = measure, H, W
        self.noise_var, self.tau_a, self.tau_r = noise_var, tau_a, tau_r
        self.variance, self.k_var, self.k_score, self.pca_rank = variance, k_var, k_score, pca_rank
        self.init_outer, self.refit_outer, self.seed, self.progress = init_outer, refit_outer, seed, progress

    # ------------------------------------------------------------------ pieces
    def settings(self):
        """The design's settings as a plain dict (recorded in every :class:`DesignHistory`; the measurements are
        the caller's: a resumed run must be given the same ``measure``)."""
        return dict(H=self.H, W=self.W, noise_var=float(self.noise_var), tau_a=float(self.tau_a),
                    tau_r=float(self.tau_r), variance=self.variance, k_var=self.k_var, k_score=self.k_score,
                    pca_rank=self.pca_rank, init_outer=self.init_outer, refit_outer=self.refit_outer,
                    seed=self.seed, engine_options=dict(self.engine_options))

    def model(self, pairs):
        """The sparse linear model of the pairs ``pairs`` (:func:`~.imaging.compressive_sensing_model`)."""
        y = self.measure(list(pairs))
        if not torch.is_tensor(y) or y.shape != (2 * self.H * len(pairs),):
            raise ValueError(f"measure: expected a ({2 * self.H * len(pairs)},) tensor for {len(pairs)} pairs, got "
                             f"{tuple(y.shape) if torch.is_tensor(y) else type(y).__name__}")
        return compressive_sensing_model(y, self.H, self.W, list(pairs), self.noise_var, self.tau_a, self.tau_r)

    def fit(self, pairs, state=None, step=0):
        """Fit the relaxation for ``pairs``: cold (``init_outer`` outer iterations) or warm from ``state``."""
        if self.variance == "lanczos":
            opts = dict(variance="lanczos", lanczos_rank=self.k_var)
        elif self.variance == "pca":
            opts = dict(variance="pca", lanczos_rank=6 * self.pca_rank, pca_rank=self.pca_rank)
        else:
            opts = dict(variance="exact")
        opts["max_outer"] = self.init_outer if state is None else self.refit_outer
        eng = ConvexVariationalRelaxation(self.model(pairs), seed=self.seed * 1000003 + step, progress=False,
                                          init=state, **opts, **self.engine_options)
        with warnings.catch_warnings():
            # the per-step outer budget is the design loop's (Seeger et al. 2009): stopping at max_outer is expected
            warnings.filterwarnings("ignore", category=ConvergenceWarning,
                                    message=r"engine 'convex_relaxation' did not converge \(stopped by: max_outer\)")
            res = eng.run()
        return res, res.state

    def factor(self, result):
        """The covariance factor the scores use (``K_score`` Lanczos vectors, ``L`` PCA pairs or exact)."""
        if self.variance == "lanczos":
            ran = getattr(getattr(getattr(result, "state", None), "lanczos", None), "k", None)
            if self.k_score is not None and ran is not None and self.k_score > ran:
                raise ValueError(f"k_score: the fit ran only {ran} Lanczos steps, got {self.k_score}")
            return covariance_factor(result, score_steps=self.k_score)
        if self.variance == "pca":
            return covariance_factor(result, pca_rank=self.pca_rank)
        return covariance_factor(result)

    def scores(self, result, candidates):
        """``Delta_c`` of the pairs ``candidates`` at the fit ``result``: ``(len(candidates),)``."""
        return phase_encode_scores(self.factor(result), self.H, self.W, self.noise_var, candidates=candidates)

    # ------------------------------------------------------------------ loop
    def run(self, start, num_steps, candidates=None, callback=None, resume=None):
        """Add ``num_steps`` pairs to ``start`` one at a time.

        :param start: start pairs (e.g. :func:`lowpass_pairs`), distinct, in ``[0, W/2]``.
        :param int num_steps: pairs to add (in all, counting those of ``resume``).
        :param candidates: candidate pairs (default :func:`pair_candidates` minus ``start``).
        :param callback: optional ``callback(history)`` after every step, with ``history.state`` the state of the
            step's refit: a checkpoint to ``resume`` from (e.g. written to disk).
        :param resume: a :class:`DesignHistory` of an interrupted run of this design (same ``start``, candidates
            and settings) as the callback saw it, ``state`` included: the run continues after its last step with
            the same refits, Lanczos seeds and choices as an uninterrupted run (the state is the whole warm start).
        :returns: :class:`DesignHistory`.
        """
        start = _pair_indices(start, self.W, "start")
        if not start:
            raise ValueError("start: expected at least one pair (e.g. lowpass_pairs(W)): the first fit needs "
                             "measurements")
        cand = pair_candidates(self.W) if candidates is None else _pair_indices(candidates, self.W, "candidates")
        rest = [c for c in cand if c not in set(start)]
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or not 0 <= num_steps <= len(rest):
            raise ValueError(f"num_steps: expected an integer in [0, {len(rest)}] (remaining candidates), "
                             f"got {num_steps!r}")
        hist = _resumed(resume, start, rest, num_steps, self.settings())
        first = len(hist.added)
        rest = [c for c in rest if c not in set(hist.added)]
        pairs = list(start) + list(hist.added)
        if first == 0:
            t0 = time.perf_counter()
            res, state = self.fit(pairs, None, 0)
            t_inf = time.perf_counter() - t0
        else:
            state = resume.state
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=num_steps, initial=first, desc=f"design[{self.variance}]", unit="pair", leave=False)
        try:
            for t in range(first, num_steps):
                if t > 0:
                    t0 = time.perf_counter()
                    res, state = self.fit(pairs, state, t)
                    t_inf = time.perf_counter() - t0
                t0 = time.perf_counter()
                d = self.scores(res, rest)
                t_score = time.perf_counter() - t0
                j = int(torch.argmax(d))
                hist.scores.append({int(cc): float(v) for cc, v in zip(rest, d.tolist())})
                c = rest.pop(j)
                pairs.append(c)
                hist.added.append(c)
                hist.best_scores.append(float(d[j]))
                hist.seconds_inference.append(t_inf)
                hist.seconds_scoring.append(t_score)
                work = res.work
                hist.inner_seconds.append(work.inner_seconds)
                hist.outer_seconds.append(work.outer_seconds)
                hist.newton_steps.append(int(work.newton_steps))
                hist.cg_iterations.append(int(work.cg_iterations))
                hist.converged.append(bool(res.converged))
                hist.state = state
                if callback is not None:
                    callback(hist)
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        hist.state = state
        return hist
