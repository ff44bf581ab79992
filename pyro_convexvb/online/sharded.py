r"""Sharded online learning: each rank runs Algorithm 1 on its own rows, the ranks merge periodically.

**This is an approximation of the sequential Algorithm 1** of Shamir & Szpankowski 2021, not an
equal answer. The sequential algorithm updates every feature from the state after *all* earlier
rows; with ``P`` ranks each rank sees only its own rows between two merges, so a row is predicted
and learned from a state that misses up to ``(P - 1) merge_every`` rows of the other ranks.

Between merges every rank starts from the same shared Gaussian ``N(mu_i, sigma^2_i)`` per feature,
runs :class:`~pyro_convexvb.online.OnlineBayesLogistic` (or any diagonal-Gaussian estimator of this
package) on its next ``merge_every`` rows, and the ranks then combine their posteriors in natural
parameters (precision ``lambda_i = 1 / sigma^2_i`` and ``eta_i = mu_i / sigma^2_i``): the shared
state becomes the old one plus the sum of every rank's change since the last merge,

.. math::

    \lambda_i \leftarrow \lambda_i + \sum_r (\lambda_{i,r} - \lambda_i), \qquad
    \eta_i \leftarrow \eta_i + \sum_r (\eta_{i,r} - \eta_i),

the precision-weighted combination of independent Gaussian updates (each rank's change is the
message of its rows; the same rule as the mini-batch remark of Shamir & Szpankowski 2021,
Appendix D.1, and the parallel training of adPredictor, Graepel et al. 2010). A feature that only
one rank touched gets exactly that rank's update. Should the summed precision of a feature not be
positive and finite (it cannot for the Laplace variance update, whose precision only grows), that
feature keeps its pre-merge state, with a ``RuntimeWarning`` naming the features.

The cost of the approximation is measured as the extra progressive log-loss (regret) against the
sequential algorithm on the same rows (``tests/test_online_distributed.py``; ``docs/online.md``).

One merge all-reduces ``2 d`` float64 numbers (``d`` features). Without an active process group
(or with one rank) :class:`ShardedOnline` is exactly the sequential algorithm on the local rows.
"""
import math
import warnings

import numpy as np

__all__ = ["ShardedOnline", "simulate_sharded"]


def _snapshot(est):
    return est._mu.copy(), est._s2.copy()


MERGES = ("natural", "average")


def _delta(est, snap, merge="natural"):
    """This rank's contribution to the all-reduce: ``[lambda_r - lambda, eta_r - eta]`` (``"natural"``) or
    ``[lambda_r - lambda, eta_r]`` (``"average"``)."""
    mu0, s2_0 = snap
    eta_r = est._mu / est._s2
    return np.concatenate([1.0 / est._s2 - 1.0 / s2_0, eta_r - mu0 / s2_0 if merge == "natural" else eta_r])


def _apply(est, snap, total, merge="natural", ranks=1):
    mu0, s2_0 = snap
    d = mu0.shape[0]
    lam0, eta0 = 1.0 / s2_0, mu0 / s2_0
    lam = lam0 + total[:d]
    if merge == "natural":
        eta = eta0 + total[d:]
    else:  # precision-weighted average of the ranks' means: sum_r eta_r / sum_r lambda_r, times the new precision
        eta = total[d:] / (ranks * lam0 + total[:d]) * lam
    bad = ~(lam > 0) | ~np.isfinite(lam) | ~np.isfinite(eta)
    if bad.any():
        lam[bad], eta[bad] = lam0[bad], eta0[bad]
        idx = np.flatnonzero(bad)
        warnings.warn(f"merge: the merged precision of {idx.size} of {d} features is not positive and finite (or "
                      f"their mean is not finite), so they keep their state from before this merge and the rows "
                      f"since the last merge are lost for them: features {idx[:10].tolist()}"
                      f"{' ...' if idx.size > 10 else ''}; merge='average' or a smaller merge_every keeps each "
                      "rank's change smaller", RuntimeWarning, stacklevel=3)
    est._mu[...] = eta / lam
    est._s2[...] = 1.0 / lam


def _start(est, classes):
    if est._initialised():
        return
    if est.num_features is None:
        raise ValueError("num_features: a sharded online learner needs it set (every rank must hold the same "
                         "features from the first merge on)")
    est._check_options()
    est._reset(est.num_features)
    if classes is not None:
        classes = np.unique(np.asarray(classes))
        if classes.shape[0] != 2:
            raise ValueError(f"classes: expected two labels, got {classes.tolist()}")
        est.classes_ = classes
        est._negative_known = True


def _check_estimator(est):
    from ._base import OnlineDiagonalGaussian

    if not isinstance(est, OnlineDiagonalGaussian):
        raise TypeError(f"estimator: expected a diagonal-Gaussian online estimator (OnlineBayesLogistic, OnlineADF, "
                        f"OnlineMarginalVB), got {type(est).__name__}")
    if isinstance(getattr(est, "prior_var", None), str):
        raise ValueError("estimator: prior_var='auto' (the model average over prior variances) cannot be sharded: "
                         "each rank would weigh the members by the predictive likelihood of its own rows, so the "
                         "ranks' predictions would drift apart; give the estimator a fixed prior_var (e.g. 0.01)")


