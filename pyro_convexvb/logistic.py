"""Bayesian logistic regression as a scikit-learn classifier, and the binary-classification helpers of the estimators.

:class:`BayesianLogisticRegression` is a drop-in for :class:`sklearn.linear_model.LogisticRegression`
(binary problems) that returns a Gaussian posterior over the coefficients from any engine of the
registry, predictive probabilities that integrate over it, and the evidence bound; the prior scale
can be learned by type-II maximum likelihood on the engine's bound.
"""
import math
import numbers

import numpy as np
import pyro
import pyro.distributions as dist
import scipy.sparse as sp
import torch
from pyro.distributions import constraints
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets, type_of_target
from sklearn.utils.validation import check_is_fitted, validate_data

__all__ = ["BayesianLogisticRegression", "binary_targets", "predictive_log_probs", "classifier_outputs"]


def binary_targets(y, distributed=False):
    """Classes and ``{0, 1}`` targets of a binary classification problem.

    :param y: ``(n,)`` labels (any two values; validated by scikit-learn's target checks).
    :param bool distributed: ``y`` holds this rank's rows of row-sharded data: the classes are those of all
        ranks (gathered), so every rank codes its labels alike even when its rows hold one class.
    :returns: ``(classes_ (2,), y01 (n,) float64)``; ``classes_[1]`` is the positive class.
    :raises ValueError: continuous targets ("Unknown label type"), more than two classes ("Only binary
        classification is supported"), or a single class.

    Example::

        >>> binary_targets(["b", "a", "b"])
        (array(['a', 'b'], dtype='<U1'), array([1., 0., 1.]))
    """
    y = np.asarray(y)
    check_classification_targets(y)
    classes = np.unique(y)
    if distributed:
        from .distributed import all_gather_object

        classes = np.unique(np.concatenate([np.asarray(c) for c in all_gather_object(classes)]))
    if classes.shape[0] > 2:
        raise ValueError(f"Only binary classification is supported. The type of the target is "
                         f"{type_of_target(y, input_name='y')}: y holds {classes.shape[0]} classes "
                         f"{classes[:5].tolist()}")
    if classes.shape[0] < 2:
        raise ValueError(f"y: binary classification needs two classes, but y holds one class ({classes[0]!r})")
    return classes, (y == classes[1]).astype(np.float64)


