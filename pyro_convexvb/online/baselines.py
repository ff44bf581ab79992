"""Baselines of Shamir & Szpankowski 2021 (Appendix D and §4) in the API of :class:`OnlineBayesLogistic`.

* :class:`OnlineADF` -- assumed density filtering / one-pass EP (Appendix D.2);
* :class:`OnlineDimGauss` -- the multi-dimensional Laplace update over the row's features,
  diagonal kept, by Sherman-Morrison (Appendix D.1, Eqs. (35)-(48));
* :class:`OnlineMarginalVB` -- marginalised variational Bayes with ``N`` Monte Carlo samples
  and a joint Newton iteration on ``(mu', sigma')`` (Appendix D.3, Eqs. (49)-(54));
* :class:`OnlineAdaGradLogistic` -- SGD with AdaGrad step sizes (§4).

The diagonal methods share the mini-batch mode of :class:`OnlineDiagonalGaussian`.
"""
import math

import numpy as np
from sklearn.utils._param_validation import StrOptions
from sklearn.utils.validation import check_is_fitted

from ..estimator_base import POSITIVE, POSITIVE_INT, deprecated_alias, seed_from
from . import equations as eq
from ._base import OnlineDiagonalGaussian, OnlineEstimatorBase, _kernels

__all__ = [
    "OnlineADF",
    "OnlineDimGauss",
    "OnlineMarginalVB",
    "OnlineAdaGradLogistic",
    "adf_update",
    "dimgauss_update",
    "marginal_vb_update",
]


def adf_update(y, x, mu_i, s2_i, mu_t, s2_t, link):
    """Shamir & Szpankowski 2021, Appendix D.2: assumed density filtering (Minka, 2001) for one row.

    The score ``s = x^T w`` is ``N(mu_t, sigma^2_t)`` under the diagonal prior; its
    likelihood normaliser is ``Z = F(y mu_t / c(sigma^2_t))`` (Eq. (8), exact for probit by
    Eq. (24)).  Moment matching gives, with ``z = y mu_t / c``,
    ``mu_i += sigma^2_i x_i y psi1(z) / c`` and ``sigma^2_i -= sigma^4_i x_i^2 psi2(z) / c^2``:
    the mean and the diagonal of the exactly moment-matched joint Gaussian.

    :returns: ``(mu_new, s2_new)``, each ``(d_t,)``.
    """
    c = float(eq.shrinkage(s2_t, link))
    z = y * mu_t / c
    p1, p2 = eq.psi1(z, link), eq.psi2(z, link)
    return mu_i + s2_i * x * y * p1 / c, s2_i - s2_i * s2_i * x * x * p2 / (c * c)


def dimgauss_update(y, x, mu_i, s2_i, link, mean_update="taylor", tol=1e-9, maxiter=50):
    """Shamir & Szpankowski 2021, Appendix D.1: multi-dimensional Laplace update of the row's features.

    Taylor form: Eqs. (42)-(46) -- ``v_t = Sigma_t x_t`` (43), the temporary covariance
    ``Sigma~_{t+1}`` by Sherman-Morrison (44), the mean (45) and ``Sigma_{t+1}`` (46), of which
    the diagonal is kept.  Newton form: Eqs. (37)-(40) with ``H^{-1}`` applied by
    Sherman-Morrison (41); a step whose score ``y x^T u`` leaves the bracket that contains the
    root, or moves it by more than half the previous step, is replaced by bisection.

    :returns: ``(mu_new, s2_new, converged)``.
    """
    v = s2_i * x  # Eq. (43)
    q = float(np.dot(x, v))  # x^T Sigma_t x
    z0 = y * float(np.dot(x, mu_i))  # y x^T u_t, the unshrunk score of Eq. (42)
    converged = True
    if mean_update == "taylor":
        a = float(eq.psi2(z0, link))  # p~(1 - p~) for logit
        sigma_tilde_x = v / (1.0 + a * q)  # Sigma~_{t+1} x_t from Eq. (44)
        u = mu_i + y * float(eq.psi1(z0, link)) * sigma_tilde_x  # Eq. (45)
    else:
        lo, hi = z0, z0 + q * float(eq.psi1(z0, link))
        u = mu_i.copy()
        converged = False
        dz_old = np.inf
        for _ in range(maxiter):
            z = y * float(np.dot(x, u))
            p1, b = float(eq.psi1(z, link)), float(eq.psi2(z, link))
            g = (u - mu_i) / s2_i - y * x * p1  # Eq. (38)
            # H^{-1} g with H = Sigma^{-1} + b x x^T (Eq. (39)) by Sherman-Morrison, Eq. (41)
            step = s2_i * g - b * v * float(np.dot(v, g)) / (1.0 + b * q)
            u_new = u - step  # Eq. (40)
            if z - z0 - q * p1 > 0:
                hi = z
            else:
                lo = z
            z_new = y * float(np.dot(x, u_new))
            dz = z_new - z
            if abs(dz) <= tol * (1.0 + abs(z)):
                u = u_new
                converged = True
                break
            if z_new < lo or z_new > hi or abs(dz) > 0.5 * abs(dz_old):  # safeguard: bisect along v_t
                z_mid = 0.5 * (lo + hi)
                u_new = mu_i + y * v * (z_mid - z0) / q
                dz = z_mid - z
            dz_old = dz
            u = u_new
    z_plus = y * float(np.dot(x, u))  # y x^T u_{t+1}, Eq. (36)
    b = float(eq.psi2(z_plus, link))
    s2_new = s2_i - b * v * v / (1.0 + b * q)  # diagonal of Eq. (46)
    return u, s2_new, converged


