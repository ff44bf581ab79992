"""Shared machinery of the online estimators: input handling, streaming driver, state, scikit-learn API."""
import math
import warnings
from numbers import Real

import numpy as np
import torch
from sklearn.base import BaseEstimator
from sklearn.utils._param_validation import StrOptions
from sklearn.utils.validation import check_array, check_is_fitted, column_or_1d, validate_data

from ..errors import ConvergenceWarning
from ..estimator_base import (DEPRECATED, NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, BinaryPredictiveClassifier, renamed,
                              warn_unused)
from . import equations as eq
from ._validation import from_torch, per_feature, to_csr

_FAST_HINT = ("numba is needed for fast=True: install it with `pip install 'pyro_convexvb[fast]'`, "
              "or pass fast=False to use the NumPy reference path")


def resolve_fast(fast):
    """``True``/``False``/``None`` (auto) -> whether the numba kernels are used.

    :raises ImportError: ``fast=True`` and numba cannot be imported.
    """
    if fast is not None and not isinstance(fast, bool):
        raise ValueError(f"fast: expected True, False or None, got {fast!r}")
    if fast is False:
        return False
    try:
        from . import _kernels  # noqa: F401
    except ImportError as exc:
        if fast:
            raise ImportError(_FAST_HINT) from exc
        return False
    return True


#: Prior variances learned side by side with ``prior_var="auto"`` (Bayesian model averaging; see
#: :class:`~pyro_convexvb.online.OnlineBayesLogistic`).
AUTO_PRIOR_VARS = (0.01, 0.1, 1.0)

#: Occam's window of ``prior_var="auto"``: a member whose cumulative log loss exceeds the best one's by more than
#: this (posterior odds below 1e-9) leaves the average and is no longer updated (Madigan & Raftery 1994).
AUTO_LOG_WINDOW = float(np.log(1e9))


def _logsumexp(a):
    """``log sum_k exp(a[..., k])``, stable."""
    m = np.max(a, axis=-1)
    m = np.where(np.isfinite(m), m, 0.0)
    return m + np.log(np.sum(np.exp(a - m[..., None]), axis=-1))


def _softmax(a):
    e = np.exp(a - np.max(a))
    return e / e.sum()