class ShardedOnline:
    """Algorithm 1 on row-sharded streams with periodic merging in natural parameters (an approximation).

    See the module docstring: every ``merge_every`` local rows the ranks sum their natural-parameter
    changes (``torch.distributed`` all-reduce, :mod:`pyro_convexvb.distributed`); all ranks then hold
    the same per-feature posterior. Not equal to the sequential algorithm: it is its parallel
    approximation, whose regret cost is measured in ``docs/online.md``.

    **Rounds span calls.** A rank's rows are cut into rounds of ``merge_every`` rows counted over all
    its :meth:`partial_fit` calls, not per call: a round left open at the end of a call is continued by
    the next call. When every rank is fed the same number of rows in each call (the usual sharded
    stream), the merges fall every ``merge_every`` local rows wherever the calls cut the stream, and
    the posterior and progressive losses do not depend on the call sizes (bit for bit; except that an
    estimator with ``batch_size > 1`` restarts its mini-batches at every call and every round). A merge
    is due when the rank with the most rows of its open round reaches ``merge_every``; a rank fed
    fewer rows (or none) in that call closes its round short, with what it has learned, and its next
    rows start the next round.

    **The state after a call.** At the end of a call every rank's open round is combined with the same
    rule into the estimator's state, so that ``coef_``, ``coef_var_`` and predictions after a call hold
    every rank's rows -- but this combination does not close the round: each rank keeps its own round
    state (restored into the estimator at the next call) and goes on learning from the shared state of
    the round's start plus its own rows, and the round is merged once it has ``merge_every`` rows. (The
    merged posterior is a function of where the rounds end; had every call closed its round, as
    earlier versions did, it would depend on how a reader happened to cut the stream into chunks.) The
    combination costs one more all-reduce of ``2 d`` numbers per call that ends inside a round, and
    keeps two more copies of the ``d`` means and variances between such calls. Learn only through this
    object: a state changed by a direct call of ``estimator.partial_fit`` is replaced by the rank's own
    round state at the next call.

    :param estimator: an unfitted (or previously merged) diagonal-Gaussian online estimator with
        ``num_features`` set, e.g. ``OnlineBayesLogistic(d, prior_var=1.0)``; it holds the state.
    :param int merge_every: local rows between merges.
    :param str merge: ``"natural"`` (default): the shared state plus the sum of the ranks' changes in
        natural parameters (the rule above; close to the sequential algorithm when few rows pass between
        merges, unstable when ``P * merge_every`` is large, see ``docs/online.md``); ``"average"``: the
        precisions are combined the same way but the new mean is the precision-weighted average of the
        ranks' means (a convex combination: never overshoots, slower to learn when merges are frequent).
    :param classes: the two labels, needed when a rank's first rows may show one class only
        (``{0, 1}`` and ``{-1, +1}`` codings are recognised without it).

    Attributes: ``estimator`` (``coef_``, ``coef_var_``, predictions: the shared state after the last
    call, every rank's rows combined), ``n_merges_`` (rounds merged; the end-of-call combination of the
    open rounds is not counted), ``local_log_loss_`` (this rank's progressive log-loss).

    Example (one process: the sequential algorithm)::

        >>> from pyro_convexvb.online import OnlineBayesLogistic, make_online_stream
        >>> X, y = make_online_stream(d=50, d_t=5, seed=0).take(1000)
        >>> sh = ShardedOnline(OnlineBayesLogistic(50, prior_var=1.0), merge_every=200)
        >>> ll = sh.partial_fit(X, y)
        >>> ll.shape, sh.estimator.coef_.shape
        ((1000,), (50,))
    """

    def __init__(self, estimator, merge_every=1000, merge="natural", classes=None):
        _check_estimator(estimator)
        if merge not in MERGES:
            raise ValueError(f"merge: expected one of {MERGES}, got {merge!r}")
        self.merge = merge
        if isinstance(merge_every, bool) or not isinstance(merge_every, (int, np.integer)) or merge_every < 1:
            raise ValueError(f"merge_every: expected a positive integer, got {merge_every!r}")
        self.estimator = estimator
        self.merge_every = int(merge_every)
        self.classes = classes
        self.n_merges_ = 0
        self.local_log_loss_ = 0.0
        self._pending = 0  # this rank's rows in the open round
        self._snap = None  # the shared state at the open round's start (with a process group)
        self._own = None  # this rank's state in the open round while the estimator shows the combined one

    def _check_features(self):
        """Once: every rank's learner has the same number of features (the merges add states of one size)."""
        import torch

        from .. import distributed

        d = float(self.estimator.num_features)
        total = distributed.all_reduce_sum(torch.tensor([d, d * d], dtype=torch.float64)) / distributed.world_size()
        if float(total[1]) != float(total[0]) ** 2:
            raise ValueError(f"num_features: {self.estimator.num_features} on rank {distributed.rank()}, but the "
                             "ranks' learners differ; give every rank's learner the same num_features")
        self._features_checked = True

    def _combine(self):
        """All-reduce every rank's change since the open round's start and apply it to the estimator."""
        import torch

        from .. import distributed

        est, snap = self.estimator, self._snap
        total = distributed.all_reduce_sum(torch.from_numpy(_delta(est, snap, self.merge))).numpy()
        _apply(est, snap, total, self.merge, distributed.world_size())

    def partial_fit(self, X, y):
        """Learn this rank's rows ``X`` (``(m, d)`` CSR or array), ``y`` (``(m,)``), merging every ``merge_every``.

        Collective: every rank must call it (with any number of rows, zero included). The merges of a
        call close the rounds that the rank with the most rows of its open round completes (rounds span
        calls: see the class docstring); at the end of the call the open rounds are combined into the
        estimator's state without closing them.

        :returns: ``(m,)`` progressive log-losses of the local rows (each predicted before it is learned).
        """
        from .. import distributed

        est = self.estimator
        _start(est, self.classes)
        n = X.shape[0]
        if y.shape[0] != n:
            raise ValueError(f"y: expected {n} labels (one per row of X), got {y.shape[0]}")
        active = distributed.is_active()
        if active and not self.__dict__.get("_features_checked"):
            self._check_features()
        if self._own is not None:  # the estimator shows the combined open rounds: learn on from this rank's own
            est._mu[...], est._s2[...] = self._own
            self._own = None
        if active and self._snap is None:
            self._snap = _snapshot(est)
        m = self.merge_every
        most = self._pending + n  # the most rows of an open round over the ranks, this call's rows included
        if active:
            import torch

            most = int(distributed.all_reduce_max(torch.tensor(float(most), dtype=torch.float64)))
        losses, a = [], 0
        for k in range(most // m + 1):  # the merges due, then the rows left for the open round
            b = n if k == most // m else min(n, a + m - self._pending)
            if b > a:
                losses.append(np.asarray(est.partial_fit(X[a:b], y[a:b], classes=self.classes, return_log_loss=True)))
                self._pending += b - a
                a = b
            if k < most // m:  # this rank's round closes (short when it has fewer rows than the fullest rank's)
                if active:
                    self._combine()
                    self._snap = _snapshot(est)
                    self.n_merges_ += 1
                self._pending = 0
        if active and most % m:  # a round is open on some rank: show every rank's rows, keep this rank's own state
            self._own = _snapshot(est)
            self._combine()
        ll = np.concatenate(losses) if losses else np.empty(0)
        self.local_log_loss_ += float(ll.sum())
        return ll


def simulate_sharded(estimators, shards, merge_every, merge="natural", classes=None):
    """The arithmetic of :class:`ShardedOnline` with ``P = len(estimators)`` ranks, in one process.

    Rank ``r`` learns ``shards[r] = (X_r, y_r)``; after every ``merge_every`` rows of each rank the
    natural-parameter changes are summed and applied to all estimators (the all-reduce, in rank
    order). For measuring the approximation without launching processes.

    :returns: list of the ranks' ``(m_r,)`` progressive log-losses.

    Example::

        >>> import numpy as np
        >>> from pyro_convexvb.online import OnlineBayesLogistic, make_online_stream, simulate_sharded
        >>> X, y = make_online_stream(d=50, d_t=5, seed=0).take(1000)
        >>> ranks = [OnlineBayesLogistic(50, prior_var=0.1) for _ in range(2)]
        >>> ll = simulate_sharded(ranks, [(X[:500], y[:500]), (X[500:], y[500:])], merge_every=100)
        >>> [l.shape for l in ll], bool(np.allclose(ranks[0].coef_, ranks[1].coef_))
        ([(500,), (500,)], True)
    """
    if merge not in MERGES:
        raise ValueError(f"merge: expected one of {MERGES}, got {merge!r}")
    for est in estimators:
        _check_estimator(est)
        _start(est, classes)
    rounds = max(math.ceil(X.shape[0] / merge_every) for X, _ in shards)
    losses = [[] for _ in estimators]
    for k in range(rounds):
        snap = _snapshot(estimators[0])
        deltas = []
        for r, (est, (X, y)) in enumerate(zip(estimators, shards)):
            n = X.shape[0]
            a, b = min(k * merge_every, n), min((k + 1) * merge_every, n)
            if b > a:
                losses[r].append(np.asarray(est.partial_fit(X[a:b], y[a:b], classes=classes, return_log_loss=True)))
            deltas.append(_delta(est, snap, merge))
        total = deltas[0].copy()
        for dlt in deltas[1:]:
            total += dlt
        for est in estimators:
            _apply(est, snap, total, merge, len(estimators))
    return [np.concatenate(ls) if ls else np.empty(0) for ls in losses]
