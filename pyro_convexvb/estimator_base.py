"""What the scikit-learn estimators share: input conversion, sample weights, binary targets, predictive
class probabilities, compact pickles, the mapping of ``max_iter``/``tol``/``random_state`` onto engine options,
deprecated parameter names and the parameter constraints they have in common.

Every estimator module (``blr``, ``logistic``, ``glm``, ``gp.classifier``, ``online``) imports from here and
from the layers below, never from another estimator; parameters are declared in ``_parameter_constraints``
(``sklearn.utils._param_validation``) and checked at ``fit`` by scikit-learn's ``sklearn.base._fit_context``.
"""
import copy
import dataclasses
import inspect
import math
from numbers import Integral, Real

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.base import ClassifierMixin, _fit_context
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Hidden, Interval, StrOptions
from sklearn.utils.multiclass import check_classification_targets, type_of_target
from sklearn.utils.validation import validate_data

from .errors import warn
from .lgm.families.logit import predictive_log_probs  # re-exported by logistic

__all__ = ["sklearn_input", "design_matrix", "dense_float64", "validate_dense", "check_sample_weight",
           "binary_targets", "predictive_log_probs", "mixture_log_probs", "classifier_outputs",
           "BinaryPredictiveClassifier", "CompactPickleMixin", "compact_result", "compact_lanczos", "engine_options",
           "seed_from", "renamed", "deprecated_alias", "NumberInterval", "warn_unused",
           "registered_engine"]

fit_context = _fit_context  # scikit-learn's own decorator: validates _parameter_constraints before fit runs

#: the default of a parameter kept under an old name (scikit-learn's convention for renamed parameters)
DEPRECATED = "deprecated"


class NumberInterval(Interval):
    """scikit-learn's ``Interval`` constraint, refusing booleans (``True`` is no iteration count)."""

    def is_satisfied_by(self, val):
        return not isinstance(val, (bool, np.bool_)) and super().is_satisfied_by(val)


# constraints several estimators share
POSITIVE = [NumberInterval(Real, 0, math.inf, closed="neither")]  # finite and > 0
NONNEGATIVE = [NumberInterval(Real, 0, math.inf, closed="left")]
POSITIVE_INT = [NumberInterval(Integral, 1, None, closed="left")]
NONNEGATIVE_INT = [NumberInterval(Integral, 0, None, closed="left")]


def deprecated_alias(constraint):
    """The constraint of an old parameter name: its new name's constraint, or the hidden ``"deprecated"``."""
    return list(constraint) + [Hidden(StrOptions({DEPRECATED}))]


def renamed(est, old, new):
    """The value of parameter ``new`` of ``est``, taken from ``old`` (with a ``FutureWarning``) when it was set.

    :raises ValueError: naming both when both were set to different values.

    Example::

        >>> from pyro_convexvb.glm import GLM
        >>> import warnings
        >>> with warnings.catch_warnings(record=True):
        ...     warnings.simplefilter("always")
        ...     renamed(GLM(seed=3), "seed", "random_state")
        3
    """
    value, default = getattr(est, old), getattr(est, new)
    if isinstance(value, str) and value == DEPRECATED:
        return default
    name = type(est).__name__
    if default is not inspect.signature(type(est)).parameters[new].default and default != value:
        raise ValueError(f"{name}: both {old}={value!r} and {new}={default!r} given; {old} is the old name of "
                         f"{new}: pass {new} only")
    warn(f"{name}: the parameter {old!r} is deprecated and will be removed; use {new}={value!r}", FutureWarning)
    return value


# ------------------------------------------------------------------------------------------------ inputs
def sklearn_input(obj):
    """A torch tensor as a NumPy array (dense, on the CPU) or a SciPy CSR matrix (sparse COO/CSR/CSC).

    Anything else (NumPy, pandas, SciPy sparse, lists) is returned unchanged, ready for scikit-learn's
    validators (:func:`sklearn.utils.validation.validate_data`).

    Example::

        >>> import torch
        >>> sklearn_input(torch.eye(2, dtype=torch.float64)).dtype
        dtype('float64')
    """
    if not torch.is_tensor(obj):
        return obj
    obj = obj.detach()
    if obj.layout == torch.strided:
        return obj.cpu().numpy()
    if obj.layout in (torch.sparse_coo, torch.sparse_csc):
        obj = obj.coalesce().to_sparse_csr() if obj.layout == torch.sparse_coo else obj.to_sparse_csr()
    if obj.layout != torch.sparse_csr:
        raise TypeError(f"X: unsupported torch layout {obj.layout}")
    return sp.csr_matrix((obj.values().cpu().numpy(), obj.col_indices().cpu().numpy(),
                          obj.crow_indices().cpu().numpy()), shape=tuple(obj.shape))


