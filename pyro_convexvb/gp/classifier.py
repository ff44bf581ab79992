r"""Scikit-learn-style GP binary classification with GPyTorch kernels over any applicable engine.

``GPClassifier(kernel, engine="dual_vg")``: latent ``f ~ N(mean, K)`` with ``K = kernel(X)`` (plus
jitter), ``y_n ~ Bernoulli(sigmoid(f_n))``. With ``engine="dual_vg"`` the model goes straight to the
dual (``N x N`` form; Khan et al. 2013) and test predictions use the dual variables,
``mean_* = mu_* - k_*^T alpha`` and ``var_* = k_** - ||R^{-1} Lam^{1/2} k_*||^2`` (Khan et al. 2013,
Eqs. 17-18; docs/dual_vg.md, § Algorithm and recovery), with no inverse of ``K``. Other engines receive the same latent Gaussian model (``takes="lgm"`` engines) or
the equivalent Pyro model (Pyro's engines); predictions then use
:func:`~pyro_convexvb.gp.predict.gp_latent_predictive`. Class probabilities push the latent
predictive through the logistic link by Gauss-Hermite quadrature.
"""
import copy

import numpy as np
import torch

from ..infer.dual_vg import DualVGEngine, make_bound, site_space_predictive
from ..infer.registry import get_engine
from ..lgm.layout import LatentLayout
from ..lgm.model import LatentGaussianModel, PriorBlock, SiteGroup
from ..lgm.sites import BernoulliLogit, gaussian_expectation
from ..linalg.operators import DenseOperator, IdentityOperator
from .predict import gp_classification_model, gp_latent_predictive

__all__ = ["GPClassifier", "gp_classification_lgm"]


def gp_classification_lgm(K, y, mean=0.0):
    """Explicit :class:`~pyro_convexvb.LatentGaussianModel` of GP classification (latent site ``"f"``).

    :param torch.Tensor K: ``(N, N)`` prior covariance (kernel matrix with jitter).
    :param torch.Tensor y: ``(N,)`` labels in {0, 1}.
    """
    N = K.shape[0]
    loc = torch.as_tensor(mean, dtype=K.dtype, device=K.device).expand(N).clone()
    prior = PriorBlock("f", loc, cov=DenseOperator(K))
    layout = LatentLayout.from_shapes([("f", (N,))], [1])
    site = SiteGroup("y", BernoulliLogit(y), IdentityOperator(N, dtype=K.dtype, device=K.device),
                     torch.zeros(N, dtype=K.dtype, device=K.device), (N,))
    return LatentGaussianModel(layout, [prior], [site])


