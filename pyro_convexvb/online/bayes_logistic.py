"""Algorithm 1 of Shamir & Szpankowski 2021: online sparse Bayesian logistic / probit regression."""
from sklearn.utils._param_validation import StrOptions

from ..estimator_base import POSITIVE, POSITIVE_INT, deprecated_alias
from . import equations as eq
from ._base import OnlineDiagonalGaussian

__all__ = ["OnlineBayesLogistic"]


class OnlineBayesLogistic(OnlineDiagonalGaussian):
    """Marginalised Bayesian Gaussian approximation (Shamir & Szpankowski 2021, Shamir & Szpankowski, Algorithm 1).

    Every feature ``i`` carries a Gaussian ``N(mu_i, sigma^2_i)``, initialised at the prior.
    For each row ``x_t`` (only its ``d_t`` nonzero features are touched, so a step costs
    ``O(d_t)`` whatever ``num_features`` is) the estimator

    1. forms the score moments ``mu_t``, ``sigma^2_t`` (Eq. (6)) and predicts
       ``P(y_t = 1) = Sigma(mu_t / sqrt(1 + pi sigma^2_t / 8))`` (Eq. (8); probit: Eq. (24));
    2. for every nonzero feature marginalises all the others (Eqs. (7), (10)-(12)) and moves
       ``mu_i`` to the peak of the 1-D posterior: closed form Eq. (17) (``mean_update="taylor"``)
       or Newton on Eq. (15) (``"newton"``, Appendix C); probit: Eqs. (30) / (28);
    3. sets ``sigma^2_i`` by the curvature at the peak, Eq. (19) (``variance_update="laplace"``;
       probit Eq. (31)) or by matching the peak height, Eq. (18) (``"value"``).

    All features of a row are updated from the state *before* the row (step 9 of Algorithm 1).

    A scikit-learn classifier (:class:`~sklearn.base.ClassifierMixin`): binary labels of any two
    values (``classes_``), ``fit`` (one pass from the prior), ``partial_fit`` (continue the stream,
    ``classes=`` as in :class:`~sklearn.linear_model.SGDClassifier`), NumPy outputs.  SciPy sparse
    input stays sparse.

    :param int num_features: ``d``, the number of features (hash buckets when hashing); ``None``
        takes the number of columns of the first batch.
    :param prior_mean: ``mu_0``, scalar or ``(d,)``.
    :param prior_var: ``"auto"`` (default), or ``sigma^2_0 > 0``, scalar or ``(d,)``.  ``"auto"`` learns one
        model per prior variance of :data:`~pyro_convexvb.online._base.AUTO_PRIOR_VARS` (0.01, 0.1, 1) side by
        side on the same rows and predicts with their Bayesian model average (Hoeting, Madigan, Raftery &
        Volinsky 1999, Eq. (1)): the weight of prior ``k`` before row ``t`` is its posterior probability
        ``w_k ∝ prod_{tau < t} p_k(y_tau | x_tau, past)`` under a uniform prior over the grid -- the marginal
        likelihood written as the product of one-step predictive probabilities (Dawid 1984, §5, prequential
        analysis), each ``p_k`` Algorithm 1's own prediction (8).  The progressive log-loss of the average is
        at most the best member's plus ``log K`` (``K = 3``).  The members run in one compiled kernel that
        reads each row once for all of them and mixes the average as it goes; a member whose posterior odds
        against the best fall below 1e-9 leaves the average for good and is no longer updated (Occam's window,
        Madigan & Raftery 1994, §2): at every later row the prediction then differs from the full average by at
        most the full average's weight on the members that left (below ``2e-9`` when they leave).  Once one
        prior dominates the cost is one learner's; the state is ``K`` times larger.  Useful because hashed
        sparse rows with tens of active features need a far smaller prior variance than 1, which a fixed
        default cannot know.
    :param str link: ``"logit"`` or ``"probit"`` (Appendix B).
    :param str mean_update: ``"taylor"`` (Eq. (17)/(30)) or ``"newton"`` (Eq. (15)/(28)).
    :param str variance_update: ``"laplace"`` (Eq. (19)/(31)) or ``"value"`` (Eq. (18)).
    :param hashing: ``None`` (column indices must be ``< num_features``), or ``True`` / an
        integer seed: column ``j`` of any input is hashed to one of ``num_features`` buckets.
    :param int batch_size: 1 for the exact sequential algorithm; larger values predict and
        update a whole mini-batch from the same state and sum the updates in natural
        parameters (Appendix D.1, remark).
    :param float tol: relative step tolerance of the Newton iteration.
    :param int max_iter: iteration cap of the Newton iteration (a :class:`ConvergenceWarning`
        reports solves that hit it).  ``tol`` and ``max_iter`` apply to ``mean_update="newton"`` only: with
        ``"taylor"`` a value other than the default is unused and named in a ``UserWarning``.
    :param int maxiter: deprecated name of ``max_iter`` (``FutureWarning``).
    :param fast: ``None`` uses the numba kernel when numba is installed, ``True`` requires it
        (``ImportError`` otherwise), ``False`` uses the NumPy reference path.

    Attributes: ``coef_`` / ``coef_var_`` (``(d,)`` means and variances; of the model average with
    ``prior_var="auto"``), ``prior_var_weights_`` (``(K,)`` with ``"auto"``), ``classes_``,
    ``n_features_in_`` (without hashing), ``n_seen_``, ``n_iter_`` (1: one pass over the rows of each call, as
    :class:`~sklearn.linear_model.SGDClassifier`), ``cumulative_log_loss_`` (progressive log-loss so far),
    ``fast_`` (path in use).

    Example::

        >>> import numpy as np, scipy.sparse as sp
        >>> rng = np.random.default_rng(0)
        >>> X = sp.random(1000, 50, density=0.1, format="csr", random_state=0)
        >>> X.data[:] = 1.0
        >>> y = rng.random(1000) < 1 / (1 + np.exp(-X @ rng.normal(size=50)))
        >>> model = OnlineBayesLogistic()
        >>> p = model.partial_fit(X, y, return_predictions=True)  # P(y_t = 1) before each update
        >>> model.coef_.shape, model.predict_proba(X[:3]).shape, model.classes_
        ((50,), (3, 2), array([False,  True]))
    """

    _method_code = 0
    _update_name = ("the update of this feature (Shamir & Szpankowski 2021, Algorithm 1: Eqs. (15)-(19); probit "
                    "(28)-(31))")
    _config_keys = ("mean_update", "variance_update", "tol", "max_iter")
    _supports_auto = True
    _renamed = {"max_iter": "maxiter"}
    _parameter_constraints = {**OnlineDiagonalGaussian._parameter_constraints,
                              "mean_update": [StrOptions({"taylor", "newton"})],
                              "variance_update": [StrOptions({"laplace", "value"})], "tol": POSITIVE,
                              "max_iter": POSITIVE_INT, "maxiter": deprecated_alias(POSITIVE_INT)}

    def __init__(self, num_features=None, prior_mean=0.0, prior_var="auto", link="logit", mean_update="taylor",
                 variance_update="laplace", hashing=None, batch_size=1, tol=1e-9, max_iter=50, fast=None,
                 maxiter="deprecated"):
        self.num_features = num_features
        self.prior_mean = prior_mean
        self.prior_var = prior_var
        self.link = link
        self.mean_update = mean_update
        self.variance_update = variance_update
        self.hashing = hashing
        self.batch_size = batch_size
        self.tol = tol
        self.max_iter = max_iter
        self.fast = fast
        self.maxiter = maxiter

    def _kernel_flags(self):
        return (self.mean_update == "newton", self.variance_update == "value", float(self.tol),
                int(self._param("max_iter")))

    def _overflow_hint(self):
        hint = super()._overflow_hint()
        if self.variance_update == "value":  # Eq. (18) can grow a variance by exp(...) in one row
            hint += ", or use variance_update='laplace' (Eq. (19)), under which a variance can only shrink"
        return hint

    def _reference_update(self, x, y, mu_i, s2_i, mu_t, s2_t, log_p_t, samples):
        link = self.link
        mu_minus, s2_minus = eq.self_excluding_moments(x, mu_i, s2_i, mu_t, s2_t)  # Eq. (7)
        unconverged = 0
        if self.mean_update == "newton":
            mu_new, ok = eq.newton_mean(y, x, mu_i, s2_i, mu_minus, s2_minus, link, float(self.tol),
                                        int(self._param("max_iter")))
            unconverged = int((~ok).sum())
        else:
            mu_new = eq.taylor_mean(y, x, mu_i, s2_i, mu_t, s2_minus, link)
        if self.variance_update == "value":
            s2_new = eq.value_variance(log_p_t, y, x, mu_i, s2_i, mu_new, mu_minus, s2_minus, link)
        else:
            s2_new = eq.laplace_variance(y, x, s2_i, mu_new, mu_minus, s2_minus, link)
        return mu_new, s2_new, unconverged