def marginal_vb_update(y, x, mu_i, s2_i, mu_t, s2_t, samples, link, tol=1e-10, maxiter=20):
    """Shamir & Szpankowski 2021, Appendix D.3: marginalised VB with ``N`` samples ``s_j`` for each feature.

    Minimises the KL divergence (49) between ``Q_i = N(mu', sigma'^2)`` and the marginalised
    posterior (12), the expectation estimated with ``W_j = mu' + s_j sigma'``, by a joint
    Newton iteration with the gradient (52), the Hessian (53) and the step (54), started at
    ``(mu_i, sigma_i)``; a step that would make ``sigma'`` non-positive is halved.

    :param samples: ``(N,)`` standard normal draws shared by the row's features.
    :returns: ``(mu_new, s2_new, n_unconverged)``.
    """
    mu_minus, s2_minus = eq.self_excluding_moments(x, mu_i, s2_i, mu_t, s2_t)
    c = eq.shrinkage(s2_minus, link)[:, None]
    al = (y * x)[:, None] / c  # alpha_t
    s = np.asarray(samples, dtype=np.float64)[None, :]
    m = mu_i.copy()
    sd = np.sqrt(s2_i)
    done = np.zeros(len(x), dtype=bool)
    v_i = s2_i
    for _ in range(maxiter):
        z = y * (mu_minus[:, None] + x[:, None] * (m[:, None] + s * sd[:, None])) / c
        q1, q2 = eq.psi1(z, link), eq.psi2(z, link)  # 1 - p_{i,j,t+} and p(1 - p), Eq. (50)
        a = al[:, 0]
        g1 = (m - mu_i) / v_i - a * q1.mean(1)  # Eq. (52)
        g2 = -1.0 / sd + sd / v_i - a * (s * q1).mean(1)
        h11 = 1.0 / v_i + a * a * q2.mean(1)  # Eq. (53)
        h12 = a * a * (s * q2).mean(1)
        h22 = 1.0 / (sd * sd) + 1.0 / v_i + a * a * (s * s * q2).mean(1)
        det = h11 * h22 - h12 * h12
        d1 = (h22 * g1 - h12 * g2) / det
        d2 = (h11 * g2 - h12 * g1) / det
        lam = np.ones_like(sd)
        while np.any(sd - lam * d2 <= 0):
            lam = np.where(sd - lam * d2 <= 0, 0.5 * lam, lam)
        lam = np.where(done, 0.0, lam)
        m = m - lam * d1  # Eq. (54)
        sd = sd - lam * d2
        done |= (np.abs(lam * d1) <= tol * (1.0 + np.abs(m))) & (np.abs(lam * d2) <= tol * (1.0 + sd))
        if done.all():
            break
    return m, sd * sd, int((~done).sum())


class OnlineADF(OnlineDiagonalGaussian):
    """Assumed density filtering / one-pass EP (Shamir & Szpankowski 2021, Appendix D.2), see :func:`adf_update`.

    Same constructor, attributes and methods as :class:`OnlineBayesLogistic` (minus the
    mean/variance options).

    Example::

        >>> import numpy as np
        >>> OnlineADF(2, prior_var=2.0).partial_fit(np.eye(2), [1, -1]).coef_.round(3)
        array([ 0.748, -0.748])
    """

    _method_code = 1
    _update_name = "the moment-matching update of this feature (Shamir & Szpankowski 2021, Appendix D.2)"

    def _reference_update(self, x, y, mu_i, s2_i, mu_t, s2_t, log_p_t, samples):
        mu_new, s2_new = adf_update(y, x, mu_i, s2_i, mu_t, s2_t, self.link)
        return mu_new, s2_new, 0


