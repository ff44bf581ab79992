r"""Scikit-learn GP binary classification with GPyTorch kernels over any applicable engine.

``GPClassifier(kernel, engine="dual_vg")``: latent ``f ~ N(mean, K)`` with ``K = kernel(X)`` (plus
jitter), ``y_n ~ Bernoulli(sigmoid(f_n))``. With ``engine="dual_vg"`` the model goes straight to the
dual (``N x N`` form; Khan et al. 2013) and test predictions use the dual variables,
``mean_* = mu_* - k_*^T alpha`` and ``var_* = k_** - ||R^{-1} Lam^{1/2} k_*||^2`` (Khan et al. 2013,
Eqs. 17-18; docs/dual_vg.md, § Algorithm and recovery), with no inverse of ``K``. Other engines receive the same latent Gaussian model (``takes="lgm"`` engines) or
the equivalent Pyro model (Pyro's engines); predictions then use
:func:`~pyro_convexvb.gp.predict.gp_latent_predictive`. Class probabilities push the latent
predictive through the logistic link by Gauss-Hermite quadrature; for a mixture posterior (``diag_mixture``),
each component's predictive, averaged over the components.
"""
import copy
import math
from numbers import Real

import numpy as np
import torch
from sklearn.base import BaseEstimator
from sklearn.utils._param_validation import Options, StrOptions
from sklearn.utils.validation import check_is_fitted

from ..estimator_base import (NONNEGATIVE, NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, BinaryPredictiveClassifier,
                              binary_targets, check_sample_weight, classifier_outputs, engine_options, fit_context,
                              mixture_log_probs, positive_rows, registered_engine, sklearn_input,
                              validate_dense, warn_unused)
from ..errors import warn
from ..infer.dual_vg import DualState
from ..infer.pyro_engines import LaplaceState
from ..infer.registry import get_engine
from ..lgm.layout import LatentLayout
from ..lgm.model import LatentGaussianModel, PriorBlock, SiteGroup
from ..lgm.sites import BernoulliLogit, Weighted
from ..linalg.operators import DenseOperator, IdentityOperator
from .predict import gp_classification_model, gp_latent_predictive

__all__ = ["GPClassifier", "gp_classification_lgm"]


def gp_classification_lgm(K, y, mean=0.0, weight=None):
    """Explicit :class:`~pyro_convexvb.LatentGaussianModel` of GP classification (latent site ``"f"``).

    :param torch.Tensor K: ``(N, N)`` prior covariance (kernel matrix with jitter).
    :param torch.Tensor y: ``(N,)`` labels in {0, 1}.
    :param torch.Tensor weight: ``(N,)`` positive row weights (:class:`~pyro_convexvb.lgm.sites.Weighted`
        sites) or ``None``.
    """
    N = K.shape[0]
    loc = torch.as_tensor(mean, dtype=K.dtype, device=K.device).expand(N).clone()
    prior = PriorBlock("f", loc, cov=DenseOperator(K))
    layout = LatentLayout.from_shapes([("f", (N,))], [1])
    family = BernoulliLogit(y) if weight is None else Weighted(BernoulliLogit(y), weight)
    site = SiteGroup("y", family, IdentityOperator(N, dtype=K.dtype, device=K.device),
                     torch.zeros(N, dtype=K.dtype, device=K.device), (N,))
    return LatentGaussianModel(layout, [prior], [site])


#: engine options of the type-II loop (used with learn_hyperparameters=True only)
_TYPE2_OPTIONS = frozenset({"learn_params", "type2_max_iter", "type2_gtol"})
_DTYPES = {"float64": torch.float64, "float32": torch.float32, torch.float64: torch.float64,
           torch.float32: torch.float32}