def predictive_log_probs(mean, var, num_points=64):
    """``log E[sigmoid(eta)]`` and ``log E[sigmoid(-eta)]`` for ``eta ~ N(mean, var)``, by Gauss-Hermite.

    The expectations are summed in log space (log-sum-exp over the nodes), so both stay accurate
    when one of them is tiny.  Leading dimensions are kept (e.g. mixture components, which the
    caller averages with :func:`torch.logsumexp` minus ``log K``).

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
    from .lgm.sites import gauss_hermite

    x, w = gauss_hermite(num_points, mean.dtype, mean.device)
    eta = mean.unsqueeze(-1) + var.clamp_min(0).sqrt().unsqueeze(-1) * x
    lw = torch.log(w)
    logsig = torch.nn.functional.logsigmoid
    return torch.logsumexp(lw + logsig(-eta), -1), torch.logsumexp(lw + logsig(eta), -1)


def classifier_outputs(log_p0, log_p1):
    """Decision function, class probabilities and log-probabilities from predictive log-probabilities.

    The decision function is the predictive log-odds ``log p1 - log p0`` (positive favours
    ``classes_[1]``), and the probabilities are its logistic transform, so ``predict``,
    ``predict_proba`` and ``decision_function`` agree exactly.

    :param torch.Tensor log_p0: ``(m,)``.
    :param torch.Tensor log_p1: ``(m,)``.
    :returns: ``(decision (m,), proba (m, 2), log_proba (m, 2))`` as NumPy arrays.
    """
    d = (log_p1 - log_p0).detach()
    logsig = torch.nn.functional.logsigmoid
    log_proba = torch.stack([logsig(-d), logsig(d)], -1)
    return d.cpu().numpy(), log_proba.exp().cpu().numpy(), log_proba.cpu().numpy()


def check_sample_weight(sample_weight, n):
    """Validated per-row weights of ``fit(X, y, sample_weight)``, or ``None`` when they are all one.

    A weight ``w_i`` multiplies row ``i``'s log-likelihood (a ``poutine.scale`` site, :class:`~pyro_convexvb.lgm.sites.Weighted`
    in a latent Gaussian model): an integer weight is the row repeated ``w_i`` times, a zero weight drops it.

    :param sample_weight: ``None``, a number (every row) or an array-like of ``n`` nonnegative finite numbers.
    :param int n: number of rows of ``X``.
    :returns: ``None`` or a float64 ``(n,)`` NumPy array with at least one positive entry.
    :raises ValueError: naming ``sample_weight``: wrong shape or length, negative, NaN or infinite values,
        or all zero.

    Example::

        >>> check_sample_weight([1, 2, 0], 3).tolist()
        [1.0, 2.0, 0.0]
        >>> check_sample_weight(None, 3) is None, check_sample_weight(1.0, 3) is None
        (True, True)
    """
    if sample_weight is None:
        return None
    from .blr import sklearn_input

    sample_weight = sklearn_input(sample_weight)
    try:
        w = np.asarray(sample_weight, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"sample_weight: expected numbers, got {type(sample_weight).__name__} ({e})") from None
    if w.ndim == 0:
        w = np.full(n, float(w))
    if w.ndim != 1 or w.shape[0] != n:
        raise ValueError(f"sample_weight: expected shape ({n},) (one weight per row of X), got {w.shape}")
    if not np.all(np.isfinite(w)):
        bad = np.flatnonzero(~np.isfinite(w))
        raise ValueError(f"sample_weight: {bad.size} values are NaN or infinite (first at row {int(bad[0])}); "
                         "weights must be finite")
    if np.any(w < 0):
        bad = np.flatnonzero(w < 0)
        raise ValueError(f"sample_weight: {bad.size} negative values (first {w[bad[0]]:g} at row {int(bad[0])}); "
                         "weights must be nonnegative")
    if not np.any(w > 0):
        raise ValueError("sample_weight: every weight is zero; at least one row must have a positive weight")
    if np.all(w == 1.0):
        return None
    return w


def compact_result(result, keep_model=True):
    """The part of an estimator's :class:`~pyro_convexvb.InferenceResult` that prediction needs, of model size.

    :meth:`~pyro_convexvb.InferenceResult.compact` (no ``lgm``, no training data, no per-site ``info``); the
    posterior keeps its own covariance factor (``precision_cholesky``, ``(n, n)``, or its Lanczos factors without
    their per-site projections), which its predictions use.  Estimators pickle (and :func:`pyro_convexvb.save`
    stores) this form of ``result_``, so their size does not grow with the number of training rows.
    """
    from .infer.result import InferenceResult

    if not isinstance(result, InferenceResult):
        return result
    out = result.compact(keep_model=keep_model)
    q = result.posterior
    if getattr(q, "precision_cholesky", None) is not None or getattr(q, "lanczos", None) is not None:
        out.posterior.precision_cholesky = q.precision_cholesky
        out.posterior.lanczos = None if q.lanczos is None else compact_lanczos(q.lanczos)
    return out


def compact_lanczos(lz):
    """A Lanczos variance estimate without its per-site projections (``projected_variances``, ``site_prior_var``)."""
    import copy
    import dataclasses

    from .linalg.lanczos import LanczosResult

    if isinstance(lz, LanczosResult):
        return dataclasses.replace(lz, projected_variances=None) if lz.projected_variances is not None else lz
    if hasattr(lz, "form") and hasattr(lz, "result"):  # WhitenedLanczos
        out = copy.copy(lz)
        out.result = compact_lanczos(lz.result)
        out.form = dataclasses.replace(lz.form, site_prior_var=None)
        return out
    return lz


class CompactPickleMixin:
    """Estimators whose pickle keeps :func:`compact_result` of ``result_`` (size independent of the training rows)."""

    _keep_model_in_pickle = True

    def __getstate__(self):
        state = dict(super().__getstate__())  # scikit-learn may return the instance's own __dict__
        if "result_" in state:
            same = state.get("posterior_") is state["result_"].posterior
            state["result_"] = compact_result(state["result_"], keep_model=self._keep_model_in_pickle)
            if same:
                state["posterior_"] = state["result_"].posterior
        return state


# ------------------------------------------------------------------------------------ the estimator
_PREDICT_CHUNK = 2048  # rows per block of predictive marginals (bounds the memory of the variance solves)


def _design(X, fit_intercept):
    """The ``(N, d [+ 1])`` design as a float64 torch tensor: dense, or sparse CSR for SciPy sparse ``X``."""
    from .linalg.operators import to_csr

    if sp.issparse(X):
        X = sp.csr_matrix(X, dtype=np.float64)
        if fit_intercept:
            X = sp.hstack([X, np.ones((X.shape[0], 1))], format="csr")
        X.sort_indices()
        return to_csr(X)
    X = np.asarray(X, dtype=np.float64)
    if fit_intercept:
        X = np.hstack([X, np.ones((X.shape[0], 1))])
    return torch.from_numpy(np.ascontiguousarray(X))


class _LogisticModel:
    """Pyro model of Bayesian logistic regression on a design ``D = [X, 1]`` (picklable).

    ``w ~ N(0, diag(s^2, ..., s^2, s_0^2))``, ``y_i ~ Bernoulli(logits=pcv.linear(D, w)_i)``; with
    ``learn_scale`` the weight scale ``s`` is ``pyro.param("prior_scale")`` (positive), else fixed.
    """

    def __init__(self, num_weights, prior_scale, intercept_scale, fit_intercept, learn_scale):
        self.num_weights = num_weights
        self.prior_scale = float(prior_scale)
        self.intercept_scale = float(intercept_scale)
        self.fit_intercept = fit_intercept
        self.learn_scale = learn_scale

    def __call__(self, design, y=None, weight=None):
        from .lgm.linear import linear

        dt = design.dtype
        if self.learn_scale:
            s = pyro.param("prior_scale", torch.tensor(self.prior_scale, dtype=dt), constraint=constraints.positive)
        else:
            s = torch.tensor(self.prior_scale, dtype=dt)
        scale = s.expand(self.num_weights)
        if self.fit_intercept:
            scale = torch.cat([scale, torch.tensor([self.intercept_scale], dtype=dt)])
        w = pyro.sample("w", dist.Normal(torch.zeros(scale.shape[0], dtype=dt), scale).to_event(1))
        with pyro.plate("data", design.shape[0]):
            if weight is None:
                pyro.sample("y", dist.Bernoulli(logits=linear(design, w)), obs=y)
            else:  # row i's log-likelihood times weight_i
                with pyro.poutine.scale(scale=weight):
                    pyro.sample("y", dist.Bernoulli(logits=linear(design, w)), obs=y)


class BinaryPredictiveClassifier(ClassifierMixin):
    """The prediction methods of a binary classifier whose ``_outputs(X)`` returns
    :func:`classifier_outputs` of its posterior predictive (log-odds, probabilities, log-probabilities)."""

    def _outputs(self, X):
        raise NotImplementedError

    def decision_function(self, X):
        """``(m,)`` predictive log-odds ``log P(classes_[1] | x) - log P(classes_[0] | x)``.

        Positive values favour ``classes_[1]``; the log-odds of the posterior-mean predictor are
        shrunk towards 0 by its predictive variance.
        """
        return self._outputs(X)[0]

    def predict_proba(self, X):
        """``(m, 2)`` posterior predictive class probabilities ``E[sigmoid(+-eta)]`` (Gauss-Hermite)."""
        return self._outputs(X)[1]

    def predict_log_proba(self, X):
        """``(m, 2)`` log predictive probabilities (accurate in the tails)."""
        return self._outputs(X)[2]

    def predict(self, X):
        """``(m,)`` the most probable label of ``classes_``."""
        positive = self.decision_function(X) > 0
        return self.classes_[positive.astype(np.int64)]


class BayesianLogisticRegression(CompactPickleMixin, BinaryPredictiveClassifier, BaseEstimator):
    """Bayesian logistic regression with a Gaussian posterior over the coefficients, as a scikit-learn classifier.

    Model: ``w_j ~ N(0, prior_scale^2)``, intercept ``b ~ N(0, intercept_scale^2)``,
    ``y_i ~ Bernoulli(sigmoid(x_i^T w + b))``.  Any engine of the registry fits it: the engines that
    work on latent Gaussian models (``"dual_vg"``, Khan et al. 2013; ``"convex_relaxation"``,
    Nickisch & Seeger 2009) receive the model built explicitly with
    :meth:`~pyro_convexvb.LatentGaussianModel.from_design`, the others (``"laplace"``, the SVI
    engines, ``"diag_mixture"``, ``"nuts"``) the equivalent Pyro model with :func:`pyro_convexvb.linear`.
    SciPy sparse ``X`` stays sparse throughout (the design becomes a torch sparse CSR operator), so
    rcv1-sized problems fit without densifying.

    ``prior_scale="auto"`` learns the weights' prior scale by type-II maximum likelihood: the model
    is a Pyro model with ``pyro.param("prior_scale")`` and the engine maximises its own evidence
    bound over it (``learn_params``; docs/hyperparameters.md), inside a private param-store scope so
    the user's store is left as it was.

    Predictive probabilities integrate over the posterior: ``P(y = classes_[1] | x) = E[sigmoid(eta)]``
    under the Gaussian marginal of ``eta = x^T w + b``, by Gauss-Hermite quadrature (per component
    for mixture posteriors).

    :param str engine: registry engine name (``pcv.engines()``).
    :param prior_scale: standard deviation of the weights' prior (``> 0``), or ``"auto"``.
    :param bool fit_intercept: add an intercept ``b``.
    :param float intercept_scale: standard deviation of the intercept's prior (``> 0``).
    :param dict options: engine options (``pcv.fit``'s ``options``; e.g. ``{"gap_tol": 1e-10}``).
    :param int num_points: Gauss-Hermite nodes of the predictive probabilities.
    :param bool distributed: ``X``, ``y`` are this rank's rows of data spread over the ranks of an initialised
        ``torch.distributed`` process group (``torchrun``): the design is wrapped with
        :func:`pyro_convexvb.distributed.row_sharded`, the classes are gathered from all ranks, and every rank
        gets the coefficients of the fit on all rows. The engine must fit row-sharded data (``convex_relaxation``,
        ``laplace``, and those whose class sets ``distributed = True``); predictions stay local (each rank predicts
        the rows it is given). Without a process group (or with one rank) it fits the rows given, as with
        ``False`` (docs/distributed.md).

    Fitted attributes (shapes as in :class:`~sklearn.linear_model.LogisticRegression`):
    ``classes_`` ``(2,)``; ``coef_`` ``(1, d)`` and ``intercept_`` ``(1,)`` posterior means;
    ``coef_var_``/``coef_std_`` ``(1, d)`` and ``intercept_var_`` ``(1,)`` posterior variances / standard
    deviations; ``prior_scale_`` (the learned or given scale); ``log_evidence_bound_`` (the engine's
    lower bound on ``log p(y)``, ``None`` for NUTS); ``posterior_`` (over ``[w, b]``); ``result_``
    (the :class:`~pyro_convexvb.InferenceResult`); ``converged_``; ``n_features_in_``;
    ``feature_names_in_`` (pandas input).

    Example::

        >>> from sklearn.datasets import load_breast_cancer
        >>> from sklearn.pipeline import make_pipeline
        >>> from sklearn.preprocessing import StandardScaler
        >>> X, y = load_breast_cancer(return_X_y=True)
        >>> clf = make_pipeline(StandardScaler(), BayesianLogisticRegression(prior_scale=1.0)).fit(X, y)
        >>> blr = clf[-1]
        >>> blr.coef_.shape, blr.coef_std_.shape, clf.predict_proba(X[:2]).shape
        ((1, 30), (1, 30), (2, 2))
        >>> bool(clf.score(X, y) > 0.95)
        True
    """

    def __init__(self, engine="dual_vg", prior_scale=1.0, fit_intercept=True, intercept_scale=10.0, options=None,
                 num_points=64, distributed=False):
        self.engine = engine
        self.distributed = distributed
        self.prior_scale = prior_scale
        self.fit_intercept = fit_intercept
        self.intercept_scale = intercept_scale
        self.options = options
        self.num_points = num_points

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.classifier_tags.multi_class = False
        tags.input_tags.sparse = True
        return tags

    # ------------------------------------------------------------------ validation
    def _check_options(self):
        from .infer.registry import get_engine

        engine = get_engine(self.engine)
        auto = isinstance(self.prior_scale, str) and self.prior_scale == "auto"
        if not auto:
            if isinstance(self.prior_scale, str) or not isinstance(self.prior_scale, numbers.Real) \
                    or not (math.isfinite(self.prior_scale) and self.prior_scale > 0):
                raise ValueError(f"prior_scale: expected a positive number or 'auto', got {self.prior_scale!r}")
        if isinstance(self.intercept_scale, bool) or not isinstance(self.intercept_scale, numbers.Real) \
                or not (math.isfinite(self.intercept_scale) and self.intercept_scale > 0):
            raise ValueError(f"intercept_scale: expected a positive number, got {self.intercept_scale!r}")
        if self.options is not None and not isinstance(self.options, dict):
            raise TypeError(f"options: expected a dict of engine options or None, got {type(self.options).__name__}")
        if isinstance(self.num_points, bool) or not isinstance(self.num_points, numbers.Integral) or self.num_points < 1:
            raise ValueError(f"num_points: expected a positive integer, got {self.num_points!r}")
        options = dict(self.options or {})
        if auto:
            if "learn_params" not in engine.Options.__dataclass_fields__:
                raise ValueError(f"prior_scale='auto' needs an engine with an evidence bound to maximise (type-II "
                                 f"maximum likelihood); engine '{self.engine}' has none")
            if options.get("learn_params", True) is False:
                raise ValueError("options: learn_params=False contradicts prior_scale='auto' (which learns it)")
            options["learn_params"] = True
        return engine, auto, options

    # ------------------------------------------------------------------ fitting
    def fit(self, X, y, sample_weight=None):
        """Fit the posterior over ``[w, b]`` (and the prior scale when ``"auto"``); returns ``self``.

        :param X: ``(n, d)`` array-like: NumPy, pandas, SciPy sparse (kept sparse) or torch.
        :param y: ``(n,)`` binary labels, any two values (``classes_[1]``, the larger, is the positive class).
        :param sample_weight: ``(n,)`` nonnegative row weights (default: all one). Row ``i``'s
            log-likelihood is multiplied by ``sample_weight[i]`` (weighted sites, ``poutine.scale``), so an
            integer weight is the row repeated that many times and a zero weight drops the row; the prior
            is not reweighted. Every engine of the registry takes them, except with ``distributed=True``.
        """
        from .blr import sklearn_input
        from .lgm.model import LatentGaussianModel
        from .lgm.sites import BernoulliLogit, Weighted

        from .distributed import row_sharded, sharded_estimator

        engine, auto, options = self._check_options()
        sharded = sharded_estimator(self.distributed, "BayesianLogisticRegression")
        X, y = validate_data(self, sklearn_input(X), sklearn_input(y), accept_sparse="csr", dtype=np.float64)
        self.classes_, y01 = binary_targets(y, distributed=sharded)
        weight = check_sample_weight(sample_weight, X.shape[0])
        if weight is not None:
            if sharded:
                raise ValueError("sample_weight: not supported with distributed=True (fit on one process, or "
                                 "repeat rows for integer weights)")
            keep = weight > 0  # a zero weight drops the row
            if not keep.all():
                X, y01, weight = X[np.flatnonzero(keep)], y01[keep], weight[keep]
        design = _design(X, self.fit_intercept)
        if sharded:
            design = row_sharded(design)
        yt = torch.from_numpy(y01)
        wt = None if weight is None else torch.from_numpy(weight)
        run_kwargs = {} if wt is None else {"weight": wt}
        d = X.shape[1]
        model = _LogisticModel(d, 1.0 if auto else self.prior_scale, self.intercept_scale, bool(self.fit_intercept),
                               learn_scale=auto)
        if auto or engine.takes != "lgm":
            with pyro.get_param_store().scope():  # the user's param store is left as it was
                res = engine(model, progress=False, **options).run(design, y=yt, **run_kwargs)
        else:
            scale = torch.full((design.shape[1],), float(self.prior_scale), dtype=torch.float64)
            if self.fit_intercept:
                scale[-1] = float(self.intercept_scale)
            family = BernoulliLogit(yt) if wt is None else Weighted(BernoulliLogit(yt), wt)
            lgm = LatentGaussianModel.from_design(design, family, prior_scale=scale, latent_name="w")
            res = engine(lgm, progress=False, **options).run()
        self.result_ = res
        self.posterior_ = res.posterior
        self.prior_scale_ = float(res.hyperparameters["prior_scale"]) if auto else float(self.prior_scale)
        self.log_evidence_bound_ = res.log_evidence_bound
        self.converged_ = bool(res.converged)
        loc = res.posterior.loc.detach().cpu().numpy()
        var = res.posterior.variance.detach().cpu().numpy()
        self.coef_ = loc[None, :d].copy()
        self.coef_var_ = var[None, :d].copy()
        self.coef_std_ = np.sqrt(self.coef_var_)
        self.intercept_ = loc[d:d + 1].copy() if self.fit_intercept else np.zeros(1)
        self.intercept_var_ = var[d:d + 1].copy() if self.fit_intercept else np.zeros(1)
        return self

    # ------------------------------------------------------------------ prediction
    def predictive_moments(self, X):
        """Posterior mean and variance of the linear predictor ``eta = x^T w + b`` at each row of ``X``.

        :param X: ``(m, d)``.
        :returns: NumPy ``(mean (m,), var (m,))``; for mixture posteriors the mixture's moments.
        """
        m, v = self._moments(X)
        if m.dim() == 2:  # mixture components (K, m)
            mean = m.mean(0)
            return mean.numpy(), ((v + m**2).mean(0) - mean**2).clamp_min(0).numpy()
        return m.numpy(), v.numpy()

    def _moments(self, X):
        """``(mean, var)`` of ``eta`` as torch tensors ``(m,)`` (or ``(K, m)`` per mixture component)."""
        from .blr import sklearn_input
        from .linalg.operators import SparseOperator

        check_is_fitted(self, "result_")
        X = validate_data(self, sklearn_input(X), reset=False, accept_sparse="csr", dtype=np.float64)
        design = _design(X, self.fit_intercept)
        q = self.posterior_
        means, variances = [], []
        with torch.no_grad():
            for start in range(0, design.shape[0], _PREDICT_CHUNK):
                stop = min(design.shape[0], start + _PREDICT_CHUNK)
                if design.layout == torch.strided:
                    block = design[start:stop]
                else:
                    block = SparseOperator(design).rows(torch.arange(start, stop))
                if hasattr(q, "component_marginals"):
                    m, v = q.component_marginals(block)
                else:
                    m, v = q.marginals(block)
                means.append(m)
                variances.append(v)
        return torch.cat(means, -1), torch.cat(variances, -1).clamp_min(0)

    def _outputs(self, X):
        m, v = self._moments(X)
        lp0, lp1 = predictive_log_probs(m, v, int(self.num_points))
        if lp0.dim() == 2:  # equally weighted mixture components
            log_k = math.log(lp0.shape[0])
            lp0, lp1 = torch.logsumexp(lp0, 0) - log_k, torch.logsumexp(lp1, 0) - log_k
        return classifier_outputs(lp0, lp1)