class OnlineDimGauss(OnlineDiagonalGaussian):
    """Multi-dimensional Gaussian (Laplace) update, diagonal kept (Shamir & Szpankowski 2021, Appendix D.1).

    Each row updates the joint Gaussian of its ``d_t`` features with the rank-one precision
    term of Eq. (48) through Sherman-Morrison (``O(d_t)``, never a ``d_t x d_t`` matrix) and
    keeps the diagonal.  ``mean_update="newton"`` (default) iterates Eqs. (37)-(40) to the mode;
    ``"taylor"`` is the one-step form Eqs. (42)-(46), which overshoots when
    ``x^T Sigma_t x`` is large (wide priors, many active features) and a row is predicted
    confidently wrong.  See :func:`dimgauss_update`.  ``tol`` and ``max_iter`` bound the Newton iteration: with
    ``"taylor"`` a value other than the default is unused and named in a ``UserWarning``.

    Example::

        >>> import numpy as np
        >>> m = OnlineDimGauss(3).partial_fit(np.array([[1.0, 1.0, 0.0]]), [1])
        >>> m.coef_var_.round(3)
        array([0.846, 0.846, 1.   ])
    """

    _method_code = 2
    _update_name = ("the Sherman-Morrison update of this feature (Shamir & Szpankowski 2021, Appendix D.1, "
                    "Eqs. (37)-(46))")
    _config_keys = ("mean_update", "tol", "max_iter")
    _renamed = {"max_iter": "maxiter"}
    _parameter_constraints = {**OnlineDiagonalGaussian._parameter_constraints,
                              "mean_update": [StrOptions({"taylor", "newton"})], "tol": POSITIVE,
                              "max_iter": POSITIVE_INT, "maxiter": deprecated_alias(POSITIVE_INT)}

    def __init__(self, num_features=None, prior_mean=0.0, prior_var=1.0, link="logit", mean_update="newton",
                 hashing=None, batch_size=1, tol=1e-9, max_iter=50, fast=None, maxiter="deprecated"):
        self.num_features = num_features
        self.prior_mean = prior_mean
        self.prior_var = prior_var
        self.link = link
        self.mean_update = mean_update
        self.hashing = hashing
        self.batch_size = batch_size
        self.tol = tol
        self.max_iter = max_iter
        self.fast = fast
        self.maxiter = maxiter

    def _kernel_flags(self):
        return self.mean_update == "newton", False, float(self.tol), int(self._param("max_iter"))

    def _reference_update(self, x, y, mu_i, s2_i, mu_t, s2_t, log_p_t, samples):
        mu_new, s2_new, ok = dimgauss_update(y, x, mu_i, s2_i, self.link, self.mean_update, float(self.tol),
                                             int(self._param("max_iter")))
        return mu_new, s2_new, int(not ok)


class OnlineMarginalVB(OnlineDiagonalGaussian):
    """Marginalised variational Bayes with ``num_samples`` Monte Carlo draws (Shamir & Szpankowski 2021, App. D.3).

    ``O(d_t N J)`` per row (``J`` Newton iterations); the draws come from a seeded generator
    whose state is part of :meth:`state_dict`, so a stream is reproducible.  See
    :func:`marginal_vb_update`.

    :param int num_samples: ``N``.
    :param float tol: relative step tolerance of the Newton iteration.
    :param int max_iter: iteration cap of the Newton iteration.
    :param random_state: seed of the sample generator: an int (default 0), a :class:`numpy.random.RandomState`
        (a seed is drawn from it) or ``None`` (fresh entropy; the stream is then not reproducible).
    :param maxiter: deprecated name of ``max_iter``; ``seed``: deprecated name of ``random_state``
        (``FutureWarning``).

    Example::

        >>> import numpy as np
        >>> m = OnlineMarginalVB(2, num_samples=200, random_state=0).partial_fit(np.eye(2), [1, 0])
        >>> bool(m.coef_[0] > 0 > m.coef_[1])
        True
    """

    _method_code = 3
    _update_name = "the variational update of this feature (Shamir & Szpankowski 2021, Appendix D.3, Eqs. (49)-(54))"
    _config_keys = ("num_samples", "tol", "max_iter")
    _renamed = {"max_iter": "maxiter", "random_state": "seed"}
    _parameter_constraints = {**OnlineDiagonalGaussian._parameter_constraints, "num_samples": POSITIVE_INT,
                              "tol": POSITIVE, "max_iter": POSITIVE_INT, "random_state": ["random_state"],
                              "maxiter": deprecated_alias(POSITIVE_INT), "seed": deprecated_alias(["random_state"])}

    def __init__(self, num_features=None, prior_mean=0.0, prior_var=1.0, link="logit", num_samples=100,
                 hashing=None, batch_size=1, tol=1e-10, max_iter=20, random_state=0, fast=None, maxiter="deprecated",
                 seed="deprecated"):
        self.num_features = num_features
        self.prior_mean = prior_mean
        self.prior_var = prior_var
        self.link = link
        self.num_samples = num_samples
        self.hashing = hashing
        self.batch_size = batch_size
        self.tol = tol
        self.max_iter = max_iter
        self.random_state = random_state
        self.fast = fast
        self.maxiter = maxiter
        self.seed = seed

    def _new_state(self, num_features):
        super()._new_state(num_features)
        random_state = self._param("random_state")
        self._rng = np.random.default_rng(None if random_state is None else seed_from(random_state))

    def _kernel_flags(self):
        return False, False, float(self.tol), int(self._param("max_iter"))

    def _samples(self, n):
        return self._rng.standard_normal((n, int(self.num_samples)))

    def _extra_state(self):
        return {"rng": self._rng.bit_generator.state}

    def _load_extra_state(self, extra):
        if extra and "rng" in extra:
            self._rng.bit_generator.state = extra["rng"]

    def _reference_update(self, x, y, mu_i, s2_i, mu_t, s2_t, log_p_t, samples):
        return marginal_vb_update(y, x, mu_i, s2_i, mu_t, s2_t, samples, self.link, float(self.tol),
                                  int(self._param("max_iter")))