def _plain(obj):
    """``obj`` with NumPy scalars and arrays turned into Python numbers and lists (for ``torch.load`` with
    ``weights_only=True``, which refuses NumPy objects)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _plain(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _kernels():
    from . import _kernels as k
    return k


def _check_hashing(hashing):
    if hashing is None or hashing is False:
        return None
    if hashing is True:
        return 0
    if isinstance(hashing, (int, np.integer)) and hashing >= 0:
        return int(hashing)
    raise ValueError(f"hashing: expected None, True or a non-negative integer seed, got {hashing!r}")


_NUMERIC_CODINGS = {0.0: (0, 1), -1.0: (-1, 1)}

#: the smallest valid value of a state array under each rule of ``_array_constraints``
_FLOORS = {"positive": float(np.finfo(np.float64).tiny), "nonnegative": 0.0}


class OnlineEstimatorBase(BinaryPredictiveClassifier, BaseEstimator):
    """Common API: ``partial_fit`` row by row, progressive predictions, state save/load, scikit-learn contract.

    Constructor arguments are stored as given and validated when the state is created (the first
    :meth:`partial_fit`, or :meth:`fit`).  ``fit`` restarts from the prior and makes one pass;
    ``partial_fit`` continues the stream.  Binary labels may be any two values (``classes_``,
    sorted; the second is the positive class).  Without ``classes=`` the first call infers them:
    two distinct labels name both classes; a stream that starts with one label is accepted for the
    numeric codings ``{0, 1}`` and ``{-1, +1}`` (labels ``1`` alone read as ``{0, 1}`` until a
    ``-1`` arrives).

    Subclasses set ``_config_keys`` and implement ``_new_state``, ``_run_fast`` and
    ``_run_reference``.
    """

    _config_keys = ()
    _has_batch_size = True
    #: parameters renamed to scikit-learn's names: ``{new: old}`` (the old name warns with a ``FutureWarning``)
    _renamed = {}

    _parameter_constraints = {"num_features": POSITIVE_INT + [None], "link": [StrOptions(set(eq.LINKS))],
                              "hashing": ["boolean", *NONNEGATIVE_INT, None], "fast": ["boolean", None]}

    def _param(self, name):
        """The value of parameter ``name``, or of its deprecated old name when that was set."""
        old = getattr(self, self._renamed[name], DEPRECATED) if name in self._renamed else DEPRECATED
        return getattr(self, name) if isinstance(old, str) and old == DEPRECATED else old

    # ----------------------------------------------------------------- options and state
    _state_keys = ("_num_features", "_prior_config", "_prior_params", "_negative_known")

    def _check_options(self):
        """Validate the constructor arguments (``_parameter_constraints``, then their combinations)."""
        self._validate_params()
        for new, old in self._renamed.items():
            renamed(self, old, new)  # FutureWarning for an old name; both names set differently is an error
        if _check_hashing(self.hashing) is not None and self.num_features is None:
            raise ValueError("num_features: a number of hash buckets is needed with hashing=; got None")

    def _config(self, num_features=None):
        """The configuration saved with the state (constructor arguments, ``fast`` excluded)."""
        d = num_features if num_features is not None else self.__dict__.get("_num_features", self.num_features)
        cfg = {"num_features": None if d is None else int(d), "link": self.link,
               "hashing": _check_hashing(self.hashing)}
        if self._has_batch_size:
            cfg["batch_size"] = int(self.batch_size)
        for key in self._config_keys:
            cfg[key] = self._param(key)
        return cfg

    def _initialised(self):
        return "_num_features" in self.__dict__

    def _drop_state(self):
        """Forget everything learned (``fit`` restarts from the prior)."""
        for key in list(self.__dict__):
            if key in self._state_keys or (key.endswith("_") and not key.startswith("__")):
                delattr(self, key)

    def _reset(self, num_features):
        """Start from the prior with ``num_features`` weights (options already validated)."""
        self.fast_ = resolve_fast(self.fast)
        self._num_features = int(num_features)
        self._new_state(self._num_features)
        self._prior_config = self._config()
        self._prior_params = {k: getattr(self, k) for k in self.get_params(deep=False) if k != "fast"}
        self.n_seen_ = 0
        self.cumulative_log_loss_ = 0.0
        self.n_unconverged_ = 0
        self.n_skipped_ = 0

    def _new_state(self, num_features):
        raise NotImplementedError

    def _check_unchanged(self):
        """Options that shape the running stream cannot change under it (``fit`` restarts); ``fast`` may (the two
        paths give the same updates), and a ``set_params(fast=...)`` takes effect here."""
        self.fast_ = resolve_fast(self.fast)
        if all(getattr(self, k) is v for k, v in self._prior_params.items()):
            return
        now = self._config()
        changed = sorted(k for k in now if now[k] != self._prior_config.get(k))
        if self.num_features is not None and int(self.num_features) != self._num_features:
            changed.append("num_features")
        if changed:
            raise ValueError(f"{', '.join(changed)}: changed after the stream started (was "
                             f"{ {k: self._prior_config.get(k) for k in changed} }); call fit to restart "
                             "from the prior, or set them back")

    # ----------------------------------------------------------------- input
    def _validate_X(self, X, reset):
        """``X`` as canonical CSR with the state's number of columns; sets ``n_features_in_`` when ``reset``."""
        X = from_torch(X)
        hashing = _check_hashing(self.hashing)
        if hashing is None:
            X = validate_data(self, X, reset=reset, accept_sparse="csr", dtype=np.float64)
            d = self.__dict__.get("_num_features") if not reset else (
                X.shape[1] if self.num_features is None else self.num_features)
        else:  # any number of input columns: no n_features_in_
            X = check_array(X, accept_sparse="csr", dtype=np.float64)
            d = self.num_features if reset else self._num_features
            if reset:
                for attr in ("n_features_in_", "feature_names_in_"):
                    self.__dict__.pop(attr, None)
        return to_csr(X, d, hashing)

    def _validate_y(self, y, n, classes):
        """Labels as ``+-1`` floats; sets or checks ``classes_``."""
        y = column_or_1d(from_torch(y), warn=True)
        if y.shape[0] != n:
            raise ValueError(f"y: expected {n} labels (one per row of X), got {y.shape[0]}")
        if y.dtype.kind in "fc" and not np.all(np.isfinite(y)):
            raise ValueError("Input y contains NaN or infinity")
        if y.dtype.kind in "fc" and np.any(y != np.round(y)):
            raise ValueError(f"Unknown label type: continuous. y: {type(self).__name__} is a binary classifier "
                             "and needs class labels")
        labels = np.unique(y)
        if classes is not None:
            classes = np.unique(from_torch(classes))
            if classes.shape[0] != 2:
                raise ValueError(f"classes: Only binary classification is supported; expected two labels, got "
                                 f"{classes.tolist()}")
            if hasattr(self, "classes_") and self._negative_known and not (
                    self.classes_.shape == classes.shape and np.all(self.classes_ == classes)):
                raise ValueError(f"classes: {classes.tolist()} differs from the classes of earlier batches "
                                 f"{self.classes_.tolist()}")
            self.classes_ = classes
            self._negative_known = True
        if not hasattr(self, "classes_"):
            self._set_classes(labels)
        elif not self._negative_known and labels.size and labels.dtype.kind in "biuf":
            # the stream has shown only the label 1 so far: its negative label may be 0 or -1
            neg = labels[labels != 1]
            if neg.size == 1 and float(neg[0]) in _NUMERIC_CODINGS:
                self.classes_ = np.array(_NUMERIC_CODINGS[float(neg[0])], dtype=labels.dtype)
                self._negative_known = True
        bad = labels[~np.isin(labels, self.classes_)]
        if bad.size:
            if labels.dtype.kind in "iuf" and np.all(np.isin(np.concatenate([labels, self.classes_]), [-1, 0, 1])):
                raise ValueError(f"y: mixes the codings {{0, 1}} and {{-1, +1}}: labels {bad.tolist()} after "
                                 f"classes {self.classes_.tolist()} of earlier batches")
            raise ValueError(f"y: labels {bad[:5].tolist()} are not among the classes {self.classes_.tolist()} "
                             "of earlier batches (or of classes=)")
        return np.where(y == self.classes_[1], 1.0, -1.0)

    def _set_classes(self, labels):
        if labels.shape[0] > 2:
            if labels.dtype.kind in "iuf" and np.all(np.isin(labels, [-1, 0, 1])):
                raise ValueError("y: mixes the codings {0, 1} and {-1, +1} (found 0 and -1). "
                                 "Only binary classification is supported.")
            raise ValueError(f"Only binary classification is supported. y: found {labels.shape[0]} classes "
                             f"{labels[:5].tolist()}")
        if labels.shape[0] == 2:
            self.classes_ = labels
            self._negative_known = True
            return
        if labels.shape[0] == 1 and labels.dtype.kind in "biuf" and float(labels[0]) in (0.0, 1.0, -1.0):
            v = float(labels[0])
            self.classes_ = np.array(_NUMERIC_CODINGS.get(v, (0, 1)), dtype=labels.dtype)
            self._negative_known = v != 1.0
            return
        found = "no labels" if labels.shape[0] == 0 else f"one class ({labels[0]!r})"
        raise ValueError(f"y: the first batch holds {found}; pass classes=[negative, positive] to partial_fit "
                         "(binary classification needs two classes)")

    # ----------------------------------------------------------------- fit
    def partial_fit(self, X, y, classes=None, return_predictions=False, return_log_loss=False):
        """Process the rows of ``X`` one by one: predict ``y_t``, then update on it.

        :param X: ``(n, num_features)`` design: SciPy sparse (CSR preferred; never densified),
            NumPy, pandas or torch (dense or sparse); empty rows are allowed (the prediction is the
            prior's, and nothing is updated).  The first call fixes ``num_features`` when it is
            ``None`` (the number of columns of ``X``).
        :param y: ``(n,)`` labels, two distinct values overall (``classes_``).
        :param classes: the two labels, as in :meth:`sklearn.linear_model.SGDClassifier.partial_fit`;
            needed on the first call when its batch holds a single label other than 0, 1 or -1.
        :param bool return_predictions: return ``P(y_t = classes_[1] | x_t, past)`` computed
            *before* the update on row ``t`` (progressive validation), shape ``(n,)``.
        :param bool return_log_loss: return the progressive log-loss ``-log p_t(y_t)``, ``(n,)``.
        :returns: ``self``, or the requested NumPy arrays (a tuple when both are requested).
        :raises FloatingPointError: the batch left float64 -- a row's score (moments) or log loss overflowed, or an
            update wrote a mean or weight that is not finite or a variance below the smallest normal float64 --;
            the message names the row and column that broke first, and the batch was not applied (the state is
            as before the call).
        """
        first = not self._initialised()
        self._check_options()
        if not first:
            self._check_unchanged()
        else:
            self.__dict__.pop("classes_", None)
            self._negative_known = False
        Xc = self._validate_X(X, reset=first)
        labels = self.__dict__.get("classes_"), self.__dict__.get("_negative_known")  # before this batch's labels
        ypm = self._validate_y(y, Xc.shape[0], classes)
        if first:
            self._reset(Xc.shape[1])
        n = Xc.shape[0]
        p1 = np.empty(n)
        ll = np.empty(n)
        unconverged = skipped = 0
        if n:
            # int32 or int64 index arrays as they come (the kernels are compiled for both): no copy of the chunk
            indptr, indices = Xc.indptr, Xc.indices
            data = Xc.data
            # a chunk is applied whole or not at all: the values it may change are saved first (O(nnz)), and
            # restored on any exception, KeyboardInterrupt included
            snap = self._snapshot(indices, labels)
            try:
                unconverged, skipped = self._run(indptr, indices, data, ypm, p1, ll)
                total = float(ll.sum())  # NaN when a row's score moments overflowed (the kernels mark it)
                # ... and the state the chunk wrote must be valid: finite, variances >= 2.2e-308 (one vectorised pass)
                if not math.isfinite(total) or self._invalid_state(indices):
                    raise self._overflow_error(Xc, ypm, snap)
                self.n_seen_ += n
                self.cumulative_log_loss_ += total
                self.n_unconverged_ += int(unconverged)
                self.n_skipped_ += int(skipped)
            except BaseException:
                self._restore(snap, first)
                raise
            self.__dict__.pop("_undo", None)
        self.n_iter_ = 1  # passes over the rows of this call, as SGDClassifier.partial_fit; max_iter caps Newton
        if unconverged:
            warnings.warn(f"{type(self).__name__}: {unconverged} inner Newton solves stopped at "
                          f"max_iter={self._param('max_iter')} above tol={self.tol}",
                          ConvergenceWarning, stacklevel=2)
        if skipped:
            warnings.warn(f"{type(self).__name__}: {skipped} mini-batch feature updates were dropped "
                          "because the summed precision was not positive; use a smaller batch_size",
                          ConvergenceWarning, stacklevel=2)
        out = []
        if return_predictions:
            out.append(p1)
        if return_log_loss:
            out.append(ll)
        if not out:
            return self
        return out[0] if len(out) == 1 else tuple(out)

    def _run(self, indptr, indices, data, y, p1, ll):
        """Stream the CSR rows through the compiled kernels or the reference path; ``(unconverged, skipped)``."""
        self.__dict__.pop("_state_checked", None)  # set by a kernel that checks the values it writes (this chunk's)
        if self.fast_:
            return self._run_fast(indptr, indices, data, y, p1, ll)
        return self._run_reference(indptr, indices, data, y, p1, ll)

    # ----------------------------------------------------------------- float64 overflow
    #: what overflows when a row's progressive log loss is not finite (the kernels mark a row whose score does)
    _score_overflow = ("the score moments sum_i x_i mu_i and sum_i x_i^2 sigma_i^2 (Shamir & Szpankowski 2021, "
                       "Eq. (6)) overflow float64 (x^2 times the variance exceeds ~1.8e308)")
    #: the update whose result is checked, what it must give, and the names of the state arrays, in messages
    _update_name = "the update of this feature"
    _state_valid = "finite values"
    _state_names = {}

    def _overflow_hint(self):
        """What to do about an overflowing row (the end of the error message)."""
        return "rescale the features (e.g. standardise them)"

    def _invalid_state(self, indices):
        """Whether a state array holds a value :meth:`load_state_dict` would refuse (not finite, or below the
        floor of its ``_array_constraints``) at the columns ``indices`` a chunk wrote: min and max of each array
        over those entries (over the whole array when it is not longer than ``indices``: contiguous, and the
        entries not written are valid already)."""
        checked = self.__dict__.pop("_state_checked", None)
        if checked is not None:  # the fused kernel checked each value as it wrote it
            return not checked
        for key, a in self._state_arrays().items():
            v = a if a.shape[0] <= indices.shape[0] else a[indices]
            if v.size == 0:
                continue
            lo, hi = v.min(), v.max()  # NaN propagates
            if not (hi < np.inf and lo >= _FLOORS.get(self._array_constraints.get(key), -np.inf) and lo > -np.inf):
                return True
        return False

    def _bad_entries(self, values):
        """``(nnz,)`` mask of the entries whose gathered state ``values`` (``{key: (nnz,) or (nnz, K)}``) is not
        valid (see :meth:`_invalid_state`)."""
        bad = None
        for key, v in values.items():
            ok = np.isfinite(v) & (v >= _FLOORS.get(self._array_constraints.get(key), -np.inf))
            ok = ok.reshape(len(v), -1).all(axis=1)
            bad = ~ok if bad is None else bad | ~ok
        return bad

    def _trial(self, indptr, indices, data, y, rows, snap):
        """Error path: stream rows ``[0, rows)`` of the chunk from the state before it, then restore that state.

        :returns: ``(ll, values)``: ``(rows,)`` progressive log losses and ``{key: (nnz_rows, ...)}`` the state
            arrays at the rows' entries after the run."""
        e = int(indptr[rows])
        p1, ll = np.empty(rows), np.empty(rows)
        try:
            with np.errstate(all="ignore"):  # the reference path meets the same overflow again
                self._run(indptr[:rows + 1], indices[:e], data[:e], y[:rows], p1, ll)
            values = {k: a[indices[:e]] for k, a in self._state_arrays().items()}
        finally:
            self._restore(snap, False)
        return ll, values

    def _overflow_error(self, Xc, y, snap):
        """The error for a chunk that overflowed float64: a row's progressive log loss is not finite (its score
        moments (6) overflowed, the kernels mark it), or the state it wrote is not (a non-finite mean or weight,
        a variance below the smallest normal float64).

        Error path only: the state is restored (``snap``), then the chunk is streamed again from it, its first
        ``m`` rows (whole mini-batches) for a bisection on ``m``, to find the row after which the stream first
        fails: the error names it (a row that inherited a broken state from an earlier one is not blamed).
        The state is left as before the chunk."""
        indptr, indices, data = Xc.indptr, Xc.indices, Xc.data
        self._restore(snap, False)
        n = Xc.shape[0]
        b = int(self.batch_size) if self._has_batch_size else 1
        rows = lambda j: min(n, j * b)  # noqa: E731
        lo, hi = 0, -(-n // b)  # the first lo batches stream cleanly; the first hi do not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ll, values = self._trial(indptr, indices, data, y, rows(mid), snap)
            if np.all(np.isfinite(ll)) and not self._bad_entries(values).any():
                lo = mid
            else:
                hi = mid
        r0, r1 = rows(lo), rows(hi)
        ll, values = self._trial(indptr, indices, data, y, r1, snap)
        over = np.flatnonzero(~np.isfinite(ll[r0:]))
        if over.size:  # the score (moments) of row r0 + over[0] overflowed
            return self._row_error(Xc, r0 + int(over[0]), self._score_overflow + ", or the log loss of the row's "
                                   "prediction does")
        k0 = int(indptr[r0])
        bad = self._bad_entries(values)[k0:]
        if not bad.any():  # not reproduced (cannot happen: the stream is deterministic)
            return FloatingPointError(f"X: this batch overflowed float64; {self._overflow_hint()}. The batch was "
                                      "not applied: the learner's state is as before this call")
        cand = np.flatnonzero(bad) + k0
        k = int(cand[np.argmax(np.abs(data[cand]))])  # the largest |x| among the entries on a broken column
        t = int(np.searchsorted(indptr, k, side="right")) - 1
        got = ", ".join(f"{self._state_names.get(key, key)} = {np.array2string(np.asarray(v[k]), precision=3)}"
                        for key, v in values.items())
        rows_of = f"row {r0}" if r1 - r0 == 1 else f"rows {r0} to {r1 - 1}"
        batch = f", summed over the mini-batch of {rows_of} in natural parameters (Appendix D.1)," if b > 1 else ""
        return self._row_error(Xc, t, f"{self._update_name}{batch} gave {got}, not {self._state_valid} (float64 "
                                      "overflow, underflow or cancellation at this scale of x)", k)

    def _row_error(self, Xc, t, cause, k=None, batch=True):
        """``FloatingPointError`` naming row ``t`` of ``Xc`` and its entry ``k`` (default: the row's largest
        ``|x|``), with ``cause``; ``batch``: raised by :meth:`partial_fit` (the batch was undone)."""
        a, b = int(Xc.indptr[t]), int(Xc.indptr[t + 1])
        if k is None and b > a:
            k = a + int(np.argmax(np.abs(Xc.data[a:b])))
        where = ""
        if k is not None:
            col = "hash bucket" if _check_hashing(self.hashing) is not None else "column"
            where = f", {col} {int(Xc.indices[k])} = {Xc.data[k]:.3g}"
        undone = " The batch was not applied: the learner's state is as before this call" if batch else ""
        return FloatingPointError(f"X: row {t}{' of this batch' if batch else ''}{where}: {cause}; "
                                  f"{self._overflow_hint()}.{undone}")

    def _check_scores(self, Xc, *arrays):
        """Predictions: ``FloatingPointError`` naming the first row of ``Xc`` where one of ``arrays``
        (``(n,)`` or ``(n, K)`` scores or score moments) is not finite (float64 overflow)."""
        for a in arrays:
            a = np.asarray(a)
            if not np.all(np.isfinite(a)):
                t = int(np.flatnonzero(~np.isfinite(a.reshape(len(a), -1)).all(axis=1))[0])
                raise self._row_error(Xc, t, self._score_overflow + ": the prediction would be meaningless",
                                      batch=False)

    _undo_log = False  # True: the fast kernels record old values (see _snapshot)
    _SCALARS = ("n_seen_", "cumulative_log_loss_", "n_unconverged_", "n_skipped_", "_negative_known")

    def _snapshot(self, indices, labels):
        """What a chunk with column ``indices`` may change: those entries of the state arrays, the counters,
        ``classes_`` and the extra state; ``labels``: ``(classes_, _negative_known)`` before the chunk's labels
        were read (they may name the negative class)."""
        self.__dict__.pop("_undo", None)
        if self.fast_ and self._undo_log:  # the kernel records the old values as it writes them
            arrays = None
        else:
            arrays = {k: a[indices] for k, a in self._state_arrays().items()}  # fancy indexing copies
        scalars = {k: self.__dict__[k] for k in self._SCALARS if k in self.__dict__}
        classes, negative_known = labels
        if negative_known is not None:
            scalars["_negative_known"] = negative_known
        extra = self._extra_state()
        return indices, arrays, scalars, None if classes is None else classes.copy(), extra

    def _restore(self, snap, first):
        """Undo a chunk (``first``: forget the state, as before the first call)."""
        if first:
            self._drop_state()
            self.__dict__.pop("classes_", None)
            return
        indices, arrays, scalars, classes, extra = snap
        if arrays is None:
            undo = self.__dict__.pop("_undo", None)
            if undo is not None:  # the kernel ran: replay its record of old values
                if undo[0].ndim == 2:  # (K, d) members (prior_var="auto", or one learner as K = 1)
                    mu, s2 = (self._mu.T, self._s2.T) if self._mu.ndim == 2 else (self._mu[None], self._s2[None])
                    _kernels().undo_multi(undo[3], undo[2], mu, s2, undo[0], undo[1], undo[4], undo[5])
                else:
                    _kernels().undo(undo[2], self._mu, self._s2, undo[0], undo[1])
        else:
            for k, a in self._state_arrays().items():
                a[indices] = arrays[k]
        self.__dict__.update(scalars)
        if classes is not None:
            self.classes_ = classes
        self._load_extra_state(extra)

    def fit(self, X, y):
        """Restart from the prior and make one pass of :meth:`partial_fit` over ``(X, y)``; returns ``self``.

        :param X: ``(n, d)`` design (see :meth:`partial_fit`).
        :param y: ``(n,)`` labels, two distinct values.
        :raises ValueError: for labels of one class (:meth:`partial_fit` takes a stream's first rows of one class
            with ``classes=``).
        """
        labels = np.unique(np.asarray(from_torch(y)).ravel()) if y is not None else np.zeros(0)
        if labels.size == 1:  # fit restarts from the prior: nothing tells the other class (0 or -1) or its side
            raise ValueError(f"y: The number of classes has to be greater than one; got 1 class "
                             f"({labels[0].item()!r}); for a stream whose first rows hold one class, pass both to "
                             "partial_fit(X, y, classes=[...])")
        self._drop_state()
        return self.partial_fit(X, y)

    # ----------------------------------------------------------------- predict
    def _transform(self, X):
        check_is_fitted(self, "n_seen_")
        self._check_options()
        self._check_unchanged()
        return self._validate_X(X, reset=False)

    def decision_function(self, X):
        """``(n,)`` the predictive probability on the link scale, ``F^{-1}(P(y = classes_[1] | x))``.

        Positive values favour ``classes_[1]``; for the logit link this is the log-odds of
        :meth:`predict_proba`.

        :raises FloatingPointError: naming the first row whose score (moments) overflow float64.
        """
        return self._score(self._transform(X))

    def _outputs(self, X):
        s = self._score(self._transform(X))
        p = eq.link_cdf(s, self.link)
        return s, np.stack([1.0 - p, p], axis=1), np.stack([eq.log_link_cdf(-s, self.link),
                                                           eq.log_link_cdf(s, self.link)], axis=1)

    # ----------------------------------------------------------------- state
    def _state_arrays(self):
        raise NotImplementedError

    def state_dict(self):
        """A picklable snapshot (config, per-feature arrays, counters, classes) to resume a stream.

        Before the first :meth:`partial_fit` it is the prior's state (``num_features`` must be set).

        Example::

            >>> from pyro_convexvb.online import OnlineBayesLogistic
            >>> m = OnlineBayesLogistic(3)
            >>> m2 = OnlineBayesLogistic.from_state_dict(m.state_dict())
        """
        if not self._initialised():
            if self.num_features is None:
                raise ValueError("num_features: unknown before the first partial_fit; set it to save the prior state")
            self._check_options()
            fresh = self.__sklearn_clone__()
            fresh._reset(fresh.num_features)
            return fresh.state_dict()
        classes = getattr(self, "classes_", None)
        state = {"class": type(self).__name__, "config": _plain(self._config()),
                 "n_seen": int(self.n_seen_), "cumulative_log_loss": float(self.cumulative_log_loss_),
                 "n_unconverged": int(self.n_unconverged_), "n_skipped": int(self.n_skipped_),
                 "classes": None if classes is None else _plain(classes.tolist()),
                 "negative_known": bool(self.__dict__.get("_negative_known", False)),
                 "n_features_in": None if not hasattr(self, "n_features_in_") else int(self.n_features_in_),
                 "feature_names_in": (None if not hasattr(self, "feature_names_in_")
                                      else [str(v) for v in self.feature_names_in_])}
        state.update({k: torch.from_numpy(v.copy()) for k, v in self._state_arrays().items()})
        extra = self._extra_state()
        if extra:
            state["extra"] = _plain(extra)
        return state

    def _extra_state(self):
        return None

    def _load_extra_state(self, extra):
        pass

    #: constraints on the state arrays, checked by :meth:`load_state_dict` and after every chunk of
    #: :meth:`partial_fit`: ``"positive"`` (a normal float64, ``>= 2.2e-308``: a precision ``1 / sigma^2`` is then
    #: finite) or ``"nonnegative"``; every entry must also be finite
    _array_constraints = {}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output; the configuration must match this estimator's.

        Over 80 lines: every saved field is checked in turn against the estimator's options.

        :raises ValueError: naming the key, for a missing key, an array of the wrong shape, non-finite values,
            a non-positive variance, a negative counter, or a configuration that differs from this estimator's.
        """
        if not isinstance(state, dict):
            raise ValueError(f"state: expected a dict from state_dict(), got {type(state).__name__}")
        for key in ("class", "config", "n_seen", "cumulative_log_loss", "n_unconverged", "n_skipped"):
            if key not in state:
                raise ValueError(f"state[{key!r}]: missing; not a state_dict() of {type(self).__name__}")
        if state.get("class") != type(self).__name__:
            raise ValueError(f"state['class']: saved from {state.get('class')!r}, cannot load into "
                             f"{type(self).__name__}")
        saved = state["config"]
        if isinstance(saved, dict):  # states saved before the renames (maxiter)
            saved = self._current_names(saved)
        if not isinstance(saved, dict) or "num_features" not in saved:
            raise ValueError("state['config']: expected the configuration dict with 'num_features'")
        d = saved["num_features"]
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
            raise ValueError(f"state['config']['num_features']: expected a positive integer, got {d!r}")
        mine = self._config(num_features=d if self.num_features is None else None)
        if _plain(saved) != _plain(mine):
            raise ValueError(f"state['config']: configuration {saved} differs from this estimator's "
                             f"{mine}; use {type(self).__name__}.from_state_dict(state)")
        counters = {}
        for key in ("n_seen", "n_unconverged", "n_skipped"):
            v = state[key]
            if isinstance(v, torch.Tensor):
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"state[{key!r}]: expected a non-negative integer, got {v!r}")
            counters[key] = int(v)
        loss = state["cumulative_log_loss"]
        loss = loss.item() if isinstance(loss, torch.Tensor) else loss
        if isinstance(loss, bool) or not isinstance(loss, (int, float, np.number)) or not (
                math.isfinite(loss) and loss >= 0):
            raise ValueError(f"state['cumulative_log_loss']: expected a finite number >= 0, got {loss!r}")
        self._drop_state()
        self._reset(int(d))
        arrays = self._state_arrays()
        loaded = {}
        for key, arr in arrays.items():
            if key not in state:
                raise ValueError(f"state[{key!r}]: missing")
            new = from_torch(state[key])
            new = np.asarray(new, dtype=np.float64) if not isinstance(new, np.ndarray) else new.astype(
                np.float64, copy=False)
            if new.shape != arr.shape:
                self._drop_state()
                raise ValueError(f"state[{key!r}]: expected shape {arr.shape}, got {new.shape}")
            if not np.all(np.isfinite(new)):
                self._drop_state()
                raise ValueError(f"state[{key!r}]: holds NaN or infinite values")
            rule = self._array_constraints.get(key)
            if rule is not None and not np.all(new >= _FLOORS[rule]):
                self._drop_state()
                raise ValueError(f"state[{key!r}]: expected {rule} values (variances, at least the smallest normal "
                                 f"float64 {_FLOORS['positive']:.3g}; sums of squares), got minimum {new.min()!r}")
            loaded[key] = new
        for key, arr in arrays.items():
            arr[...] = loaded[key]
        self.n_seen_ = counters["n_seen"]
        self.cumulative_log_loss_ = float(loss)
        self.n_unconverged_ = counters["n_unconverged"]
        self.n_skipped_ = counters["n_skipped"]
        classes = state.get("classes")
        if classes is None and "coding" in state:  # states saved before classes_ existed
            classes = {"01": [0, 1], "pm1": [-1, 1]}.get(state["coding"])
        self._negative_known = bool(state.get("negative_known", classes is not None))
        if classes is not None:
            classes = np.asarray(classes)
            if classes.shape != (2,) or classes[0] == classes[1]:
                self._drop_state()
                raise ValueError(f"state['classes']: expected two distinct labels, got {classes.tolist()}")
            self.classes_ = classes
        if state.get("n_features_in") is not None:
            self.n_features_in_ = int(state["n_features_in"])
        if state.get("feature_names_in") is not None:
            self.feature_names_in_ = np.asarray(state["feature_names_in"], dtype=object)
        try:
            self._load_extra_state(state.get("extra"))
        except ValueError:
            self._drop_state()
            raise
        return self

    @classmethod
    def from_state_dict(cls, state, fast=None):
        """A new estimator with the saved configuration and state (validated as by :meth:`load_state_dict`)."""
        if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
            raise ValueError("state['config']: missing; not a state_dict() output")
        return cls(**cls._current_names(state["config"]), fast=fast).load_state_dict(state)

    @classmethod
    def _current_names(cls, config):
        old = {o: n for n, o in cls._renamed.items()}
        return {old.get(k, k): v for k, v in config.items()}


class OnlineDiagonalGaussian(OnlineEstimatorBase):
    """Base of the methods that keep a diagonal Gaussian ``N(mu_i, sigma^2_i)`` per feature.

    Predictions use Eq. (8) (logit) or Eq. (24) (probit) of Shamir & Szpankowski 2021 for every method.
    With ``batch_size > 1`` every row of a mini-batch is predicted and updated from the state at
    the start of the batch, and the per-row updates are summed in natural parameters
    (precision ``1/sigma^2`` and ``mu/sigma^2``), the mini-batch remark of Appendix D.1;
    ``batch_size=1`` is the exact sequential algorithm.  Batches never span two calls.
    """

    _method_code = None

    _parameter_constraints = {**OnlineEstimatorBase._parameter_constraints, "prior_mean": [Real, "array-like"],
                              "prior_var": POSITIVE + ["array-like", str], "batch_size": POSITIVE_INT}

    def __init__(self, num_features=None, prior_mean=0.0, prior_var=1.0, link="logit", hashing=None,
                 batch_size=1, fast=None):
        self.num_features = num_features
        self.prior_mean = prior_mean
        self.prior_var = prior_var
        self.link = link
        self.hashing = hashing
        self.batch_size = batch_size
        self.fast = fast

    _array_constraints = {"s2": "positive"}
    _supports_auto = False
    _undo_log = True
    _state_names = {"mu": "mu_i", "s2": "sigma_i^2"}
    _state_valid = "a finite mean and a finite variance of at least 2.2e-308 (the smallest normal float64)"

    def _auto(self):
        return isinstance(self.prior_var, str)

    def _check_options(self):
        super()._check_options()
        if isinstance(self.prior_var, str):
            if self.prior_var != "auto":
                raise ValueError(f"prior_var: expected a positive number, a (num_features,) array or 'auto', got "
                                 f"{self.prior_var!r}")
            if not self._supports_auto:
                raise ValueError(f"prior_var: 'auto' is implemented for OnlineBayesLogistic only; give "
                                 f"{type(self).__name__} a number")
        if getattr(self, "mean_update", "newton") != "newton":  # tol and max_iter belong to the Newton iteration
            warn_unused(self, ("tol", "max_iter", "maxiter"),
                        f"mean_update={self.mean_update!r} is one closed-form step; tol and max_iter bound "
                        "mean_update='newton'")

    def _config(self, num_features=None):
        cfg = super()._config(num_features)
        cfg["prior_mean"] = _plain(self.prior_mean if np.ndim(self.prior_mean) == 0 else np.asarray(self.prior_mean))
        cfg["prior_var"] = (self.prior_var if isinstance(self.prior_var, str) else
                            _plain(self.prior_var if np.ndim(self.prior_var) == 0 else np.asarray(self.prior_var)))
        return cfg

    def _new_state(self, num_features):
        mu = per_feature(self.prior_mean, num_features, "prior_mean")
        # The state is stored member by member ((K, d), C order: a member's state is contiguous, so once Occam's
        # window has dropped the others a kernel touches one learner's memory), seen as (d, K) views.  For the
        # fused kernel a feature's mean and variance are also interleaved: ``_pair`` ((K, d, 2), C order; K = 1
        # for one learner) is what it reads, so an update finds both in one cache line.
        pair = self._fused()
        if self._auto():
            grid = np.asarray(AUTO_PRIOR_VARS, dtype=np.float64)
            store = np.empty((len(grid), num_features, 2) if pair else (2, len(grid), num_features))
            store_mu, store_s2 = (store[..., 0], store[..., 1]) if pair else (store[0], store[1])
            store_mu[:] = mu
            store_s2[:] = grid[:, None]
            self._mu, self._s2 = store_mu.T, store_s2.T
            self._member_loss = np.zeros(len(grid))
            self._member_active = np.ones(len(grid), dtype=bool)
        else:
            s2 = per_feature(self.prior_var, num_features, "prior_var", positive=True)
            if pair:
                store = np.empty((1, num_features, 2))
                store[0, :, 0] = mu
                store[0, :, 1] = s2
                mu, s2 = store[0, :, 0], store[0, :, 1]
            self._mu = mu
            self._s2 = s2
        self._pair = store if pair else None

    def _bind_pair(self):
        """``_mu``, ``_s2`` as the views of ``_pair`` that :meth:`_new_state` makes."""
        if self._auto():
            self._mu, self._s2 = self._pair[..., 0].T, self._pair[..., 1].T
        else:
            self._mu, self._s2 = self._pair[0, :, 0], self._pair[0, :, 1]

    def __getstate__(self):
        state = dict(super().__getstate__())
        if state.get("_pair") is not None:  # the views are rebuilt on loading (a pickle would copy each)
            state.pop("_mu", None)
            state.pop("_s2", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.__dict__.get("_pair") is not None:
            self._bind_pair()

    def _state_arrays(self):
        return {"mu": self._mu, "s2": self._s2}

    def _extra_state(self):
        if not self._auto():
            return None
        return {"prior_var_grid": list(AUTO_PRIOR_VARS), "member_log_loss": self._member_loss.tolist(),
                "member_active": [bool(v) for v in self._member_active]}

    def _load_extra_state(self, extra):
        if not self._auto():
            return
        if not isinstance(extra, dict) or "member_log_loss" not in extra:
            raise ValueError("state['extra']['member_log_loss']: missing (needed with prior_var='auto')")
        if list(extra.get("prior_var_grid", ())) != list(AUTO_PRIOR_VARS):
            raise ValueError(f"state['extra']['prior_var_grid']: {extra.get('prior_var_grid')} differs from this "
                             f"version's grid {list(AUTO_PRIOR_VARS)}")
        loss = np.asarray(extra["member_log_loss"], dtype=np.float64)
        if loss.shape != (len(AUTO_PRIOR_VARS),) or not np.all(np.isfinite(loss)) or not np.all(loss >= 0):
            raise ValueError(f"state['extra']['member_log_loss']: expected {len(AUTO_PRIOR_VARS)} finite values "
                             f">= 0, got {extra['member_log_loss']!r}")
        active = np.asarray(extra.get("member_active", [True] * len(AUTO_PRIOR_VARS)))
        if active.shape != loss.shape or active.dtype != bool or not active.any():
            raise ValueError(f"state['extra']['member_active']: expected {len(AUTO_PRIOR_VARS)} booleans, not all "
                             f"False, got {extra.get('member_active')!r}")
        self._member_loss = loss
        self._member_active = active

    # ------------------------------------------------------------ Bayesian model averaging (prior_var="auto")
    @property
    def prior_var_weights_(self):
        """``(K,)`` posterior probabilities of the prior variances :data:`AUTO_PRIOR_VARS` (``prior_var="auto"``):
        ``softmax(-member_log_loss)``, the members' cumulative predictive log likelihoods."""
        check_is_fitted(self, "n_seen_")
        if not self._auto():
            raise AttributeError("prior_var_weights_: only with prior_var='auto'")
        return _softmax(np.where(self._member_active, -self._member_loss, -np.inf))

    def _member_scores(self, Xc):
        """``(n, K)`` scores ``mu_t / c(sigma^2_t)`` of every member (Eqs. (6), (8)).

        :raises FloatingPointError: a row's score moments overflow float64."""
        mu_t, s2_t = self._moments(Xc)
        return mu_t / eq.shrinkage(s2_t, self.link)

    def _moments(self, Xc):
        """Eq. (6) for every row of ``Xc`` (``(n,)`` each, ``(n, K)`` with ``prior_var="auto"``).

        :raises FloatingPointError: naming the first row whose moments overflow float64 (the prediction from them
            would be meaningless: ``c(inf)`` shrinks any score to 0)."""
        with np.errstate(over="ignore", invalid="ignore"):
            mu_t, s2_t = np.asarray(Xc @ self._mu), np.asarray(Xc.multiply(Xc) @ self._s2)
        self._check_scores(Xc, mu_t, s2_t)
        return mu_t, s2_t

    # ------------------------------------------------------------ attributes
    @property
    def coef_(self):
        """``(num_features,)`` posterior means ``mu_i`` (a copy; with ``prior_var="auto"`` the mean of the
        model average, ``sum_k w_k mu_ik``)."""
        check_is_fitted(self)
        if self._auto():
            return self._mu @ self.prior_var_weights_
        return self._mu.copy()

    @property
    def coef_var_(self):
        """``(num_features,)`` posterior variances ``sigma^2_i`` (a copy): per-feature uncertainty (with
        ``prior_var="auto"`` the variance of the mixture, ``sum_k w_k (sigma^2_ik + mu_ik^2) - coef_^2``)."""
        check_is_fitted(self)
        if self._auto():
            w = self.prior_var_weights_
            m = self._mu @ w
            return np.maximum((self._s2 + self._mu ** 2) @ w - m ** 2, 0.0)
        return self._s2.copy()

    # ------------------------------------------------------------ predictions
    def score_moments(self, X):
        """Shamir & Szpankowski 2021, Eq. (6) for every row: mean and variance of the score ``x_t^T w``.

        :param X: ``(n, num_features)``.
        :returns: ``(mu_t, sigma2_t)``, NumPy arrays ``(n,)`` each: the per-example predictive uncertainty.
        :raises FloatingPointError: naming the first row whose moments overflow float64.
        """
        Xc = self._transform(X)
        mu_t, s2_t = self._moments(Xc)
        if self._auto():  # moments of the model average
            w = self.prior_var_weights_
            m = mu_t @ w
            with np.errstate(over="ignore", invalid="ignore"):
                v = np.maximum((s2_t + mu_t ** 2) @ w - m ** 2, 0.0)
            self._check_scores(Xc, v)
            return m, v
        return mu_t, s2_t

    def _score(self, Xc):
        """``F^{-1}`` of Eq. (8) / (24): ``mu_t / c(sigma^2_t)`` for a canonical CSR matrix (with
        ``prior_var="auto"``, ``F^{-1}`` of the averaged probability)."""
        if self._auto():
            z = self._member_scores(Xc)
            with np.errstate(divide="ignore"):  # a member outside Occam's window has weight 0
                logw = np.log(self.prior_var_weights_)
            lp1 = _logsumexp(eq.log_link_cdf(z, self.link) + logw)
            lp0 = _logsumexp(eq.log_link_cdf(-z, self.link) + logw)
            if self.link == "logit":
                return lp1 - lp0
            from scipy.special import ndtri

            return np.where(lp1 < lp0, ndtri(np.exp(lp1)), -ndtri(np.exp(lp0)))
        mu_t, s2_t = self._moments(Xc)
        return mu_t / eq.shrinkage(s2_t, self.link)

    def _mix(self, p1k, llk, p1, ll, until, active):
        """Model average of the members' progressive predictions ``p1k``, losses ``llk`` (``(n, K)``) into
        ``p1``, ``ll`` (``(n,)``); member ``k`` takes part in rows ``t < until[k]`` if it was active at the
        start.  Advances the members' cumulative log losses; ``active`` ``(K,)`` is the active set at the end of
        the chunk (a member that left on the chunk's last row has ``until[k] = n``, as one that stayed)."""
        # sequential sums from the running totals: the same numbers however the stream is cut into chunks
        cum = np.cumsum(np.concatenate([self._member_loss[None, :], llk]), axis=0)
        before = cum[:-1]
        rows = np.arange(len(llk))[:, None]
        inside = self._member_active[None, :] & (rows < until[None, :])
        score = np.where(inside, -before, -np.inf)
        logw = score - _logsumexp(score)[:, None]  # log P(prior k | y_1..y_{t-1}) within Occam's window
        p1[:] = np.sum(np.where(inside, np.exp(logw) * p1k, 0.0), axis=1)
        ll[:] = -_logsumexp(np.where(inside, logw - llk, -np.inf))
        self._member_loss = cum[-1].copy()
        self._member_active = self._member_active & np.asarray(active, dtype=bool)

    # ------------------------------------------------------------ streaming
    def _kernel_flags(self):
        """``(mean_newton, var_value, tol, maxiter)`` for the kernel."""
        return False, False, 1e-12, 50

    def _samples(self, n):
        return np.empty((1, 0))

    def _fused(self):
        """Whether the stream runs through :func:`~pyro_convexvb.online._kernels.run_alg1_fused` (Algorithm 1 with
        the default Taylor mean and Laplace variance, one row at a time)."""
        mean_newton, var_value, _, _ = self._kernel_flags()
        return self._method_code == 0 and not mean_newton and not var_value and int(self.batch_size) == 1

    def _run_fast(self, indptr, indices, data, y, p1, ll):
        k = _kernels()
        mean_newton, var_value, tol, maxiter = self._kernel_flags()
        link = k.LOGIT if self.link == "logit" else k.PROBIT
        auto = self._auto()
        if auto or self._fused():
            mu, s2 = (self._mu.T, self._s2.T) if auto else (self._mu[None], self._s2[None])
            K = mu.shape[0]
            active = self._member_active.astype(np.uint8) if auto else np.ones(1, dtype=np.uint8)
            slot = np.where(active > 0, np.cumsum(active) - 1, -1).astype(np.int64)
            S = int(active.sum())
            until = np.full(K, len(y), dtype=np.int64)
            cum = self._member_loss.copy() if auto else np.zeros(1)
            # the old values of every entry a member writes (rolled back if the chunk does not complete)
            self._undo = (np.empty((S, len(indices))), np.empty((S, len(indices))), indices, indptr, slot, until)
        if auto or self._fused():
            if self._fused():
                bad = np.zeros(1, dtype=np.uint8)
                out = k.run_alg1_fused(link, indptr, indices, data, y, self._pair, p1, ll, self._undo[0], self._undo[1],
                                       slot, cum, active, until, AUTO_LOG_WINDOW if auto else np.inf, bad)
                self._state_checked = not bool(bad[0])  # the kernel checked every value it wrote
                if auto:
                    self._member_loss = cum
                    self._member_active = self._member_active & active.astype(bool)
                return out
            width = int(np.diff(indptr).max(initial=0))
            p1k, llk = np.empty((len(y), K)), np.empty((len(y), K))
            if int(self.batch_size) > 1:
                acc_h, acc_eta = np.zeros((K, self._num_features)), np.zeros((K, self._num_features))
            else:
                acc_h = acc_eta = np.empty((K, 0))
            out = k.run_diagonal_multi(self._method_code, link, bool(mean_newton), bool(var_value), float(tol),
                                       int(maxiter), int(self.batch_size), indptr, indices, data, y, mu, s2,
                                       self._samples(len(y)), p1k, llk, acc_h, acc_eta, np.empty(width),
                                       np.empty(width), self._undo[0], self._undo[1], slot, cum.copy(), active,
                                       until, AUTO_LOG_WINDOW)
            self._mix(p1k, llk, p1, ll, until, active)
            return out
        width = int(np.diff(indptr).max(initial=0))
        if int(self.batch_size) > 1:
            acc_h = np.zeros(self._num_features)
            acc_eta = np.zeros(self._num_features)
        else:
            acc_h = acc_eta = np.empty(0)
        self._undo = (np.empty(len(indices)), np.empty(len(indices)), indices)
        return k.run_diagonal(self._method_code, link, bool(mean_newton), bool(var_value), float(tol),
                              int(maxiter), int(self.batch_size), indptr, indices, data, y, self._mu, self._s2,
                              self._samples(len(y)), p1, ll, acc_h, acc_eta, np.empty(width), np.empty(width),
                              self._undo[0], self._undo[1])

    def _reference_update(self, x, y, mu_i, s2_i, mu_t, s2_t, log_p_t, samples):
        """New ``(mu, s2, n_unconverged)`` for the row's features; implemented per method."""
        raise NotImplementedError

    def _run_reference(self, indptr, indices, data, y, p1, ll):
        if self._auto():  # batch by batch, the active members one after the other, then Occam's window
            K = self._mu.shape[1]
            n = len(y)
            p1k, llk = np.full((n, K), 0.5), np.zeros((n, K))
            unconverged = skipped = 0
            active = self._member_active.copy()
            cum = self._member_loss.copy()
            until = np.full(K, n, dtype=np.int64)
            batch = int(self.batch_size)
            for b0 in range(0, n, batch):
                b1 = min(n, b0 + batch)
                sub = indptr[b0:b1 + 1] - indptr[b0]
                sl = slice(indptr[b0], indptr[b1])
                for m in np.flatnonzero(active):
                    u, sk = self._run_members(sub, indices[sl], data[sl], y[b0:b1], p1k[b0:b1, m], llk[b0:b1, m],
                                              self._mu[:, m], self._s2[:, m])
                    unconverged += u
                    skipped += sk
                    for t in range(b0, b1):
                        cum[m] += llk[t, m]
                drop = active & (cum - cum[active].min() > AUTO_LOG_WINDOW)
                until[drop] = b1
                active &= ~drop
            self._mix(p1k, llk, p1, ll, until, active)
            return unconverged, skipped
        return self._run_members(indptr, indices, data, y, p1, ll, self._mu, self._s2)

    def _run_members(self, indptr, indices, data, y, p1, ll, mu, s2):
        n = len(y)
        unconverged = skipped = 0
        samples = self._samples(n)
        batched = int(self.batch_size) > 1
        batch = int(self.batch_size)
        if batched:
            acc_h = np.zeros(self._num_features)
            acc_eta = np.zeros(self._num_features)
            new_mu, new_s2 = np.zeros(len(indices)), np.ones(len(indices))  # each entry's update by its row
        for b0 in range(0, n, batch):
            b1 = min(n, b0 + batch)
            for t in range(b0, b1):
                sl = slice(indptr[t], indptr[t + 1])
                idx, x = indices[sl], data[sl]
                mu_i, s2_i = mu[idx], s2[idx]
                with np.errstate(over="ignore", invalid="ignore"):
                    mu_t, s2_t = eq.score_moments(x, mu_i, s2_i)  # Eq. (6)
                if not math.isfinite(mu_t + s2_t):  # overflow: partial_fit reports the row and undoes the chunk
                    p1[t], ll[t] = 0.5, math.nan
                    return unconverged, skipped
                p1[t] = eq.predict_proba(mu_t, s2_t, self.link)  # Eq. (8) / (24)
                log_p_t = float(eq.log_link_cdf(y[t] * mu_t / eq.shrinkage(s2_t, self.link), self.link))
                ll[t] = -log_p_t
                if len(idx) == 0:
                    continue
                mu_new, s2_new, nu = self._reference_update(x, y[t], mu_i, s2_i, mu_t, s2_t, log_p_t,
                                                            samples[t] if samples.shape[1] else None)
                unconverged += nu
                if batched:
                    np.add.at(acc_h, idx, 1.0 / s2_new - 1.0 / s2_i)
                    np.add.at(acc_eta, idx, mu_new / s2_new - mu_i / s2_i)
                    new_mu[sl], new_s2[sl] = mu_new, s2_new
                else:
                    mu[idx], s2[idx] = mu_new, s2_new
            if batched:
                # a row's update that overflowed marks its features' sums (an infinite variance would otherwise
                # look like a zero precision, and the update be dropped as if the summed precision were not positive)
                sl = slice(indptr[b0], indptr[b1])
                valid = np.isfinite(new_mu[sl]) & (new_s2[sl] > 0) & (new_s2[sl] < np.inf)
                acc_h[indices[sl][~valid]] = np.nan
                touched = np.unique(indices[indptr[b0]:indptr[b1]])
                touched = touched[(acc_h[touched] != 0) | (acc_eta[touched] != 0)]
                h = 1.0 / s2[touched] + acc_h[touched]
                finite = np.isfinite(h)
                ok = (h > 0) & finite
                skipped += int((finite & ~ok).sum())
                # a sum of precisions that overflowed (or a row's update that did) is not a dropped update: the
                # variance is marked NaN, so that partial_fit's check of the state names the row and undoes the chunk
                s2[touched[~finite]] = np.nan
                good = touched[ok]
                eta = mu[good] / s2[good] + acc_eta[good]
                s2[good] = 1.0 / h[ok]
                mu[good] = eta / h[ok]
                acc_h[touched] = 0.0
                acc_eta[touched] = 0.0
        return unconverged, skipped