def design_matrix(basis, X, fit_intercept=False):
    """``Phi = basis(X)`` (``X`` itself when ``basis`` is ``None``), with a ones column appended if asked."""
    Phi = X if basis is None else basis(X)
    if not torch.is_tensor(Phi) or not Phi.is_floating_point():
        raise ValueError(f"basis must return a floating-point torch tensor (the inputs' {X.dtype}), got "
                         f"{type(Phi).__name__ if not torch.is_tensor(Phi) else Phi.dtype}")
    if Phi.dtype != X.dtype:
        raise ValueError(f"basis must return features in the inputs' dtype {X.dtype}, got {Phi.dtype} (e.g. build "
                         "its module in float64, or convert its output)")
    if Phi.dim() != 2 or Phi.shape[0] != X.shape[0]:
        raise ValueError(f"basis must map (N, d) inputs to (N, D) features, got shape {tuple(Phi.shape)}")
    if fit_intercept:
        Phi = torch.cat([Phi, torch.ones_like(Phi[:, :1])], -1)
    return Phi


def dense_float64(X, dtype=np.float64):
    """A validated array or SciPy sparse matrix as a dense C-ordered torch tensor (float64 unless ``dtype``)."""
    if hasattr(X, "toarray"):
        X = X.toarray()
    return torch.from_numpy(np.array(X, dtype=dtype, order="C"))


def validate_dense(est, X, y="no_validation", reset=False, dtype=np.float64, **kwargs):
    """scikit-learn's ``validate_data(est, X[, y])`` on NumPy, pandas, SciPy sparse or torch input, with ``X``
    returned as a dense torch tensor of ``dtype`` (and ``y`` as validated when given)."""
    out = validate_data(est, sklearn_input(X), sklearn_input(y), reset=reset, accept_sparse="csr", dtype=dtype,
                        **kwargs)
    return dense_float64(out, dtype) if isinstance(y, str) else (dense_float64(out[0], dtype), out[1])


def float_copy(module):
    """A float64 deep copy of a ``torch.nn.Module`` (the estimators never train the module passed in)."""
    return copy.deepcopy(module).to(torch.float64) if isinstance(module, torch.nn.Module) else module


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


def positive_rows(weight, *rows):
    """``(weight, *rows)`` restricted to the rows of positive weight (a zero weight drops its row); ``rows`` are
    NumPy, SciPy sparse or torch, rows first, or ``None`` (passed through). ``weight=None`` leaves everything as it
    is."""
    if weight is None:
        return (None, *rows)
    keep = np.flatnonzero(weight > 0)
    return (weight[keep], *(None if r is None else r[torch.from_numpy(keep)] if torch.is_tensor(r) else r[keep]
                            for r in rows))


def unsharded_weight(weight, sharded):
    """``weight`` unchanged, or the ``ValueError`` naming ``sample_weight`` when the rows are sharded."""
    if weight is not None and sharded:
        raise ValueError("sample_weight: not supported with distributed=True (fit on one process, or repeat rows "
                         "for integer weights)")
    return weight


def _is_default(value, default):
    """``value`` is the scalar ``default`` (of the same kind: ``1`` is not ``True``); arrays never are."""
    if value is default:
        return True
    if np.ndim(value) != 0 or isinstance(value, (bool, np.bool_)) != isinstance(default, (bool, np.bool_)):
        return False
    try:
        return bool(value == default)
    except (TypeError, ValueError):
        return False


def warn_unused(est, names, reason):
    """A ``UserWarning`` naming those of the parameters ``names`` of ``est`` that are set to other than their
    defaults although ``est``'s configuration does not use them (as scikit-learn's ``LogisticRegression`` warns of an
    ``l1_ratio`` without ``penalty="elasticnet"``): no option is accepted and ignored silently.

    :param reason: which setting leaves them out, e.g. ``"fit_intercept=False fits no intercept"``.

    Example::

        >>> from pyro_convexvb.glm import GLM
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     warn_unused(GLM("poisson", noise_var=2.0), ["noise_var", "learn_noise"], "no noise variance")
        >>> str(w[0].message)
        'GLM: noise_var=2.0 is not used (no noise variance); leave it at its default'
    """
    defaults = inspect.signature(type(est)).parameters
    changed = [n for n in names if not _is_default(getattr(est, n), defaults[n].default)]
    if changed:
        its = "it at its default" if len(changed) == 1 else "them at their defaults"
        warn(f"{type(est).__name__}: {', '.join(f'{n}={getattr(est, n)!r}' for n in changed)} "
             f"{'is' if len(changed) == 1 else 'are'} not used ({reason}); leave {its}", UserWarning)


# ------------------------------------------------------------------------------------------------ classifiers
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