class OnlineAdaGradLogistic(OnlineEstimatorBase):
    """SGD with AdaGrad step sizes on the log-loss (the gradient baseline of Shamir & Szpankowski 2021, §4).

    ``w_i <- w_i - eta g_i / sqrt(delta + sum_tau g_{i,tau}^2)`` with
    ``g = -y_t x_t psi1(y_t x_t^T w)`` (``psi1 = 1 - Sigma`` for logit); predictions
    ``F(x_t^T w)`` are made before each update.  No uncertainty is kept.

    :param float learning_rate: ``eta`` (tune it; §4 grid-searches it).
    :param float delta: ``delta > 0`` in the AdaGrad denominator.

    Example::

        >>> import numpy as np
        >>> OnlineAdaGradLogistic(2, learning_rate=0.5).partial_fit(np.eye(2), [1, 0]).coef_.round(3)
        array([ 0.5, -0.5])
    """

    _config_keys = ("learning_rate", "delta")
    _has_batch_size = False
    _array_constraints = {"G": "nonnegative"}
    _score_overflow = "the score x_t^T w = sum_i x_i w_i overflows float64"
    _update_name = "the AdaGrad step of this feature (Shamir & Szpankowski 2021, §4)"
    _state_names = {"w": "w_i", "G": "G_i (its sum of squared gradients)"}
    _parameter_constraints = {**OnlineEstimatorBase._parameter_constraints, "learning_rate": POSITIVE,
                              "delta": POSITIVE}

    def __init__(self, num_features=None, learning_rate=0.1, delta=1e-8, link="logit", hashing=None, fast=None):
        self.num_features = num_features
        self.learning_rate = learning_rate
        self.delta = delta
        self.link = link
        self.hashing = hashing
        self.fast = fast

    def _new_state(self, num_features):
        self._w = np.zeros(num_features)
        self._G = np.zeros(num_features)

    def _state_arrays(self):
        return {"w": self._w, "G": self._G}

    @property
    def coef_(self):
        """``(num_features,)`` weights."""
        check_is_fitted(self, "n_seen_")
        return self._w.copy()

    def _score(self, Xc):
        """The scores ``x^T w`` (``F^{-1}`` of the predicted probability).

        :raises FloatingPointError: naming the first row whose score overflows float64."""
        with np.errstate(over="ignore", invalid="ignore"):
            s = np.asarray(Xc @ self._w)
        self._check_scores(Xc, s)
        return s

    def _run_fast(self, indptr, indices, data, y, p1, ll):
        k = _kernels()
        link = k.LOGIT if self.link == "logit" else k.PROBIT
        k.run_adagrad(link, float(self.learning_rate), float(self.delta), indptr, indices, data, y, self._w, self._G,
                      p1, ll)
        return 0, 0

    def _run_reference(self, indptr, indices, data, y, p1, ll):
        w, G = self._w, self._G
        for t in range(len(y)):
            sl = slice(indptr[t], indptr[t + 1])
            idx, x = indices[sl], data[sl]
            m = float(np.dot(x, w[idx]))
            if not math.isfinite(m):  # the score overflowed: partial_fit names the row and undoes the chunk
                p1[t], ll[t] = 0.5, math.nan
                return 0, 0
            p1[t] = eq.link_cdf(m, self.link)
            ll[t] = -eq.log_link_cdf(y[t] * m, self.link)
            g = -y[t] * float(eq.psi1(y[t] * m, self.link)) * x
            G[idx] += g * g
            w[idx] -= float(self.learning_rate) * g / np.sqrt(G[idx] + float(self.delta))
        return 0, 0
