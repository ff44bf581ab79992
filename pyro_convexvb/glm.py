"""Bayesian generalised linear models with a mixture-of-diagonal-Gaussians posterior (Steinberg et al. 2017, §1.3).

    y_n ~ p(y_n | g(phi(x_n)^T w), gamma),   w ~ N(0, lambda I_D)            (Eqs. 19-20)

trained by SVI on :class:`~pyro_convexvb.infer.diag_mixture.DiagMixtureELBO` with mini-batches
(Eqs. 5-6, 21-27), learning ``lambda``, the Gaussian noise and the basis hyperparameters along
with ``q(w) = (1/K) sum_k N(m_k, diag psi_k)``.  Predictions follow Eqs. (29)-(31).

:class:`GLM` is a scikit-learn estimator whose type follows the likelihood: a binary classifier for
``"bernoulli"`` (labels ``classes_``, ``predict_proba``), a regressor otherwise.
"""
import contextlib
from numbers import Integral

import numpy as np
import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.distributions import constraints
from sklearn.base import BaseEstimator
from sklearn.utils import ClassifierTags, RegressorTags
from sklearn.utils._param_validation import StrOptions
from sklearn.utils.metaestimators import available_if
from sklearn.utils.validation import check_is_fitted

from .estimator_base import (NONNEGATIVE, NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, CompactPickleMixin,
                             NumberInterval, binary_targets, check_sample_weight, classifier_outputs,
                             deprecated_alias, design_matrix, fit_context, float_copy, mixture_log_probs, renamed,
                             positive_rows, seed_from, sklearn_input, unsharded_weight, validate_dense, warn_unused)
from .lgm.linear import linear
from .lgm.sites import gauss_hermite

__all__ = ["GLM"]

_LIKELIHOODS = ("bernoulli", "gaussian", "poisson", "binomial")


def _is_classifier(glm):
    return glm.likelihood == "bernoulli"


#: plateaus of the SVI loss met by cutting Adam's learning rate by 5 before one stops a GLM fit: with one cut (the
#: engines' default) every default fit of 15 small Gaussian, Poisson and Bernoulli problems stopped with a
#: natural-gradient decrement just above its 0.01-nat test, with three 14 of 15 passed it, for a third more steps
GLM_LR_CUTS = 3


