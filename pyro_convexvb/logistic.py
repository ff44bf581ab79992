"""Bayesian logistic regression as a scikit-learn classifier.

:class:`BayesianLogisticRegression` is a drop-in for :class:`sklearn.linear_model.LogisticRegression`
(binary problems) that returns a Gaussian posterior over the coefficients from any engine of the
registry, predictive probabilities that integrate over it, and the evidence bound; the prior scale
can be learned by type-II maximum likelihood on the engine's bound.
"""
import numpy as np
import pyro
import pyro.distributions as dist
import scipy.sparse as sp
import torch
from pyro.distributions import constraints
from sklearn.base import BaseEstimator
from sklearn.utils._param_validation import StrOptions
from sklearn.utils.validation import check_is_fitted, validate_data

from .estimator_base import (NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, BinaryPredictiveClassifier,  # noqa: F401
                             CompactPickleMixin, binary_targets, check_sample_weight,
                             classifier_outputs, compact_lanczos, compact_result, engine_options, fit_context,
                             positive_rows, mixture_log_probs, predictive_log_probs, registered_engine, sklearn_input,
                             unsharded_weight, warn_unused)

__all__ = ["BayesianLogisticRegression", "binary_targets", "predictive_log_probs", "classifier_outputs"]


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
    :param float intercept_scale: standard deviation of the intercept's prior (``> 0``); with
        ``fit_intercept=False`` a value other than the default is unused and warned of (``UserWarning``).
    :param dict options: engine options (``pcv.fit``'s ``options``; e.g. ``{"gap_tol": 1e-10}``).
    :param int num_points: Gauss-Hermite nodes of the predictive probabilities.
    :param bool distributed: ``X``, ``y`` are this rank's rows of data spread over the ranks of an initialised
        ``torch.distributed`` process group (``torchrun``): the design is wrapped with
        :func:`pyro_convexvb.distributed.row_sharded`, the classes are gathered from all ranks, and every rank
        gets the coefficients of the fit on all rows. The engine must fit row-sharded data (``convex_relaxation``,
        ``laplace``, and those whose class sets ``distributed = True``); predictions stay local (each rank predicts
        the rows it is given). Without a process group (or with one rank) it fits the rows given, as with
        ``False`` (docs/distributed.md).
    :param int max_iter: the engine's iteration cap (``max_iter`` of ``dual_vg`` and ``laplace``, ``max_outer`` of
        ``convex_relaxation``, ``max_steps`` of the SVI engines); ``None``: the engine's default. Refused for
        an engine without one (``nuts``).
    :param float tol: the engine's convergence tolerance (``gap_tol`` of ``dual_vg``, ``grad_tol`` of ``laplace``,
        ``phi_tol`` of ``convex_relaxation``, ``rtol`` of the SVI engines); ``None``: the engine's default.
    :param random_state: an int or a :class:`numpy.random.RandomState` seeding the engine's random draws (its
        ``seed`` option: Lanczos probes, SVI, NUTS); ``None``: the engine's default seed. ``dual_vg`` draws no
        random numbers, so its fit is the same for every ``random_state``; nor does ``convex_relaxation`` with exact
        variances (``variance="exact"``, or ``"auto"`` on a small dense problem).

    Fitted attributes (shapes as in :class:`~sklearn.linear_model.LogisticRegression`):
    ``classes_`` ``(2,)``; ``coef_`` ``(1, d)`` and ``intercept_`` ``(1,)`` posterior means;
    ``coef_var_``/``coef_std_`` ``(1, d)`` and ``intercept_var_`` ``(1,)`` posterior variances / standard
    deviations; ``prior_scale_`` (the learned or given scale); ``log_evidence_bound_`` (the engine's
    lower bound on ``log p(y)``, ``None`` for NUTS); ``posterior_`` (over ``[w, b]``); ``result_``
    (the :class:`~pyro_convexvb.InferenceResult`); ``converged_``; ``n_iter_`` (iterations of the outer optimiser, as
    scikit-learn's ``BayesianRidge``: with ``prior_scale="auto"`` the type-II L-BFGS-B iterations over the prior
    scale, at most option ``type2_max_iter``, each refitting the model; else the engine's own iterations, at most
    ``max_iter``; ``result_.iterations`` is the count of the last fit); ``n_features_in_``;
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

    _parameter_constraints = {
        "engine": [str], "prior_scale": POSITIVE + [StrOptions({"auto"})], "fit_intercept": ["boolean"],
        "intercept_scale": POSITIVE, "options": [dict, None], "num_points": POSITIVE_INT, "distributed": ["boolean"],
        "max_iter": NONNEGATIVE_INT + [None], "tol": POSITIVE + [None],
        "random_state": ["random_state"]}

    def __init__(self, engine="dual_vg", prior_scale=1.0, fit_intercept=True, intercept_scale=10.0, options=None,
                 num_points=64, distributed=False, max_iter=None, tol=None, random_state=None):
        self.engine = engine
        self.max_iter = max_iter
        self.tol = tol
        self.random_state = random_state
        self.distributed = distributed
        self.prior_scale = prior_scale
        self.fit_intercept = fit_intercept
        self.intercept_scale = intercept_scale
        self.options = options
        self.num_points = num_points

    # ------------------------------------------------------------------ validation
    def _check_options(self):
        engine = registered_engine(self)
        auto = isinstance(self.prior_scale, str)
        options = engine_options(self, engine, self.options)
        if auto:
            if engine.type2 is None:  # learns no params (nuts: none to learn with, learn_params only holds them)
                raise ValueError(f"prior_scale='auto' needs an engine with an evidence bound to maximise (type-II "
                                 f"maximum likelihood); engine '{self.engine}' has none")
            if options.get("learn_params", True) is False:
                raise ValueError("options: learn_params=False contradicts prior_scale='auto' (which learns it)")
            options["learn_params"] = True
        return engine, auto, options

    # ------------------------------------------------------------------ fitting
    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y, sample_weight=None):
        """Fit the posterior over ``[w, b]`` (and the prior scale when ``"auto"``); returns ``self``.

        :param X: ``(n, d)`` array-like: NumPy, pandas, SciPy sparse (kept sparse) or torch.
        :param y: ``(n,)`` binary labels, any two values (``classes_[1]``, the larger, is the positive class).
        :param sample_weight: ``(n,)`` nonnegative row weights (default: all one). Row ``i``'s
            log-likelihood is multiplied by ``sample_weight[i]`` (weighted sites, ``poutine.scale``), so an
            integer weight is the row repeated that many times and a zero weight drops the row; the prior
            is not reweighted. Every engine of the registry takes them, except with ``distributed=True``.
        """
        from .lgm.model import LatentGaussianModel
        from .lgm.sites import BernoulliLogit, Weighted

        from .distributed import row_sharded, sharded_estimator

        engine, auto, options = self._check_options()
        if not self.fit_intercept:
            warn_unused(self, ("intercept_scale",), "fit_intercept=False fits no intercept")
        sharded = sharded_estimator(self.distributed, "BayesianLogisticRegression")
        X, y = validate_data(self, sklearn_input(X), sklearn_input(y), accept_sparse="csr", dtype=np.float64)
        self.classes_, y01 = binary_targets(y, distributed=sharded)
        weight, X, y01 = positive_rows(unsharded_weight(check_sample_weight(sample_weight, X.shape[0]), sharded),
                                       X, y01)
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
        self.n_iter_ = res.iterations if res.type2_iterations is None else res.type2_iterations
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
        return classifier_outputs(*mixture_log_probs(*self._moments(X), int(self.num_points)))

