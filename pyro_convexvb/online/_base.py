"""Shared machinery of the online estimators: input handling, streaming driver, state."""
import warnings

import numpy as np

from ..errors import ConvergenceWarning
from . import equations as eq
from ._validation import (check_choice, check_positive_float, per_feature, to_csr, to_labels,
                          wrap_output)

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


class OnlineEstimatorBase:
    """Common API: ``partial_fit`` row by row, progressive predictions, state save/load.

    Subclasses set ``_config_keys`` and implement ``_init_state``, ``_run_fast`` and
    ``_run_reference``.
    """

    _config_keys = ()

    def __init__(self, num_features, link="logit", hashing=None, batch_size=1, fast=None):
        if isinstance(num_features, bool) or not isinstance(num_features, (int, np.integer)) or num_features < 1:
            raise ValueError(f"num_features: expected a positive integer, got {num_features!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")
        self.num_features = int(num_features)
        self.link = check_choice(link, eq.LINKS, "link")
        self.hashing = _check_hashing(hashing)
        self.batch_size = int(batch_size)
        self.fast = fast
        self.fast_ = resolve_fast(fast)
        self.n_seen_ = 0
        self.cumulative_log_loss_ = 0.0
        self.n_unconverged_ = 0
        self.n_skipped_ = 0
        self._coding = None

    # ----------------------------------------------------------------- input
    def _prepare(self, X, y=None):
        Xc = to_csr(X, self.num_features, self.hashing)
        if y is None:
            return Xc, None
        ypm, coding = to_labels(y, Xc.shape[0])
        if coding is not None:
            if self._coding is not None and coding != self._coding:
                raise ValueError(f"y: labels use the coding {coding!r} but earlier batches used {self._coding!r}")
            self._coding = coding
        return Xc, ypm

    # ----------------------------------------------------------------- fit
    def partial_fit(self, X, y, return_predictions=False, return_log_loss=False):
        """Process the rows of ``X`` one by one: predict ``y_t``, then update on it.

        :param X: ``(n, num_features)`` design, scipy sparse (CSR preferred), NumPy or torch;
            empty rows are allowed (the prediction is the prior's, and nothing is updated).
        :param y: ``(n,)`` labels in ``{0, 1}`` or ``{-1, +1}``.
        :param bool return_predictions: return ``P(y_t = 1 | x_t, past)`` computed *before*
            the update on row ``t`` (progressive validation), shape ``(n,)``.
        :param bool return_log_loss: return the progressive log-loss ``-log p_t(y_t)``, ``(n,)``.
        :returns: ``self``, or the requested arrays (a tuple when both are requested); torch
            tensors on ``X``'s device when ``X`` is a tensor.
        """
        Xc, ypm = self._prepare(X, y)
        n = Xc.shape[0]
        p1 = np.empty(n)
        ll = np.empty(n)
        if n:
            indptr = Xc.indptr.astype(np.int64, copy=False)
            indices = Xc.indices.astype(np.int64, copy=False)
            data = Xc.data
            if self.fast_:
                unconverged, skipped = self._run_fast(indptr, indices, data, ypm, p1, ll)
            else:
                unconverged, skipped = self._run_reference(indptr, indices, data, ypm, p1, ll)
            self.n_seen_ += n
            self.cumulative_log_loss_ += float(ll.sum())
            self.n_unconverged_ += int(unconverged)
            self.n_skipped_ += int(skipped)
            if unconverged:
                warnings.warn(f"{type(self).__name__}: {unconverged} inner Newton solves stopped at "
                              f"maxiter={getattr(self, 'maxiter', '?')} above tol={getattr(self, 'tol', '?')}",
                              ConvergenceWarning, stacklevel=2)
            if skipped:
                warnings.warn(f"{type(self).__name__}: {skipped} mini-batch feature updates were dropped "
                              "because the summed precision was not positive; use a smaller batch_size",
                              ConvergenceWarning, stacklevel=2)
        out = []
        if return_predictions:
            out.append(wrap_output(p1, X))
        if return_log_loss:
            out.append(wrap_output(ll, X))
        if not out:
            return self
        return out[0] if len(out) == 1 else tuple(out)

    def fit(self, X, y):
        """One pass of :meth:`partial_fit` over ``(X, y)`` from the current state; returns ``self``."""
        return self.partial_fit(X, y)

    # ----------------------------------------------------------------- predict
    def _classes(self):
        return (0, 1) if self._coding in (None, "01") else (-1, 1)

    def predict(self, X):
        """Most probable label of each row, in the label coding seen during training."""
        Xc, _ = self._prepare(X)
        neg, pos = self._classes()
        return wrap_output(np.where(self._proba1(Xc) >= 0.5, pos, neg), X)

    def predict_proba(self, X):
        """``(n, 2)`` class probabilities; column 1 is ``P(y = 1 | x)``.

        Example::

            >>> import numpy as np
            >>> from pyro_convexvb.online import OnlineBayesLogistic
            >>> m = OnlineBayesLogistic(2).partial_fit(np.eye(2), [1, 0])
            >>> m.predict_proba(np.eye(2))[:, 1].round(3)
            array([0.586, 0.414])
        """
        Xc, _ = self._prepare(X)
        p = self._proba1(Xc)
        return wrap_output(np.stack([1.0 - p, p], axis=1), X)

    # ----------------------------------------------------------------- state
    def _config(self):
        cfg = {"num_features": self.num_features, "link": self.link, "hashing": self.hashing,
               "batch_size": self.batch_size}
        for key in self._config_keys:
            cfg[key] = getattr(self, key)
        return cfg

    def _state_arrays(self):
        raise NotImplementedError

    def state_dict(self):
        """A picklable snapshot (config, per-feature arrays, counters) to resume a stream.

        Example::

            >>> from pyro_convexvb.online import OnlineBayesLogistic
            >>> m = OnlineBayesLogistic(3)
            >>> m2 = OnlineBayesLogistic.from_state_dict(m.state_dict())
        """
        state = {"class": type(self).__name__, "config": self._config(),
                 "n_seen": self.n_seen_, "cumulative_log_loss": self.cumulative_log_loss_,
                 "n_unconverged": self.n_unconverged_, "n_skipped": self.n_skipped_,
                 "coding": self._coding}
        state.update({k: v.copy() for k, v in self._state_arrays().items()})
        extra = self._extra_state()
        if extra:
            state["extra"] = extra
        return state

    def _extra_state(self):
        return None

    def _load_extra_state(self, extra):
        pass

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output; the configuration must match this estimator's."""
        if state.get("class") != type(self).__name__:
            raise ValueError(f"state: saved from {state.get('class')!r}, cannot load into {type(self).__name__}")
        if state["config"] != self._config():
            raise ValueError(f"state: configuration {state['config']} differs from this estimator's "
                             f"{self._config()}; use {type(self).__name__}.from_state_dict(state)")
        arrays = self._state_arrays()
        for key, arr in arrays.items():
            new = np.asarray(state[key], dtype=np.float64)
            if new.shape != arr.shape or not np.all(np.isfinite(new)):
                raise ValueError(f"state[{key!r}]: expected finite values of shape {arr.shape}")
            arr[...] = new
        self.n_seen_ = int(state["n_seen"])
        self.cumulative_log_loss_ = float(state["cumulative_log_loss"])
        self.n_unconverged_ = int(state["n_unconverged"])
        self.n_skipped_ = int(state["n_skipped"])
        self._coding = state["coding"]
        self._load_extra_state(state.get("extra"))
        return self

    @classmethod
    def from_state_dict(cls, state, fast=None):
        """A new estimator with the saved configuration and state."""
        return cls(**state["config"], fast=fast).load_state_dict(state)