class GPClassifier(BinaryPredictiveClassifier, BaseEstimator):
    r"""Gaussian-process binary classifier (logistic link) over any inference engine of the registry.

    A scikit-learn classifier: ``get_params``/``set_params``, ``clone``, pipelines, grid search and
    calibration work; ``X`` may be NumPy, pandas, SciPy sparse (densified: the kernel needs dense
    inputs) or torch; labels are any two values (``classes_``); outputs are NumPy arrays.

    :param kernel: a ``gpytorch.kernels.Kernel`` (default ``None``: ``ScaleKernel(RBFKernel())`` with
        GPyTorch's initial hyperparameters). It is never modified: :meth:`fit` works on a copy
        (``kernel_``, in ``dtype``), whose hyperparameters are used as they are unless
        ``learn_hyperparameters``. Learned hyperparameters are read from ``kernel_``: ``kernel`` keeps its
        starting values (as scikit-learn's ``GaussianProcessClassifier`` keeps ``kernel`` and fits ``kernel_``).
    :param str engine: registry engine name (default ``"dual_vg"``).
    :param bool learn_hyperparameters: type-II maximum likelihood: maximise the engine's evidence bound
        over the kernel hyperparameters (and the constant mean if ``learn_mean``): the kernel copy is
        registered with ``pyro.module`` in a Pyro model and fitted with the engine's ``learn_params``
        (:mod:`~pyro_convexvb.infer.type2`; envelope-theorem gradients for ``dual_vg`` and
        ``convex_relaxation``, central differences of refits for ``laplace``, each a few Newton steps from the
        previous mode), in a private param-store scope. The fit at the learned values starts from the type-II
        loop's last state (``dual_vg``'s dual variables, ``laplace``'s mode). GPyTorch priors on the kernel's
        hyperparameters (``lengthscale_prior=...``) are added to the objective (a ``pyro.factor``): maximum a
        posteriori type-II. The maximised objective is ``hyper_result_.type2_objective``, the engine's own
        (docs/hyperparameters.md): for ``dual_vg`` the local-bound ELBO at the dual optimum (Khan et al. 2013,
        Eq. 20), which lies below the exact VG bound ``log_evidence_bound_`` reported at the learned values; that
        reported bound is not itself maximised (its gradient there need not vanish).
    :param float mean: constant prior mean (the starting value when it is learned).
    :param bool learn_mean: with ``learn_hyperparameters``, learn the constant mean along with the kernel's
        hyperparameters; else it stays at ``mean``.  Without ``learn_hyperparameters`` nothing is learned, and
        ``learn_mean=False`` is unused and named in a ``UserWarning``.
    :param float jitter: added to the diagonal of ``K``.
    :param dict options: engine options (e.g. ``{"bound": "jensen"}`` for ``dual_vg``).
    :param dict hyper_options: ``{"max_iter": ..., "gtol": ...}``: the engine's ``type2_max_iter`` and
        ``type2_gtol`` options.
    :param int num_points: Gauss-Hermite nodes of the predictive probabilities at latent variances up to 4 (64:
        within 1e-10 of quadrature there); wider latents split the step of the sigmoid off and integrate the rest
        on panels (:func:`~pyro_convexvb.lgm.families.logit.predictive_log_probs`), whatever ``num_points``.
    :param dtype: ``"float64"`` (default) or ``"float32"`` (or the torch dtypes): the precision of the
        computation (with ``learn_hyperparameters``, the type-II loop runs in float64 on the float32 inputs, whose
        bounds are too coarse for its finite differences and line searches; the fit at the learned values runs in
        ``dtype``).
    :param int max_iter: the engine's iteration cap, :class:`~pyro_convexvb.BayesianLogisticRegression`'s mapping
        (``max_iter`` of ``dual_vg``, ``max_outer`` of ``convex_relaxation``, ...); ``None``: the engine's
        default. The type-II loop's cap is ``hyper_options["max_iter"]``.
    :param float tol: the engine's convergence tolerance (``gap_tol`` of ``dual_vg``, ``phi_tol`` of
        ``convex_relaxation``, ...); ``None``: the engine's default.
    :param random_state: an int or a :class:`numpy.random.RandomState` seeding the engine's random draws (its
        ``seed`` option); ``None``: the engine's default. ``dual_vg`` and ``laplace`` draw no random numbers here,
        nor does ``convex_relaxation`` with exact variances (``variance="exact"``, or ``"auto"`` on a small
        problem): their fits are the same for every ``random_state``.

    Learned attributes: ``kernel_`` (the fitted copy of ``kernel``, its parameters without gradients), ``mean_``
    (the prior mean, a float: ``mean``, or its learned value with ``learn_mean``), ``classes_``, ``n_features_in_``,
    ``feature_names_in_`` (pandas input), ``X_train_``, ``y_train_`` (0/1), ``K_train_`` (the kernel matrix with its
    jitter), ``weight_`` (``sample_weight``, or ``None``) as NumPy arrays, ``result_``
    (:class:`~pyro_convexvb.InferenceResult`), ``posterior_``, ``log_evidence_bound_``, ``alpha_``
    (dual variables, ``dual_vg`` only; NumPy), ``hyper_history_``, ``converged_`` (the engine's optimality measure, and with
    ``learn_hyperparameters=True`` the type-II loop's too),
    ``n_iter_`` (iterations of the outer optimiser, as scikit-learn's ``BayesianRidge``: with
    ``learn_hyperparameters=True`` the type-II L-BFGS-B iterations over the hyperparameters, at most
    ``hyper_options["max_iter"]``, each refitting the model; else the engine's own iterations, at most
    ``max_iter``; ``result_.iterations`` is the count of the fit at the learned values); with
    ``learn_hyperparameters=True`` also ``hyper_converged_`` (the
    type-II loop's convergence) and ``hyper_result_`` (its :class:`~pyro_convexvb.InferenceResult`).

    Example::

        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> X = rng.normal(size=(40, 2)); y = np.where(X[:, 0] > 0, "pos", "neg")
        >>> clf = GPClassifier().fit(X, y)
        >>> clf.predict_proba(X[:3]).shape, clf.classes_.tolist()
        ((3, 2), ['neg', 'pos'])
        >>> clf.score(X, y) > 0.8
        True
        >>> import gpytorch
        >>> k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        >>> learned = GPClassifier(kernel=k, learn_hyperparameters=True).fit(X, y)
        >>> learned.kernel_.outputscale.item() != k.outputscale.item()  # the learned values live on kernel_
        True
    """

    _parameter_constraints = {
        "kernel": [torch.nn.Module, None], "engine": [str], "learn_hyperparameters": ["boolean"], "mean": [Real],
        "learn_mean": ["boolean"], "jitter": NONNEGATIVE, "options": [dict, None], "hyper_options": [dict, None],
        "num_points": POSITIVE_INT,
        "dtype": [StrOptions({"float64", "float32"}), Options(torch.dtype, {torch.float64, torch.float32})],
        "max_iter": NONNEGATIVE_INT + [None], "tol": POSITIVE + [None], "random_state": ["random_state"]}

    def __init__(self, kernel=None, engine="dual_vg", learn_hyperparameters=False, mean=0.0, learn_mean=True,
                 jitter=1e-6, options=None, hyper_options=None, num_points=64, dtype="float64", max_iter=None,
                 tol=None, random_state=None):
        self.kernel = kernel
        self.engine = engine
        self.learn_hyperparameters = learn_hyperparameters
        self.mean = mean
        self.learn_mean = learn_mean
        self.jitter = jitter
        self.options = options
        self.hyper_options = hyper_options
        self.num_points = num_points
        self.dtype = dtype
        self.max_iter = max_iter
        self.tol = tol
        self.random_state = random_state

    # ------------------------------------------------------------------ validation
    def _torch_dtype(self):
        return _DTYPES[self.dtype]  # one of its keys (_parameter_constraints)

    def _check_X(self, X, y="no_validation", reset=False):
        """Validate ``X`` (and ``y``) with scikit-learn's validators; ``X`` as a dense torch tensor."""
        return validate_dense(self, X, y, reset, np.float64 if self._torch_dtype() == torch.float64 else np.float32)

    def _default_kernel(self):
        import gpytorch

        return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    # ------------------------------------------------------------------ fitting
    def _K(self, X, X2=None):
        if X2 is None:
            K = self.kernel_(X).to_dense()
            return K + self.jitter * torch.eye(X.shape[0], dtype=K.dtype, device=K.device)
        return self.kernel_(X, X2).to_dense()

    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y, sample_weight=None):
        """Fit to inputs ``X`` ``(n, d)`` and binary labels ``y`` ``(n,)`` (any two distinct values); returns ``self``.

        :param X: ``(n, d)`` array-like (NumPy, pandas, SciPy sparse, torch).
        :param y: ``(n,)`` labels; ``classes_[1]`` (the larger label) is the positive class.
        :param sample_weight: ``(n,)`` nonnegative row weights (default: all one). Row ``i``'s log-likelihood
            is multiplied by ``sample_weight[i]`` (weighted sites, ``poutine.scale``); rows of weight zero are
            left out. An integer weight equals the row repeated, up to the jitter: repeated inputs have
            latent values correlated ``1 - O(jitter)``, so their latents coincide in the limit.
        """
        engine = registered_engine(self)  # a ValueError naming engine for unknown names
        options = engine_options(self, engine, self.options)
        reserved = sorted({"progress", "init"} & set(options))
        if reserved:
            raise ValueError(f"options: {reserved} are set by GPClassifier (no progress bar; warm starts come from "
                             "the hyperparameter fit or options={'alpha0': ...}); leave them out")
        if not math.isfinite(float(self.mean)):
            raise ValueError(f"mean: expected a finite constant prior mean of the latent function, got {self.mean!r}")
        X, y = self._check_X(X, y, reset=True)
        self.classes_, y01 = binary_targets(y)
        y01 = torch.as_tensor(y01, dtype=self._torch_dtype())
        weight, X, y01 = positive_rows(check_sample_weight(sample_weight, X.shape[0]), X, y01)
        if weight is not None:
            weight = None if bool((weight == 1).all()) else torch.as_tensor(weight, dtype=X.dtype, device=X.device)
        self._weight = weight
        self.weight_ = None if weight is None else weight.detach().cpu().numpy()
        kernel = self.kernel if self.kernel is not None else self._default_kernel()
        self.kernel_ = copy.deepcopy(kernel).to(dtype=self._torch_dtype(), device=X.device)
        self._check_kernel_output(X)
        self._X_train = X
        self.X_train_, self.y_train_ = X.detach().cpu().numpy(), y01.detach().cpu().numpy()
        self.mean_ = float(self.mean)
        self.hyper_history_ = None
        for stale in ("hyper_converged_", "hyper_result_"):  # of an earlier fit that learned them
            self.__dict__.pop(stale, None)
        init = None
        if not self.learn_hyperparameters:
            warn_unused(self, ("learn_mean",), "learn_hyperparameters=False learns nothing: the mean stays at mean")
        if self.learn_hyperparameters:
            init = self._learn_hyperparameters(X, y01, options)
        else:
            unused = ["hyper_options"] * bool(self._hyper_options()) + [
                f"options[{k!r}]" for k in sorted(set(options) & _TYPE2_OPTIONS)]
            if unused:
                warn(f"GPClassifier: {', '.join(unused)} only apply with learn_hyperparameters=True; they are not "
                     "used", UserWarning)
            options = {k: v for k, v in options.items() if k not in _TYPE2_OPTIONS}
        if engine.State is DualState:  # the dual's N x N site form predicts without inverting K
            options.setdefault("form", "site")
        if "alpha0" in options:
            init = None
        with torch.no_grad():
            K = self._K(X)
            self._K_train = K
            self.K_train_ = K.detach().cpu().numpy()  # on CPU a view of the tensor: no second copy
            mean = self.mean_
        with torch.enable_grad():
            if engine.takes == "lgm":
                res = engine(gp_classification_lgm(K, y01, mean, weight), progress=False, init=init, **options).run()
            else:
                res = engine(gp_classification_model, progress=False, init=init, **options).run(K, y=y01, mean=mean,
                                                                                                weight=weight)
        site = isinstance(res.state, DualState) and res.state.gp_site_form
        self.alpha_ = res.state.alpha.detach().cpu().numpy() if site else None
        self.result_ = res
        self.posterior_ = res.posterior
        self.log_evidence_bound_ = res.log_evidence_bound
        # with learned hyperparameters also the type-II loop's: a fit whose kernel stopped short is not converged (as
        # BayesianLogisticRegression's with prior_scale="auto")
        self.converged_ = bool(res.converged) and bool(self.__dict__.get("hyper_converged_", True))
        outer = getattr(self.__dict__.get("hyper_result_"), "type2_iterations", None)  # None: no type-II loop ran
        self.n_iter_ = res.iterations if outer is None else outer
        self.kernel_.requires_grad_(False)  # fitted values: reading them (float(), .numpy()) needs no detach
        return self

    def _check_kernel_output(self, X):
        """Refuse a kernel whose ``kernel(X)`` is not one ``(n, n)`` matrix (a batch of them, from a ``batch_shape``
        of the kernel or of a part of it): the classifier has one latent GP."""
        r = min(3, X.shape[0])  # three rows: a module mapping (n, d) to (n, 2) is not a kernel
        dense = None
        try:
            with torch.no_grad():
                out = self.kernel_(X[:3])
                shape = tuple(out.shape)
                if len(shape) >= 2 and shape[-2:] == (r, r):
                    dense = out.to_dense()  # evaluated on three rows: active_dims, ARD sizes and the like fail here
        except Exception as err:
            raise ValueError(f"kernel: {type(self.kernel_).__name__} fails on three rows of X ({X.shape[1]} "
                             f"features): {type(err).__name__}: {err}") from err
        if len(shape) < 2 or shape[-2:] != (r, r):
            raise ValueError(f"kernel: {type(self.kernel_).__name__} maps ({r}, {X.shape[1]}) inputs to shape {shape}, "
                             f"not an ({r}, {r}) kernel matrix; give a GPyTorch kernel (e.g. ScaleKernel(RBFKernel()))")
        if shape != (r, r):
            raise ValueError(f"kernel: {type(self.kernel_).__name__} maps (n, d) inputs to kernel matrices of shape "
                             f"{shape[:-2] + ('n', 'n')}, a batch of {shape[:-2]}; GPClassifier fits one latent GP and "
                             f"needs one (n, n) matrix: build the kernel (and its parts) without batch_shape")
        if dense is not None and not bool(torch.isfinite(dense).all()):
            bad = {n: p.detach() for n, p in self.kernel_.named_parameters() if not bool(torch.isfinite(p).all())}
            raise ValueError(f"kernel: {type(self.kernel_).__name__}(X) has non-finite entries on three rows of X"
                             + (f" (non-finite parameters: {sorted(bad)})" if bad else "")
                             + "; give the kernel finite hyperparameters")

    def _hyper_options(self):
        """``hyper_options`` as a dict; unknown keys raise, whether or not the hyperparameters are learned."""
        hyper = dict(self.hyper_options or {})
        unknown = set(hyper) - {"max_iter", "gtol"}
        if unknown:
            raise TypeError(f"hyper_options: unknown keys {sorted(unknown)}; use 'max_iter' and 'gtol'")
        return hyper

    def _learn_hyperparameters(self, X, y01, options):
        """Type-II over the kernel copy's parameters (and the mean): the engine's ``learn_params`` on a Pyro model."""
        import pyro

        engine = get_engine(self.engine)
        if engine.type2 != "outer" or "learn_params" not in engine.Options.__dataclass_fields__:
            raise ValueError(f"learn_hyperparameters=True needs an engine with a type-II loop over pyro.param sites "
                             f"(dual_vg, convex_relaxation, laplace); engine '{self.engine}' has none")
        hyper = self._hyper_options()
        if options.get("learn_params", True) is not True:
            raise ValueError(f"options={{'learn_params': {options['learn_params']!r}}} contradicts "
                             "learn_hyperparameters=True (the type-II loop learns the kernel's parameters); give one")
        opts = dict(options, learn_params=True)
        fields = engine.Options.__dataclass_fields__
        for key, name in (("max_iter", "type2_max_iter"), ("gtol", "type2_gtol")):
            if key in hyper:
                if name not in fields:
                    raise TypeError(f"hyper_options: '{key}' is not an option of engine '{self.engine}'")
                if name in options:
                    raise ValueError(f"hyper_options={{{key!r}: {hyper[key]!r}}} and options={{{name!r}: "
                                     f"{options[name]!r}}} set the same type-II option; give one")
                opts[name] = hyper[key]
        # learned in float64 whatever ``dtype``: the float32 bound's rounding (about 1e-5 of it) swamps the
        # finite-difference gradients and line searches of the type-II loop, which then took no step at all
        single = X.dtype != torch.float64
        kernel = copy.deepcopy(self.kernel_).double() if single else self.kernel_
        weight = None if self._weight is None else self._weight.double()
        model = _GPHyperModel(kernel, self.jitter, self.learn_mean, float(self.mean), X.shape[0], weight)
        store = pyro.get_param_store()
        with store.scope():  # the user's param store is left as it was
            res = engine(model, progress=False, **opts).run(X.double(), y01.double())
            if self.learn_mean:
                self.mean_ = float(pyro.param("mean").detach())
        if single:  # the learned values into the float32 copy
            with torch.no_grad():
                self.kernel_.load_state_dict(kernel.state_dict())
        self.hyper_history_ = res.history
        self.hyper_converged_ = bool(res.converged)
        self.hyper_result_ = res
        if single or not isinstance(res.state, (DualState, LaplaceState)):
            return None
        return res.state.warm_start()  # the dual starts from alpha, the Laplace mode search from the learned mode

    # ------------------------------------------------------------------ prediction
    def _latent(self, X, components=False):
        """Latent predictive ``(mean, var)`` ``(m,)`` at ``X``; with ``components``, ``(C, m)`` per component of a
        mixture posterior (``C = 1`` for a Gaussian one)."""
        check_is_fitted(self, "result_")
        X = self._check_X(X)
        with torch.no_grad():
            Kx = self._K(X, self._X_train)  # (m, n)
            mean = self.mean_
            kdiag = self.kernel_(X, diag=True)
            if self.alpha_ is not None:
                m, v = self.result_.state.site_predictive(Kx, kdiag, mean)
                return (m.unsqueeze(0), v.unsqueeze(0)) if components else (m, v)
            return gp_latent_predictive(self._K_train, Kx, kdiag, self.posterior_, mean, mean, components=components)

    def _outputs(self, X):
        # a mixture posterior (diag_mixture) averages the probabilities of its components' predictives: the
        # probabilities of the mixture's moment-matched Gaussian are not the mixture's
        return classifier_outputs(*mixture_log_probs(*self._latent(X, components=True), self.num_points))

    def predict_latent(self, X):
        """Latent predictive mean and variance at inputs ``X`` ``(m, d)``: NumPy arrays ``(m,)``, ``(m,)`` (a mixture
        posterior's: the mixture's moments)."""
        m, v = self._latent(X)
        return m.cpu().numpy(), v.cpu().numpy()


    def nlpd(self, X, y):
        """Mean negative log predictive density of the labels ``y`` (nats)."""
        logp = self.predict_log_proba(X)
        y = np.asarray(sklearn_input(y)).reshape(-1)
        if y.shape[0] != logp.shape[0]:
            raise ValueError(f"y: has {y.shape[0]} labels for {logp.shape[0]} rows of X")
        unknown = ~np.isin(y, self.classes_)
        if unknown.any():
            raise ValueError(f"y: labels {np.unique(y[unknown])[:5].tolist()} are not among classes_ "
                             f"{self.classes_.tolist()}")
        return float(-np.where(y == self.classes_[1], logp[:, 1], logp[:, 0]).mean())


