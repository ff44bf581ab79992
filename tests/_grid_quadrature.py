"""Independent float64 reference for two-parameter models: tensor-grid quadrature under a standard normal prior."""
import numpy as np
from scipy import stats


def grid_posterior_2d(log_lik, lo, hi, n=401, rounds=3):
    """Posterior mean and sd of ``w`` ``(2,)`` and ``log p(y)``, for ``w ~ N(0, I_2)`` and the likelihood
    ``log_lik(W)`` (``W`` ``(M, 2)`` grid points -> ``(M,)`` log-likelihoods), by quadrature on an ``n x n`` grid
    over the box ``[lo, hi]``, re-centred ``rounds`` times on mean +- 10 sd."""
    lo, hi = np.asarray(lo, dtype=float), np.asarray(hi, dtype=float)
    for _ in range(rounds):
        a = [np.linspace(lo[j], hi[j], n) for j in range(2)]
        W = np.stack(np.meshgrid(*a, indexing="ij"), -1).reshape(-1, 2)
        lp = stats.norm.logpdf(W).sum(1) + log_lik(W)
        p = np.exp(lp - lp.max())
        log_ev = float(np.log(p.sum() * np.prod((hi - lo) / (n - 1))) + lp.max())
        p /= p.sum()
        mean = p @ W
        sd = np.sqrt(p @ (W - mean) ** 2)
        lo, hi = mean - 10 * sd, mean + 10 * sd
    return mean, sd, log_ev