class GPClassifier:
    r"""Gaussian-process binary classifier (logistic link) over any inference engine of the registry.

    :param kernel: a ``gpytorch.kernels.Kernel`` (e.g. ``ScaleKernel(RBFKernel())``). It is never
        modified: :meth:`fit` works on a copy (``kernel_``, in the data's dtype), whose
        hyperparameters are used as they are unless ``learn_hyperparameters``.
    :param str engine: registry engine name (default ``"dual_vg"``).
    :param bool learn_hyperparameters: type-II maximum likelihood: maximise the engine's evidence bound
        over the kernel hyperparameters (and the constant mean if ``learn_mean``): the kernel copy is
        registered with ``pyro.module`` in a Pyro model and fitted with the engine's ``learn_params``
        (:mod:`~pyro_convexvb.infer.type2`; envelope-theorem gradients for ``dual_vg`` and
        ``convex_relaxation``), in a private param-store scope.
    :param float mean: constant prior mean.
    :param float jitter: added to the diagonal of ``K``.
    :param dict options: engine options (e.g. ``{"bound": "jensen"}`` for ``dual_vg``).
    :param dict hyper_options: ``{"max_iter": ..., "gtol": ...}``: the engine's ``type2_max_iter`` and
        ``type2_gtol`` options.

    Learned attributes: ``kernel_`` (the fitted copy of ``kernel``), ``classes_``, ``result_`` (:class:`~pyro_convexvb.InferenceResult`),
    ``posterior_``, ``log_evidence_bound_``, ``alpha_`` (dual variables, ``dual_vg`` only),
    ``hyper_history_``.

    Example::

        >>> import gpytorch, torch
        >>> X = torch.randn(40, 2, dtype=torch.float64); y = (X[:, 0] > 0).long()
        >>> clf = GPClassifier(gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())).fit(X, y)
        >>> clf.predict_proba(X[:3]).shape
        torch.Size([3, 2])
        >>> clf.score(X, y) > 0.8
        True
    """

    def __init__(self, kernel, engine="dual_vg", learn_hyperparameters=False, mean=0.0, learn_mean=True,
                 jitter=1e-6, options=None, hyper_options=None, num_points=32, dtype=torch.float64):
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

    # ------------------------------------------------------------------ validation
    def _check_X(self, X, name="X"):
        X = torch.as_tensor(np.asarray(X) if not torch.is_tensor(X) else X)
        if X.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D array (n, d), got shape {tuple(X.shape)}")
        X = X.to(self.dtype)
        if not torch.isfinite(X).all():
            raise ValueError(f"{name}: contains NaN or inf")
        if hasattr(self, "X_train_") and X.shape[1] != self.X_train_.shape[1]:
            raise ValueError(f"{name}: has {X.shape[1]} features, the classifier was fitted with {self.X_train_.shape[1]}")
        return X

    def _check_y(self, y, n):
        y = torch.as_tensor(np.asarray(y) if not torch.is_tensor(y) else y).reshape(-1)
        if y.shape[0] != n:
            raise ValueError(f"y: has {y.shape[0]} labels for {n} rows of X")
        if y.is_floating_point() and not torch.isfinite(y).all():
            raise ValueError("y: contains NaN or inf")
        classes = torch.unique(y)
        if classes.numel() != 2:
            raise ValueError(f"y: binary classification needs exactly two classes, found {classes.tolist()}")
        return classes, (y == classes[1]).to(self.dtype)

    # ------------------------------------------------------------------ fitting
    def _K(self, X, X2=None):
        if X2 is None:
            K = self.kernel_(X).to_dense()
            return K + self.jitter * torch.eye(X.shape[0], dtype=K.dtype, device=K.device)
        return self.kernel_(X, X2).to_dense()

    def fit(self, X, y):
        """Fit to inputs ``X`` ``(n, d)`` and binary labels ``y`` ``(n,)`` (any two distinct values); returns ``self``."""
        X = self._check_X(X)
        self.classes_, y01 = self._check_y(y, X.shape[0])
        self.kernel_ = copy.deepcopy(self.kernel).to(dtype=self.dtype, device=X.device)
        self.X_train_ = X
        self.y_train_ = y01
        options = dict(self.options or {})
        self.mean_ = torch.nn.Parameter(torch.as_tensor(float(self.mean), dtype=self.dtype, device=X.device))
        self.hyper_history_ = None
        alpha0 = None
        if self.learn_hyperparameters:
            alpha0 = self._learn_hyperparameters(X, y01, options)
        with torch.no_grad():
            K = self._K(X)
            self.K_train_ = K
            mean = float(self.mean_.detach())
            if self.engine == "dual_vg":
                if alpha0 is not None:
                    options.setdefault("alpha0", alpha0)
                options.setdefault("form", "site")
                res = DualVGEngine(gp_classification_lgm(K, y01, mean), progress=False, **options).run()
                self.alpha_ = res.info["alpha"] if res.info["form"] == "site" else None
        if self.engine != "dual_vg":
            with torch.enable_grad():
                engine = get_engine(self.engine)
                if engine.takes == "lgm":
                    res = engine(gp_classification_lgm(K, y01, mean), progress=False, **options).run()
                else:
                    res = engine(gp_classification_model, progress=False, **options).run(K, y=y01, mean=mean)
                self.alpha_ = None
        self.result_ = res
        self.posterior_ = res.posterior
        self.log_evidence_bound_ = res.log_evidence_bound
        return self

    def _learn_hyperparameters(self, X, y01, options):
        """Type-II over the kernel copy's parameters (and the mean): the engine's ``learn_params`` on a Pyro model."""
        import pyro
        import pyro.distributions as dist

        engine = get_engine(self.engine)
        if engine.type2 != "outer" or "learn_params" not in engine.Options.__dataclass_fields__:
            raise ValueError(f"learn_hyperparameters=True needs an engine with a type-II loop over pyro.param sites "
                             f"(dual_vg, convex_relaxation, laplace); engine '{self.engine}' has none")
        hyper = dict(self.hyper_options or {})
        unknown = set(hyper) - {"max_iter", "gtol"}
        if unknown:
            raise TypeError(f"hyper_options: unknown keys {sorted(unknown)}; use 'max_iter' and 'gtol'")
        opts = dict(options, learn_params=True)
        fields = engine.Options.__dataclass_fields__
        for key, name in (("max_iter", "type2_max_iter"), ("gtol", "type2_gtol")):
            if key in hyper:
                if name not in fields:
                    raise TypeError(f"hyper_options: '{key}' is not an option of engine '{self.engine}'")
                opts.setdefault(name, hyper[key])
        n = X.shape[0]
        kernel, jitter, learn_mean, mean0 = self.kernel_, self.jitter, self.learn_mean, float(self.mean)

        def model(X, y=None):
            pyro.module("kernel", kernel)
            mean = pyro.param("mean", torch.tensor(mean0, dtype=X.dtype)) if learn_mean else \
                torch.tensor(mean0, dtype=X.dtype)
            K = kernel(X).to_dense() + jitter * torch.eye(n, dtype=X.dtype, device=X.device)
            f = pyro.sample("f", dist.MultivariateNormal(mean.expand(n), covariance_matrix=K))
            with pyro.plate("data", n):
                pyro.sample("y", dist.Bernoulli(logits=f), obs=y)

        store = pyro.get_param_store()
        with store.scope():  # the user's param store is left as it was
            res = engine(model, progress=False, **opts).run(X, y01)
            if learn_mean:
                self.mean_ = torch.nn.Parameter(pyro.param("mean").detach().clone())
        self.hyper_history_ = res.history
        self.hyper_converged_ = bool(res.converged)
        self.hyper_result_ = res
        return res.info.get("alpha")

    # ------------------------------------------------------------------ prediction
    def _check_fitted(self):
        if not hasattr(self, "result_"):
            raise RuntimeError("this GPClassifier is not fitted yet; call fit(X, y) first")

    def predict_latent(self, X):
        """Latent predictive mean and variance ``(m,)``, ``(m,)`` at inputs ``X`` ``(m, d)``."""
        self._check_fitted()
        X = self._check_X(X)
        with torch.no_grad():
            Kx = self._K(X, self.X_train_)  # (m, n)
            mean = float(self.mean_.detach())
            kdiag = self.kernel_(X, diag=True)
            if self.alpha_ is not None:
                return site_space_predictive(self.result_, Kx, kdiag, mean)
            return gp_latent_predictive(self.K_train_, Kx, kdiag, self.posterior_, mean, mean)

    def decision_function(self, X):
        """Latent predictive mean ``(m,)`` (positive favours ``classes_[1]``)."""
        return self.predict_latent(X)[0]

    def predict_proba(self, X):
        """Class probabilities ``(m, 2)``: ``E_{q(f_*)}[sigmoid(f_*)]`` by Gauss-Hermite quadrature."""
        m, v = self.predict_latent(X)
        p1 = gaussian_expectation(torch.sigmoid, m, v, self.num_points).clamp(0, 1)
        return torch.stack([1 - p1, p1], -1)

    def predict(self, X):
        """Most probable class label ``(m,)`` (in the coding of the training labels)."""
        p = self.predict_proba(X)[:, 1]
        return torch.where(p > 0.5, self.classes_[1], self.classes_[0])

    def score(self, X, y):
        """Mean accuracy on ``(X, y)``."""
        y = torch.as_tensor(np.asarray(y) if not torch.is_tensor(y) else y).reshape(-1)
        return float((self.predict(X) == y.to(self.classes_.dtype)).double().mean())

    def nlpd(self, X, y):
        """Mean negative log predictive density of binary labels ``y`` (nats)."""
        X = self._check_X(X)
        y = torch.as_tensor(np.asarray(y) if not torch.is_tensor(y) else y).reshape(-1)
        p = self.predict_proba(X)[:, 1].clamp(1e-300, 1 - 1e-16)
        pos = (y.to(self.classes_.dtype) == self.classes_[1])
        return float(-torch.where(pos, torch.log(p), torch.log1p(-p)).mean())