class GLM(CompactPickleMixin, BaseEstimator):
    """Bayesian GLM estimator (revrand's ``GeneralizedLinearModel``) with the scikit-learn API.

    With ``likelihood="bernoulli"`` it is a binary classifier (scikit-learn's estimator type
    ``"classifier"``): labels are any two values (``classes_``), :meth:`predict` returns labels,
    :meth:`predict_proba` the predictive probabilities (Eq. 29), :meth:`decision_function` the
    predictive log-odds, and ``score`` is the accuracy.  Other likelihoods make it a regressor:
    :meth:`predict` is the predictive expectation (Eq. 29) and ``score`` is ``R^2``.  ``X`` may be
    NumPy, pandas, SciPy sparse (densified: the model uses a dense design) or torch; computations
    are in float64 and outputs are NumPy arrays.

    :param str likelihood: ``"bernoulli"`` (logit link), ``"gaussian"`` (identity), ``"poisson"``
        (log link) or ``"binomial"`` (logit link, ``n_trials`` per row).
    :param basis: ``None`` (linear), a callable ``X -> Phi`` on float64 torch tensors or a
        :class:`torch.nn.Module` such as :class:`~pyro_convexvb.gp.RandomFourierFeatures` (parameters
        learned when ``learn_basis``, on a float64 copy ``basis_``; the module passed in is never
        modified).
    :param int num_components: ``K`` mixture components of ``q(w)``.
    :param int batch_size: mini-batch size ``M`` (``None``, or ``M >= N``: full batch).
    :param float prior_var: initial ``lambda`` (learned when ``learn_prior_var``).
    :param bool learn_prior_var: learn ``lambda`` along with ``q(w)`` (type-II maximum likelihood on the ELBO);
        else it stays at ``prior_var``.
    :param float noise_var: initial Gaussian noise variance (learned when ``learn_noise``); ``"gaussian"`` only.
    :param bool learn_noise: learn the Gaussian noise variance; else it stays at ``noise_var``. ``"gaussian"``
        only: a ``noise_var`` or ``learn_noise`` other than the default with another likelihood is unused and
        warned of (``UserWarning``).
    :param n_trials: default binomial number of trials: one count, or one per training row (then used by ``fit``
        only; the prediction methods refuse to guess and need their own ``n_trials=``). ``fit`` and the prediction
        methods take an ``n_trials`` argument (one count or one per row of their ``X``) that replaces it.
        ``"binomial"`` only: a value other than the default with another likelihood is warned of, and an
        ``n_trials`` argument is refused (``ValueError``).
    :param bool learn_basis: learn the basis module's parameters (a :class:`torch.nn.Module` basis with
        trainable parameters); else the design ``Phi`` is computed once and fixed.  ``learn_basis=False`` with a
        basis that is not a :class:`torch.nn.Module` (``None``, a function) is unused and warned of.
    :param bool fit_intercept: append a ones column to ``Phi``.
    :param int num_particles: samples per component per step (``L``).
    :param str entropy: entropy bound, ``"eq24"`` (Steinberg et al. 2017) or ``"bhattacharyya"``.
    :param float lr: Adam learning rate.
    :param int max_iter: SVI step limit (the engine's ``max_steps``); the plateau rule of ``diag_mixture`` stops
        earlier.
    :param int min_steps: no plateau stop before this many steps.
    :param int window: steps per window of the plateau rule.
    :param float tol: relative decrease of the windowed loss below which SVI has plateaued (the engine's ``rtol``);
        the first three plateaus cut the learning rate by 5, the fourth stops the fit (:data:`GLM_LR_CUTS`).
        A window whose mean rises by the SVI noise counts as a plateau too, so a ``tol`` below that noise stops where
        the default does; the cuts are what take the fit below it.
    :param float init_scale: initial posterior scale.
    :param random_state: an int (fits are reproducible; default 0), a :class:`numpy.random.RandomState` (a seed
        is drawn from it) or ``None`` (the global torch RNG): the seed of the SVI draws.
    :param bool progress: show a progress bar.
    :param bool distributed: ``X``, ``y`` are this rank's rows of data spread over the ranks of an initialised
        ``torch.distributed`` process group (``torchrun``): the fit (``diag_mixture`` with its gradients
        all-reduced over ranks) gives every rank the posterior and hyperparameters of the fit on all rows;
        predictions stay local. Needs full batches (``batch_size=None``) and a fixed basis (no trainable
        ``basis`` parameters). Without a process group (or with one rank) it fits the rows given
        (docs/distributed.md).
    :param max_steps: deprecated name of ``max_iter`` (``FutureWarning``).
    :param rtol: deprecated name of ``tol`` (``FutureWarning``).
    :param seed: deprecated name of ``random_state`` (``FutureWarning``).

    Fitted attributes: ``posterior_`` (:class:`~pyro_convexvb.infer.diag_mixture.DiagMixturePosterior`
    over ``w``), ``prior_var_``, ``noise_var_`` (gaussian), ``classes_`` (bernoulli), ``result_`` (the
    :class:`~pyro_convexvb.InferenceResult`), ``n_steps_`` (= ``n_iter_``), ``converged_``,
    ``log_evidence_bound_``, ``n_features_in_``, ``feature_names_in_`` (pandas input).

    Example::

        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> X = rng.normal(size=(300, 2))
        >>> y = np.where(X[:, 0] - X[:, 1] + rng.normal(size=300) > 0, "yes", "no")   # not separable
        >>> glm = GLM("bernoulli", num_components=2).fit(X, y)
        >>> glm.predict_proba(X[:2]).shape, bool(glm.score(X, y) > 0.8), glm.converged_
        ((2, 2), True, True)
    """

    _keep_model_in_pickle = False  # the Pyro model holds the design: pickles keep the posterior's moments only

    _parameter_constraints = {
        "likelihood": [StrOptions(set(_LIKELIHOODS))], "basis": [None, callable], "num_components": POSITIVE_INT,
        "batch_size": POSITIVE_INT + [None], "prior_var": POSITIVE, "learn_prior_var": ["boolean"],
        "noise_var": POSITIVE, "learn_noise": ["boolean"], "n_trials": NONNEGATIVE_INT + ["array-like"],
        "learn_basis": ["boolean"], "fit_intercept": ["boolean"], "num_particles": POSITIVE_INT,
        "entropy": [StrOptions({"eq24", "bhattacharyya"})], "lr": POSITIVE, "max_iter": POSITIVE_INT,
        "min_steps": NONNEGATIVE_INT, "window": POSITIVE_INT, "tol": NONNEGATIVE, "init_scale": POSITIVE,
        "random_state": ["random_state"], "progress": ["boolean"], "distributed": ["boolean"],
        "max_steps": deprecated_alias(POSITIVE_INT), "rtol": deprecated_alias(NONNEGATIVE),
        "seed": deprecated_alias([NumberInterval(Integral, 0, None, closed="left"), None])}

    def __init__(self, likelihood="bernoulli", basis=None, num_components=1, batch_size=None, prior_var=1.0,
                 learn_prior_var=True, noise_var=1.0, learn_noise=True, n_trials=1, learn_basis=True,
                 fit_intercept=True, num_particles=1, entropy="eq24", lr=0.02, max_iter=20000, min_steps=500,
                 window=250, tol=2e-4, init_scale=0.1, random_state=0, progress=False, distributed=False,
                 max_steps="deprecated", rtol="deprecated", seed="deprecated"):
        self.likelihood = likelihood
        self.distributed = distributed
        self.basis = basis
        self.num_components = num_components
        self.batch_size = batch_size
        self.prior_var = prior_var
        self.learn_prior_var = learn_prior_var
        self.noise_var = noise_var
        self.learn_noise = learn_noise
        self.n_trials = n_trials
        self.learn_basis = learn_basis
        self.fit_intercept = fit_intercept
        self.num_particles = num_particles
        self.entropy = entropy
        self.lr = lr
        self.max_iter = max_iter
        self.min_steps = min_steps
        self.window = window
        self.tol = tol
        self.init_scale = init_scale
        self.random_state = random_state
        self.progress = progress
        self.max_steps = max_steps
        self.rtol = rtol
        self.seed = seed

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = True
        tags.target_tags.required = True
        if _is_classifier(self):
            tags.estimator_type = "classifier"
            tags.classifier_tags = ClassifierTags(multi_class=False)
        else:
            tags.estimator_type = "regressor"
            tags.regressor_tags = RegressorTags()
            tags.target_tags.positive_only = self.likelihood in ("poisson", "binomial")
        return tags

    # ------------------------------------------------------------------ the Pyro model
    def _learn_basis(self):
        return self.learn_basis and isinstance(self.basis_, torch.nn.Module) and any(
            p.requires_grad for p in self.basis_.parameters())

    def _trials(self, n_trials, N, like, fitting=False):
        """Binomial trials of ``N`` rows as a ``(N,)`` tensor of ``like``'s dtype and device: ``n_trials`` as passed
        to a method, else the constructor's ``n_trials``; ``None`` for the other likelihoods.

        :raises ValueError: naming ``n_trials``: passed to a method with a likelihood other than ``"binomial"``
            (it would be ignored), neither one count nor ``N`` (one per row of ``X``), or not nonnegative integers;
            or, outside ``fit`` (``fitting=False``), left to the constructor's counts when those are per row (they
            belong to the training rows, whatever the rows of this ``X``).
        """
        if self.likelihood != "binomial":
            if n_trials is not None:
                raise ValueError(f"n_trials: given, but likelihood={self.likelihood!r} has no number of trials "
                                 "(only 'binomial' has); leave n_trials=None")
            return None
        source = "n_trials" if n_trials is not None else "n_trials (the constructor's, GLM(n_trials=...))"
        n = sklearn_input(self.n_trials if n_trials is None else n_trials)
        if n_trials is None and not fitting and np.ndim(n) == 1:
            raise ValueError(f"n_trials: the constructor's counts are one per training row (GLM(n_trials=...) of "
                             f"shape {np.shape(n)}), which fit uses; pass n_trials= (one count or one per row of "
                             f"X) for these {N} rows")
        try:
            n = np.asarray(n, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: expected counts, got {type(n).__name__} ({e})") from None
        if n.ndim > 1 or (n.ndim == 1 and n.shape[0] != N):
            hint = "" if n_trials is not None else " (pass n_trials= for rows other than the training rows)"
            raise ValueError(f"{source}: has shape {n.shape}, but X has {N} rows: give one count, or one per row of "
                             f"X{hint}")
        if not np.all(np.isfinite(n)) or (n < 0).any() or (n != np.round(n)).any():
            raise ValueError(f"{source}: must be nonnegative integers")
        return torch.as_tensor(n, dtype=like.dtype, device=like.device).expand(N)

    def _model(self, X, y=None, n_trials=None, Phi=None, batch=None, weight=None):
        N = X.shape[0]
        dt, dev = X.dtype, X.device
        if self.learn_prior_var:
            lam = pyro.param("prior_var", torch.tensor(float(self.prior_var), dtype=dt, device=dev),
                             constraint=constraints.positive)
        else:
            lam = torch.tensor(float(self.prior_var), dtype=dt, device=dev)
        if self.likelihood == "gaussian":
            if self.learn_noise:
                s2 = pyro.param("noise_var", torch.tensor(float(self.noise_var), dtype=dt, device=dev),
                                constraint=constraints.positive)
            else:
                s2 = torch.tensor(float(self.noise_var), dtype=dt, device=dev)
        if self._learn_basis():
            pyro.module("basis", self.basis_)
        D = self.n_weights_
        w = pyro.sample("w", dist.Normal(torch.zeros(D, dtype=dt, device=dev), lam.sqrt()).to_event(1))
        wl = w if w.dim() == 1 else (w.reshape(w.shape[:-2] + w.shape[-1:]) if w.shape[-2] == 1 else w)
        with pyro.plate("data", N, subsample_size=batch) as idx:
            P = Phi[idx] if Phi is not None else design_matrix(self.basis_, X[idx], self.fit_intercept)
            f = linear(P, wl)
            obs = None if y is None else y[idx]
            # row i's log-likelihood times weight_i
            with contextlib.nullcontext() if weight is None else poutine.scale(scale=weight[idx]):
                self._likelihood(f, obs, s2 if self.likelihood == "gaussian" else None, n_trials, idx)
        return f

    def _likelihood(self, f, obs, s2, n_trials, idx):
        if self.likelihood == "bernoulli":
            pyro.sample("y", dist.Bernoulli(logits=f), obs=obs)
        elif self.likelihood == "gaussian":
            pyro.sample("y", dist.Normal(f, s2.sqrt()), obs=obs)
        elif self.likelihood == "poisson":
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=obs)
        else:
            pyro.sample("y", dist.Binomial(total_count=n_trials[idx], logits=f), obs=obs)

    def _check_y(self, y, n_trials):
        if self.likelihood in ("poisson", "binomial"):
            if (y < 0).any() or (y != torch.round(y)).any():
                raise ValueError(f"y must hold nonnegative integer counts for likelihood='{self.likelihood}'")
        if self.likelihood == "binomial" and (y > n_trials).any():
            raise ValueError("y exceeds n_trials for likelihood='binomial'")

    def _validate_X(self, X, y="no_validation", reset=False):
        extra = {} if isinstance(y, str) else {"y_numeric": not _is_classifier(self)}
        return validate_dense(self, X, y, reset, **extra)

    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y, n_trials=None, sample_weight=None):
        """Fit ``q(w)`` and the hyperparameters by SVI on the mixture ELBO. Returns ``self``.

        :param X: ``(N, d)`` inputs (NumPy, pandas, SciPy sparse, torch).
        :param y: ``(N,)`` targets: two class labels (bernoulli), counts (poisson, binomial) or reals.
        :param n_trials: binomial trials, one count or ``(N,)`` (default ``self.n_trials``); binomial only.
        :param sample_weight: ``(N,)`` nonnegative row weights (default: all one): row ``n``'s log-likelihood is
            multiplied by ``sample_weight[n]`` (``poutine.scale``), so an integer weight is the row repeated that
            many times and a zero weight drops the row.
        """
        from .distributed import row_sharded, sharded_estimator
        from .infer.diag_mixture import DiagMixtureEngine

        max_iter, tol = renamed(self, "max_steps", "max_iter"), renamed(self, "rtol", "tol")
        random_state = renamed(self, "seed", "random_state")
        if self.min_steps > max_iter:
            raise ValueError(f"GLM: min_steps={self.min_steps} exceeds max_iter={max_iter}: no plateau stop could come "
                             "before the cap; lower min_steps or raise max_iter")
        sharded = sharded_estimator(self.distributed, "GLM")
        if sharded and self.batch_size is not None:
            raise ValueError("GLM: distributed=True needs full batches (batch_size=None): mini-batches drawn on each "
                             "rank's rows are not the single-process mini-batches")
        X, y = self._validate_X(X, y, reset=True)
        if _is_classifier(self):
            self.classes_, y = binary_targets(y, distributed=sharded)
        else:
            self.__dict__.pop("classes_", None)
        if self.likelihood != "gaussian":
            warn_unused(self, ("noise_var", "learn_noise"), f"likelihood={self.likelihood!r} has no noise variance")
        if self.likelihood != "binomial":
            warn_unused(self, ("n_trials",), f"likelihood={self.likelihood!r} has no number of trials")
        if not isinstance(self.basis, torch.nn.Module):
            warn_unused(self, ("learn_basis",), "the basis is not a torch.nn.Module: it has no parameters to learn")
        weight = unsharded_weight(check_sample_weight(sample_weight, X.shape[0]), sharded)
        # (N,) for binomial, per-row counts kept with their rows
        trials = self._trials(n_trials, X.shape[0], X, fitting=True)
        weight, X, y, trials = positive_rows(weight, X, np.asarray(y), trials)
        weight = None if weight is None else torch.from_numpy(weight)
        y = torch.from_numpy(np.array(y, dtype=np.float64))
        N = X.shape[0]
        batch = None if self.batch_size is None or self.batch_size >= N else int(self.batch_size)
        self._check_y(y, trials)
        # the basis passed in is never trained: fit works on a float64 copy (basis_)
        self.basis_ = float_copy(self.basis)
        with torch.no_grad():
            self.n_weights_ = design_matrix(self.basis_, X[:2], self.fit_intercept).shape[1]
        if sharded and self._learn_basis():
            raise ValueError("GLM: distributed=True needs a fixed basis: pass learn_basis=False (or a basis without "
                             "trainable parameters)")
        Phi = None if self._learn_basis() else design_matrix(self.basis_, X, self.fit_intercept).detach()

        model = _GLMPyroModel(self, trials, Phi, batch, weight)
        store = pyro.get_param_store()
        with store.scope() as state:
            engine = DiagMixtureEngine(
                model, progress=bool(self.progress), num_components=int(self.num_components),
                num_particles=int(self.num_particles), entropy=self.entropy, lr=self.lr,
                max_steps=int(max_iter), min_steps=self.min_steps, window=self.window, rtol=tol,
                lr_cuts=GLM_LR_CUTS,
                init_scale=self.init_scale, seed=None if random_state is None else seed_from(random_state),
                vectorize_particles=int(self.num_components) * int(self.num_particles) > 1)
            res = engine.run(row_sharded(X) if sharded else X, y=y)
            params = {k: v.detach().clone() for k, v in store.items()}
        self.param_state_ = state
        self.result_ = res
        self.posterior_ = res.posterior
        self.prior_var_ = float(params["prior_var"]) if "prior_var" in params else float(self.prior_var)
        if self.likelihood == "gaussian":
            self.noise_var_ = float(params["noise_var"]) if "noise_var" in params else float(self.noise_var)
        else:  # not a previous gaussian fit's
            self.__dict__.pop("noise_var_", None)
        self.n_steps_ = self.n_iter_ = res.state.steps
        self.converged_ = res.converged
        self.log_evidence_bound_ = res.log_evidence_bound
        return self

    # ------------------------------------------------------------------ prediction
    def _latent(self, X):
        """Per-component means and variances ``(K, M)`` of ``f* = phi*^T w``."""
        check_is_fitted(self, "posterior_")
        X = self._validate_X(X)
        with torch.no_grad():
            Phi = design_matrix(self.basis_, X.to(self.posterior_.dtype), self.fit_intercept)
            return self.posterior_.component_marginals(Phi)

    def _mean(self, X, n_trials=None):
        """Predictive expectation ``E[y*]`` (torch), Eq. (29); for bernoulli ``P(y* = classes_[1])``."""
        M, V = self._latent(X)
        trials = self._trials(n_trials, M.shape[1], M)
        if self.likelihood == "gaussian":
            return M.mean(0)
        if self.likelihood == "poisson":
            return torch.exp(M + 0.5 * V).mean(0)
        x, wts = gauss_hermite(64, M.dtype, M.device)
        p = (torch.sigmoid(M.unsqueeze(-1) + V.clamp_min(0).sqrt().unsqueeze(-1) * x) * wts).sum(-1).mean(0)
        if self.likelihood == "binomial":
            return p * trials
        return p

    def predict(self, X, n_trials=None):
        """Regressors: the predictive expectation ``E[y*]`` -- Steinberg et al. 2017, Eq. (29); bernoulli: labels.

        Evaluated per mixture component on the exact Gaussian marginal of ``f* = phi*^T w``: closed
        form (gaussian, poisson) or 64-point Gauss-Hermite (bernoulli, binomial); no sampling.  For
        ``likelihood="bernoulli"`` the most probable label of ``classes_`` is returned (Eq. (29)
        there is ``predict_proba(X)[:, 1]``).

        :param X: ``(M, d)`` inputs.
        :param n_trials: binomial trials, one count or ``(M,)`` (default ``self.n_trials``); binomial only.
        :returns: NumPy ``(M,)``.
        """
        if _is_classifier(self):
            self._trials(n_trials, 0, None)  # refused: a classifier has no trials
            positive = self.decision_function(X) > 0
            return self.classes_[positive.astype(np.int64)]
        return self._mean(X, n_trials).numpy()

    def _class_outputs(self, X):
        return classifier_outputs(*mixture_log_probs(*self._latent(X), 64))  # (K, M) per component

    @available_if(_is_classifier)
    def predict_proba(self, X):
        """``(M, 2)`` class probabilities (bernoulli); column 1 is Eq. (29), ``P(y* = classes_[1])``."""
        return self._class_outputs(X)[1]

    @available_if(_is_classifier)
    def predict_log_proba(self, X):
        """``(M, 2)`` log class probabilities (bernoulli), from log-sum-exp of the quadrature terms (see
        :meth:`~pyro_convexvb.estimator_base.BinaryPredictiveClassifier.predict_log_proba` for their accuracy)."""
        return self._class_outputs(X)[2]

    @available_if(_is_classifier)
    def decision_function(self, X):
        """``(M,)`` predictive log-odds of ``classes_[1]`` (bernoulli); positive favours it."""
        return self._class_outputs(X)[0]

    def score(self, X, y, sample_weight=None, n_trials=None):
        """Accuracy (bernoulli) or coefficient of determination ``R^2`` of :meth:`predict` (other likelihoods).

        :param n_trials: binomial trials of the rows of ``X`` (one count or ``(M,)``; default ``self.n_trials``):
            the counts ``y`` are compared with ``predict(X, n_trials)``.
        """
        from sklearn.metrics import accuracy_score, r2_score

        if _is_classifier(self):
            return accuracy_score(sklearn_input(y), self.predict(X, n_trials), sample_weight=sample_weight)
        return r2_score(sklearn_input(y), self.predict(X, n_trials), sample_weight=sample_weight)

    def predictive_cdf(self, X, alpha, n_trials=None, num_points=32):
        """``P(y* <= alpha | data)`` per row -- Steinberg et al. 2017, Eq. (30), by quadrature over ``q``.

        For bernoulli, ``y*`` is coded 0/1 (``classes_[0]``/``classes_[1]``).

        :param alpha: one threshold or ``(M,)``.
        :param n_trials: binomial trials, one count or ``(M,)`` (default ``self.n_trials``); binomial only.
        :param int num_points: Gauss-Hermite nodes of the quadrature over ``q``; the ``"gaussian"`` likelihood's CDF is
            closed-form, and a value other than 32 is a ``ValueError`` there.
        :returns: NumPy ``(M,)``.
        """
        if self.likelihood == "gaussian" and num_points != 32:
            raise ValueError(f"num_points={num_points!r}: likelihood='gaussian' has a closed-form predictive CDF and "
                             "no quadrature; num_points applies to the other likelihoods, leave it at 32")
        M, V = self._latent(X)
        trials = self._trials(n_trials, M.shape[1], M)
        alpha = torch.as_tensor(np.asarray(sklearn_input(alpha), dtype=np.float64), dtype=M.dtype, device=M.device)
        if alpha.dim() > 1 or (alpha.dim() == 1 and alpha.shape[0] not in (1, M.shape[1])):
            raise ValueError(f"alpha: has shape {tuple(alpha.shape)}, but X has {M.shape[1]} rows: give one threshold "
                             "or one per row of X")
        return self._cdf(M, V, alpha.expand(M.shape[1:]), trials, num_points).numpy()

    def _cdf(self, M, V, alpha, trials, num_points=32):
        # M, V: (K, rows); alpha: (rows,); trials: (rows,) for binomial -> (rows,)
        if self.likelihood == "gaussian":
            s = (V + self.noise_var_).sqrt()
            return torch.special.ndtr((alpha - M) / s).mean(0)
        x, wts = gauss_hermite(num_points, M.dtype, M.device)
        f = M.unsqueeze(-1) + V.clamp_min(0).sqrt().unsqueeze(-1) * x  # (K, rows, Q)
        a = torch.floor(alpha).unsqueeze(-1)
        if self.likelihood == "bernoulli":
            F = torch.where(a < 0, torch.zeros_like(f), torch.where(a >= 1, torch.ones_like(f), torch.sigmoid(-f)))
        elif self.likelihood == "poisson":
            F = torch.where(a < 0, torch.zeros_like(f), torch.special.gammaincc(a.clamp_min(0) + 1, torch.exp(f)))
        else:
            F = _binomial_cdf(a, trials.unsqueeze(-1), f)
        return (F * wts).sum(-1).mean(0)

    def predict_quantile(self, X, q, n_trials=None):
        """Predictive quantile ``alpha`` with ``P(y* <= alpha) = q`` -- Steinberg et al. 2017, Eq. (31), by root finding.

        Continuous (gaussian): Newton/bisection on the mixture CDF.  Discrete likelihoods: the
        smallest integer ``alpha`` with ``P(y* <= alpha) >= q`` (integer bisection; bernoulli in the
        0/1 coding of ``classes_``).

        :returns: NumPy ``(M,)``.
        """
        from .infer.diag_mixture import mixture_quantiles

        if not 0 < float(q) < 1:
            raise ValueError(f"q must lie in (0, 1), got {q}")
        M, V = self._latent(X)
        trials = self._trials(n_trials, M.shape[1], M)
        if self.likelihood == "gaussian":
            return mixture_quantiles(M, (V + self.noise_var_).sqrt(), [float(q)])[0].numpy()
        rows = M.shape[1]
        lo = torch.full((rows,), -1.0, dtype=M.dtype, device=M.device)  # F(-1) = 0 < q
        if self.likelihood == "bernoulli":
            hi = torch.ones(rows, dtype=M.dtype, device=M.device)
        elif self.likelihood == "binomial":
            hi = trials.clone()
        else:
            hi = torch.ceil(torch.exp(M + 0.5 * V).max(0).values + 10 * torch.exp(M + V).max(0).values.sqrt() + 10)
            for _ in range(60):
                bad = self._cdf(M, V, hi, trials) < q
                if not bad.any():
                    break
                hi = torch.where(bad, 2 * hi, hi)
        while bool((hi - lo > 1).any()):
            mid = torch.floor((lo + hi) / 2)
            ok = self._cdf(M, V, mid, trials) >= q
            move = hi - lo > 1
            hi = torch.where(move & ok, mid, hi)
            lo = torch.where(move & ~ok, mid, lo)
        return hi.numpy()

    def predict_interval(self, X, p=0.95, n_trials=None):
        """Central predictive interval with probability ``p``: quantiles ``(1-p)/2`` and ``(1+p)/2`` (Eqs. 30-31).

        :returns: ``(lower (M,), upper (M,))``, NumPy arrays.
        """
        if not 0 < float(p) < 1:
            raise ValueError(f"p must lie in (0, 1), got {p}")
        return (self.predict_quantile(X, (1 - p) / 2, n_trials), self.predict_quantile(X, (1 + p) / 2, n_trials))