class _GPHyperModel:
    """Pyro model of GP classification with the kernel's hyperparameters (and the constant mean) as
    ``pyro.param`` sites, for type-II maximum likelihood (a picklable callable ``model(X, y=None)``)."""

    def __init__(self, kernel, jitter, learn_mean, mean0, n, weight=None):
        self.kernel, self.jitter, self.learn_mean, self.mean0, self.n = kernel, jitter, learn_mean, mean0, n
        self.weight = weight

    def __call__(self, X, y=None):
        import pyro
        import pyro.distributions as dist

        n = self.n
        pyro.module("kernel", self.kernel)
        priors = list(self.kernel.named_priors()) if hasattr(self.kernel, "named_priors") else []
        if priors:  # GPyTorch priors on the hyperparameters: maximum a posteriori type-II (a factor of no latent)
            pyro.factor("kernel_priors", sum(prior.log_prob(closure(module)).sum()
                                             for _, module, prior, closure, _ in priors))
        mean = pyro.param("mean", torch.tensor(self.mean0, dtype=X.dtype)) if self.learn_mean else \
            torch.tensor(self.mean0, dtype=X.dtype)
        K = self.kernel(X).to_dense() + self.jitter * torch.eye(n, dtype=X.dtype, device=X.device)
        f = pyro.sample("f", dist.MultivariateNormal(mean.expand(n), covariance_matrix=K))
        with pyro.plate("data", n), pyro.poutine.scale(scale=1.0 if self.weight is None else self.weight):
            pyro.sample("y", dist.Bernoulli(logits=f), obs=y)