def mixture_log_probs(mean, var, num_points=64):
    """:func:`predictive_log_probs` averaged over equally weighted mixture components (a leading ``K`` axis
    of ``mean``/``var`` ``(K, m)``); ``(m,)`` inputs pass through."""
    lp0, lp1 = predictive_log_probs(mean, var, num_points)
    if lp0.dim() == 2:
        log_k = math.log(lp0.shape[0])
        lp0, lp1 = torch.logsumexp(lp0, 0) - log_k, torch.logsumexp(lp1, 0) - log_k
    return lp0, lp1


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
        """``(m, 2)`` log predictive probabilities, from log-sum-exp of the quadrature terms, so a probability that
        rounds to 0 in :meth:`predict_proba` keeps its logarithm; for a wide latent predictive the smaller one splits
        the sigmoid's step off in closed form and integrates the rest on panels (:func:`predictive_log_probs`:
        ``log p = -31.2075`` at a latent ``N(101.6, 179)``, adaptive quadrature's value to 1e-12, where 64 plain
        Gauss-Hermite nodes give -31.11)."""
        return self._outputs(X)[2]

    def predict(self, X):
        """``(m,)`` the most probable label of ``classes_``."""
        positive = self.decision_function(X) > 0
        return self.classes_[positive.astype(np.int64)]

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.classifier_tags.multi_class = False
        tags.input_tags.sparse = True
        return tags


# ------------------------------------------------------------------------------------------------ engines
#: engine option fields that carry scikit-learn's ``max_iter``, ``tol`` and ``random_state``, in order of
#: preference (``max_outer``: convex_relaxation's outer loop; ``phi_tol``: its relative change of the objective;
#: ``gap_tol``: dual_vg's duality gap; ``grad_tol``: laplace; ``max_steps``/``rtol``: the SVI-type engines).
ENGINE_FIELDS = {"max_iter": ("max_iter", "max_outer", "max_steps"),
                 "tol": ("gap_tol", "grad_tol", "phi_tol", "rtol"),
                 "random_state": ("seed",)}


def seed_from(random_state):
    """An integer seed from scikit-learn's ``random_state`` (an int, or a ``RandomState`` drawn from)."""
    if isinstance(random_state, (Integral, np.integer)):
        return int(random_state)
    return int(check_random_state(random_state).randint(np.iinfo(np.int32).max))


def registered_engine(est):
    """The engine class registered as ``est.engine``.

    :raises ValueError: naming the parameter ``engine`` and the registered names, for a name that is not registered
        (the registry's own ``KeyError`` is no ``ValueError``: ``GridSearchCV`` and scikit-learn callers expect one
        for a bad parameter value).
    """
    from .infer.registry import engines, get_engine

    try:
        return get_engine(est.engine)
    except KeyError:
        raise ValueError(f"{type(est).__name__}: engine={est.engine!r} is not a registered engine; use one of "
                         f"{sorted(engines())} (or register it with pyro_convexvb.register_engine)") from None


def engine_options(est, engine, options):
    """``options`` with the estimator's ``max_iter``, ``tol`` and ``random_state`` written into the engine's own
    options (:data:`ENGINE_FIELDS`).

    ``None`` keeps the engine's default.  A value the engine has no option for is refused (``ValueError`` naming
    the parameter), except ``random_state`` for an engine without a ``seed``: such engines draw no random numbers,
    so every ``random_state`` gives the same fit.  Setting a knob both ways (``max_iter=`` and
    ``options={"max_iter": ...}``) is refused.
    """
    options = dict(options or {})
    fields = engine.Options.__dataclass_fields__
    name = type(est).__name__
    for knob, candidates in ENGINE_FIELDS.items():
        value = getattr(est, knob, None)
        if value is None:
            continue
        field = next((f for f in candidates if f in fields), None)
        if field is None:
            if knob == "random_state":
                continue
            raise ValueError(f"{name}: {knob}={value!r}, but engine '{engine.name}' has no option for it (it has "
                             f"none of {list(candidates)}); leave {knob}=None")
        if field in options:
            raise ValueError(f"{name}: {knob}={value!r} and options={{{field!r}: {options[field]!r}}} set the same "
                             f"engine option; give one")
        if knob != "random_state":
            _check_range(name, knob, value, engine.name, field, fields[field].metadata)
        options[field] = seed_from(value) if knob == "random_state" else value
    return options


def _check_range(name, knob, value, engine_name, field, meta):
    """Refuse an estimator parameter outside the range of the engine option it sets, naming both (the engine's own
    check would name only its option)."""
    from .infer.options import range_violation

    bound = range_violation(value, meta)
    if bound is not None:
        raise ValueError(f"{name}: {knob}={value!r} sets option '{field}' of engine '{engine_name}', which must be "
                         f"{bound}")


# ------------------------------------------------------------------------------------------------ pickles
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