class _GLMPyroModel:
    """The Pyro model of a fitted :class:`GLM` (a picklable callable ``model(X, y=None)``)."""

    def __init__(self, glm, trials, Phi, batch, weight=None):
        self.glm, self.trials, self.Phi, self.batch, self.weight = glm, trials, Phi, batch, weight

    def __call__(self, X, y=None):
        return self.glm._model(X, y, self.trials, self.Phi, self.batch, self.weight)


def _binomial_cdf(a, n, f):
    """``P(Y <= a)`` for ``Y ~ Binomial(n, sigmoid(f))`` (``a`` integer-valued), by summing the pmf."""
    n_max = int(n.max())
    k = torch.arange(n_max + 1, dtype=f.dtype, device=f.device)
    logp, log1mp = torch.nn.functional.logsigmoid(f).unsqueeze(-1), torch.nn.functional.logsigmoid(-f).unsqueeze(-1)
    nn = n.unsqueeze(-1)
    valid = k <= nn
    kk = torch.where(valid, k, torch.zeros_like(k))
    logpmf = (torch.lgamma(nn + 1) - torch.lgamma(kk + 1) - torch.lgamma((nn - kk).clamp_min(0) + 1)
              + kk * logp + (nn - kk) * log1mp)
    pmf = torch.where(valid & (k <= a.unsqueeze(-1)), logpmf.exp(), torch.zeros_like(logpmf))
    return pmf.sum(-1).clamp(0, 1)
