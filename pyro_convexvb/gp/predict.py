"""GP helpers shared by every engine: kernel matrices from GPyTorch kernels, the Pyro GP
classification model, and the latent predictive at test inputs for any Gaussian posterior."""
import pyro
from pyro import poutine
import pyro.distributions as dist
import torch

__all__ = ["kernel_matrix", "gp_classification_model", "gp_latent_predictive"]


def kernel_matrix(kernel, X, X2=None, jitter=0.0, diag=False):
    """Dense kernel matrix ``k(X, X2)`` from a GPyTorch kernel (gradients reach its hyperparameters).

    :param kernel: any ``gpytorch.kernels.Kernel``.
    :param torch.Tensor X: ``(n, d)``.
    :param torch.Tensor X2: ``(m, d)`` or ``None`` (then ``X2 = X`` and ``jitter`` is added to the diagonal).
    :param bool diag: return only the diagonal ``(n,)`` of ``k(X, X)``.
    :returns: ``(n, m)`` (or ``(n,)`` with ``diag=True``).

    Example::

        >>> import gpytorch, torch
        >>> k = gpytorch.kernels.RBFKernel().double()
        >>> kernel_matrix(k, torch.zeros(3, 2, dtype=torch.float64), jitter=1e-6).shape
        torch.Size([3, 3])
    """
    if diag:
        return kernel(X, diag=True)
    if X2 is None:
        K = kernel(X).to_dense()
        if jitter:
            K = K + jitter * torch.eye(K.shape[0], dtype=K.dtype, device=K.device)
        return K
    return kernel(X, X2).to_dense()


_CHOL_CACHE = {}


def _cholesky(K):
    """Cholesky factor of K, cached for a fixed (non-differentiable) K: engines call the model many times."""
    if K.requires_grad:
        return torch.linalg.cholesky(K)
    key = (id(K), K._version, tuple(K.shape))
    hit = _CHOL_CACHE.get(key)
    if hit is not None and hit[0] is K:
        return hit[1]
    L, info = torch.linalg.cholesky_ex(K)
    if int(info) != 0:
        raise ValueError("the kernel matrix K is not positive definite (add jitter to its diagonal)")
    _CHOL_CACHE.clear()
    _CHOL_CACHE[key] = (K, L)
    return L


def gp_classification_model(K, y=None, mean=0.0, weight=None):
    """Pyro model of GP binary classification: ``f ~ N(mean, K)``, ``y_i ~ Bernoulli(logits=f_i)``.

    :param torch.Tensor K: ``(n, n)`` kernel matrix of the training inputs (with jitter).
    :param torch.Tensor y: ``(n,)`` labels in {0, 1} or ``None``.
    :param torch.Tensor weight: ``(n,)`` positive row weights (``poutine.scale``: row ``i``'s log-likelihood
        times ``weight[i]``) or ``None``.
    """
    n = K.shape[0]
    loc = torch.as_tensor(mean, dtype=K.dtype, device=K.device).expand(n)
    f = pyro.sample("f", dist.MultivariateNormal(loc, scale_tril=_cholesky(K), validate_args=False))
    with pyro.plate("data", n), poutine.scale(scale=1.0 if weight is None else weight):
        return pyro.sample("y", dist.Bernoulli(logits=f), obs=y)


def gp_latent_predictive(K_train, K_cross, k_test_diag, posterior, prior_mean_train=0.0, prior_mean_test=0.0,
                         components=False):
    """Latent GP predictive ``q(f_*) = int p(f_* | f) q(f) df`` at test inputs, for any Gaussian ``q(f)``
    (or mixture of Gaussians).

    With ``A = K_*n K^{-1}``: mean ``m_* + A (mu_q - m)``, variance ``k_** - diag(A K_n*) + diag(A V_q A^T)``.
    For a mixture ``q(f) = (1/C) sum_c N(mu_c, V_c)`` (a posterior with ``component_marginals``, e.g.
    :class:`~pyro_convexvb.infer.diag_mixture.DiagMixturePosterior`) the predictive is the mixture of the
    components' predictives; its mean and variance are the mixture's moments, or with ``components=True`` the
    components' own.

    :param torch.Tensor K_train: ``(n, n)`` training kernel matrix (as used in the model).
    :param torch.Tensor K_cross: ``(m, n)`` test-train kernel matrix.
    :param torch.Tensor k_test_diag: ``(m,)`` test prior variances.
    :param posterior: a :class:`~pyro_convexvb.GaussianPosterior` (or a mixture) over the ``n`` training latents.
    :param bool components: return each mixture component's predictive, ``(C, m)`` means and variances (a
        Gaussian posterior is one component, ``C = 1``), for averaging a nonlinear function of ``f_*`` over the
        mixture (e.g. class probabilities).
    :returns: ``(mean (m,), var (m,))``; with ``components=True``, ``(mean (C, m), var (C, m))``.
    """
    L = torch.linalg.cholesky(K_train)
    A = torch.cholesky_solve(K_cross.transpose(0, 1), L).transpose(0, 1)  # (m, n)
    prior_var = k_test_diag - (A * K_cross).sum(-1)
    shift = -(A @ torch.as_tensor(prior_mean_train, dtype=A.dtype, device=A.device).expand(A.shape[1]))
    if hasattr(posterior, "component_marginals"):
        m_q, var_q = posterior.component_marginals(A, shift)  # (C, m)
    else:
        m_q, var_q = (t.unsqueeze(0) for t in posterior.marginals(A, shift))
    mean = prior_mean_test + m_q
    var = (prior_var + var_q).clamp_min(0.0)
    if components:
        return mean, var
    mix_mean = mean.mean(0)
    return mix_mean, ((var + mean**2).mean(0) - mix_mean**2).clamp_min(0.0)