class OnlineDiagonalGaussian(OnlineEstimatorBase):
    """Base of the methods that keep a diagonal Gaussian ``N(mu_i, sigma^2_i)`` per feature.

    Predictions use Eq. (8) (logit) or Eq. (24) (probit) of Shamir & Szpankowski 2021 for every method.
    With ``batch_size > 1`` every row of a mini-batch is predicted and updated from the state at
    the start of the batch, and the per-row updates are summed in natural parameters
    (precision ``1/sigma^2`` and ``mu/sigma^2``), the mini-batch remark of Appendix D.1;
    ``batch_size=1`` is the exact sequential algorithm.  Batches never span two calls.
    """

    _method_code = None

    def __init__(self, num_features, prior_mean=0.0, prior_var=1.0, link="logit", hashing=None,
                 batch_size=1, fast=None):
        super().__init__(num_features, link=link, hashing=hashing, batch_size=batch_size, fast=fast)
        self.prior_mean = prior_mean
        self.prior_var = prior_var
        self._mu = per_feature(prior_mean, self.num_features, "prior_mean")
        self._s2 = per_feature(prior_var, self.num_features, "prior_var", positive=True)

    def _config(self):
        cfg = super()._config()
        cfg["prior_mean"] = self.prior_mean if np.ndim(self.prior_mean) == 0 else np.asarray(self.prior_mean).tolist()
        cfg["prior_var"] = self.prior_var if np.ndim(self.prior_var) == 0 else np.asarray(self.prior_var).tolist()
        return cfg

    def _state_arrays(self):
        return {"mu": self._mu, "s2": self._s2}

    # ------------------------------------------------------------ attributes
    @property
    def coef_(self):
        """``(num_features,)`` posterior means ``mu_i`` (a copy)."""
        return self._mu.copy()

    @property
    def coef_var_(self):
        """``(num_features,)`` posterior variances ``sigma^2_i`` (a copy): per-feature uncertainty."""
        return self._s2.copy()

    # ------------------------------------------------------------ predictions
    def score_moments(self, X):
        """Shamir & Szpankowski 2021, Eq. (6) for every row: mean and variance of the score ``x_t^T w``.

        :param X: ``(n, num_features)``.
        :returns: ``(mu_t, sigma2_t)``, each ``(n,)``: the per-example predictive uncertainty.
        """
        Xc, _ = self._prepare(X)
        mu_t = Xc @ self._mu
        s2_t = Xc.multiply(Xc) @ self._s2
        return wrap_output(np.asarray(mu_t), X), wrap_output(np.asarray(s2_t), X)

    def decision_function(self, X):
        """``(n,)`` score means ``mu_t`` (Eq. (6))."""
        return self.score_moments(X)[0]

    def _proba1(self, Xc):
        """``P(y = 1 | x)`` of Eq. (8) / (24) for a canonical CSR matrix."""
        mu_t = np.asarray(Xc @ self._mu)
        s2_t = np.asarray(Xc.multiply(Xc) @ self._s2)
        return eq.predict_proba(mu_t, s2_t, self.link)

    # ------------------------------------------------------------ streaming
    def _kernel_flags(self):
        """``(mean_newton, var_value, tol, maxiter)`` for the kernel."""
        return False, False, 1e-12, 50

    def _samples(self, n):
        return np.empty((1, 0))

    def _run_fast(self, indptr, indices, data, y, p1, ll):
        k = _kernels()
        mean_newton, var_value, tol, maxiter = self._kernel_flags()
        width = int(np.diff(indptr).max(initial=0))
        if self.batch_size > 1:
            acc_h = np.zeros(self.num_features)
            acc_eta = np.zeros(self.num_features)
        else:
            acc_h = acc_eta = np.empty(0)
        link = k.LOGIT if self.link == "logit" else k.PROBIT
        return k.run_diagonal(self._method_code, link, bool(mean_newton), bool(var_value), float(tol),
                              int(maxiter), self.batch_size, indptr, indices, data, y, self._mu, self._s2,
                              self._samples(len(y)), p1, ll, acc_h, acc_eta, np.empty(width), np.empty(width))

    def _reference_update(self, x, y, mu_i, s2_i, mu_t, s2_t, log_p_t, samples):
        """New ``(mu, s2, n_unconverged)`` for the row's features; implemented per method."""
        raise NotImplementedError

    def _run_reference(self, indptr, indices, data, y, p1, ll):
        n = len(y)
        unconverged = skipped = 0
        samples = self._samples(n)
        mu, s2 = self._mu, self._s2
        batched = self.batch_size > 1
        if batched:
            acc_h = np.zeros(self.num_features)
            acc_eta = np.zeros(self.num_features)
        for b0 in range(0, n, self.batch_size):
            b1 = min(n, b0 + self.batch_size)
            for t in range(b0, b1):
                sl = slice(indptr[t], indptr[t + 1])
                idx, x = indices[sl], data[sl]
                mu_i, s2_i = mu[idx], s2[idx]
                mu_t, s2_t = eq.score_moments(x, mu_i, s2_i)  # Eq. (6)
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
                else:
                    mu[idx], s2[idx] = mu_new, s2_new
            if batched:
                touched = np.unique(indices[indptr[b0]:indptr[b1]])
                touched = touched[(acc_h[touched] != 0) | (acc_eta[touched] != 0)]
                h = 1.0 / s2[touched] + acc_h[touched]
                ok = (h > 0) & np.isfinite(h)
                skipped += int((~ok).sum())
                good = touched[ok]
                eta = mu[good] / s2[good] + acc_eta[good]
                s2[good] = 1.0 / h[ok]
                mu[good] = eta / h[ok]
                acc_h[touched] = 0.0
                acc_eta[touched] = 0.0
        return unconverged, skipped
