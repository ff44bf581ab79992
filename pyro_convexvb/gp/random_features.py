"""Random Fourier features from GPyTorch kernels, and a random-feature GP as a Pyro module.

Steinberg et al. 2017, §1.4 (Rahimi & Recht 2007): by Bochner's theorem a stationary kernel is the Fourier
transform of a nonnegative spectral measure, ``k(tau) = a * E_{s ~ S}[cos(s^T tau)]`` (Eqs. 32-34),
so with ``D`` frequencies ``s_i ~ S`` the features (Eq. 35)

    phi(x) = sqrt(a / D) [cos(s_1^T x), ..., cos(s_D^T x), sin(s_1^T x), ..., sin(s_D^T x)]

give ``phi(x)^T phi(x') -> k(x - x')`` at rate ``O(1/sqrt(D))``.  GPyTorch has no spectral-density
API, so :class:`RandomFourierFeatures` maps each supported kernel to a sampler of its spectral
measure.  The random draws are fixed at construction (standard normal directions, chi-square or
gamma radial factors, component indices, signs); the frequencies are recomputed from the kernel's
*current* hyperparameters at every call, so gradients reach them.

Supported (angular frequencies ``s``; ``ell`` the (ARD) lengthscales):

=====================================  ==========================================================
GPyTorch kernel                        spectral measure
=====================================  ==========================================================
``RBFKernel``                          ``s = eps / ell``, ``eps ~ N(0, I)``
``MaternKernel(nu)``, nu = ½, 3/2, 5/2 multivariate Student-t, ``2 nu`` dof: ``s = eps / ell * sqrt(2 nu / g)``, ``g ~ chi2(2 nu)``
``RQKernel(alpha)``                    scale mixture of RBFs: ``s = eps / ell * sqrt(gamma)``, ``gamma ~ Gamma(alpha, rate=alpha)``
``SpectralMixtureKernel``              per input dim, ``+-(2 pi mu_q + 2 pi sigma_q eps)`` (GPyTorch's product over dims of 1-D mixtures)
``ScaleKernel(k)``                     ``a = outputscale`` times the base kernel's measure
``k1 * k2`` (``ProductKernel``)         ``s = s1 + s2`` (convolution of the measures)
``k1 + k2`` (``AdditiveKernel``)        frequencies split between the terms (sum of the measures)
=====================================  ==========================================================

``active_dims`` are honoured (frequencies are zero on inactive inputs).
"""
import math

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule

from ..lgm.linear import linear

__all__ = ["RandomFourierFeatures", "RandomFeatureGP", "orthogonal_gaussian", "SUPPORTED_KERNELS"]

SUPPORTED_KERNELS = ("RBFKernel", "MaternKernel", "RQKernel", "SpectralMixtureKernel", "ScaleKernel",
                     "ProductKernel", "AdditiveKernel")


def orthogonal_gaussian(num, dim, generator=None, dtype=torch.float64):
    """``(num, dim)`` rows with the marginal law of ``N(0, I_dim)`` draws, orthogonal within blocks of ``dim``.

    Orthogonal random features (Yu et al. 2016, "Orthogonal Random Features"): each block of ``dim``
    rows is ``diag(r) Q`` with ``Q`` a Haar-random orthogonal matrix and ``r`` chi-distributed norms,
    which lowers the variance of the kernel estimate while keeping it unbiased.
    """
    blocks = []
    for _ in range(math.ceil(num / dim)):
        G = torch.randn((dim, dim), generator=generator, dtype=dtype)
        Q, R = torch.linalg.qr(G)
        Q = Q * torch.sign(torch.diagonal(R)).unsqueeze(0)  # Haar measure
        r = torch.randn((dim, dim), generator=generator, dtype=dtype).norm(dim=1)
        blocks.append(r.unsqueeze(1) * Q.transpose(0, 1))
    return torch.cat(blocks, 0)[:num]


def _kernels():
    import gpytorch.kernels as K

    return K


class _Spectrum(torch.nn.Module):
    """Sampler of one kernel's spectral measure with fixed base draws; ``spectrum()`` -> ``(S (D, d), a (D,))``.

    ``k(x, x') ~= (1/D) sum_i a_i cos(s_i^T (x - x'))``.
    """

    def __init__(self, kernel, D, d, generator, orthogonal):
        super().__init__()
        self.kernel, self.D, self.d = kernel, D, d
        self.orthogonal = orthogonal
        if getattr(kernel, "batch_shape", torch.Size()) != torch.Size():
            raise ValueError(f"RandomFourierFeatures: batched kernels are not supported "
                             f"({type(kernel).__name__} has batch_shape {tuple(kernel.batch_shape)})")
        act = getattr(kernel, "active_dims", None)
        self.register_buffer("active", torch.arange(d) if act is None else act.clone().long())
        if self.active.numel() and int(self.active.max()) >= d:
            raise ValueError(f"RandomFourierFeatures: active_dims {self.active.tolist()} exceed the input dimension {d}")
        self.d_act = int(self.active.numel())

    def _normal(self, generator, dtype=torch.float64):
        if self.orthogonal:
            return orthogonal_gaussian(self.D, self.d_act, generator, dtype)
        return torch.randn((self.D, self.d_act), generator=generator, dtype=dtype)

    def _embed(self, S_act):
        """Place ``(D, d_act)`` frequencies into the full ``(D, d)`` input space."""
        if self.d_act == self.d and torch.equal(self.active, torch.arange(self.d, device=self.active.device)):
            return S_act
        S = S_act.new_zeros((self.D, self.d))
        return S.index_copy(1, self.active.to(S_act.device), S_act)

    @staticmethod
    def _lengthscale(kernel):
        ell = kernel.lengthscale  # (1, 1) or (1, d)
        return ell.reshape(-1)


class _RBFSpectrum(_Spectrum):
    def __init__(self, kernel, D, d, generator, orthogonal):
        super().__init__(kernel, D, d, generator, orthogonal)
        self.register_buffer("eps", self._normal(generator))
        self._check_ard(kernel)

    def _check_ard(self, kernel):
        ell = self._lengthscale(kernel)
        if ell.numel() not in (1, self.d_act):
            raise ValueError(f"RandomFourierFeatures: {type(kernel).__name__} has {ell.numel()} lengthscales for "
                             f"{self.d_act} active input dimensions")

    def radial(self, dtype, device):
        return None

    def spectrum(self, dtype, device):
        ell = self._lengthscale(self.kernel).to(dtype)
        S = self.eps.to(dtype=dtype, device=device) / ell
        r = self.radial(dtype, device)
        if r is not None:
            S = S * r.unsqueeze(-1)
        return self._embed(S), torch.ones(self.D, dtype=dtype, device=device)


class _MaternSpectrum(_RBFSpectrum):
    def __init__(self, kernel, D, d, generator, orthogonal):
        super().__init__(kernel, D, d, generator, orthogonal)
        nu = float(kernel.nu)
        if nu not in (0.5, 1.5, 2.5):
            raise ValueError(f"RandomFourierFeatures: MaternKernel nu must be 0.5, 1.5 or 2.5, got {nu}")
        self.nu = nu
        # chi-square with 2 nu (= 1, 3, 5) degrees of freedom: a sum of 2 nu squared normals
        g = torch.randn((D, int(round(2 * nu))), generator=generator, dtype=torch.float64).pow(2).sum(-1)
        self.register_buffer("chi2", g)

    def radial(self, dtype, device):
        return torch.sqrt(2 * self.nu / self.chi2.to(dtype=dtype, device=device))


class _RQSpectrum(_RBFSpectrum):
    def __init__(self, kernel, D, d, generator, orthogonal):
        super().__init__(kernel, D, d, generator, orthogonal)
        self.seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))

    def radial(self, dtype, device):
        alpha = self.kernel.alpha.reshape(()).to(dtype)
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            # gamma ~ Gamma(alpha, rate=alpha): implicit reparameterisation, so d/d alpha flows
            gamma = torch.distributions.Gamma(alpha.expand(self.D).to(device), alpha.expand(self.D).to(device)).rsample()
        return gamma.sqrt()


class _SMSpectrum(_Spectrum):
    def __init__(self, kernel, D, d, generator, orthogonal):
        super().__init__(kernel, D, d, generator, orthogonal)
        Q = int(kernel.num_mixtures)
        if int(kernel.ard_num_dims) != self.d_act:
            raise ValueError(f"RandomFourierFeatures: SpectralMixtureKernel has ard_num_dims={kernel.ard_num_dims} "
                             f"but {self.d_act} active input dimensions")
        self.Q = Q
        self.register_buffer("eps", self._normal(generator))
        # stratified component index per (feature, dim): every component gets D/Q features per dim
        comp = torch.stack([torch.randperm(D, generator=generator) % Q for _ in range(self.d_act)], 1)
        self.register_buffer("comp", comp)
        self.register_buffer("sign", torch.randint(0, 2, (D, self.d_act), generator=generator).double() * 2 - 1)

    def spectrum(self, dtype, device):
        k = self.kernel
        mu = k.mixture_means.reshape(self.Q, self.d_act).to(dtype)
        sd = k.mixture_scales.reshape(self.Q, self.d_act).to(dtype)
        w = k.mixture_weights.reshape(self.Q).to(dtype)
        cols = torch.arange(self.d_act, device=device)
        comp = self.comp.to(device)
        S = 2 * math.pi * (mu[comp, cols] + sd[comp, cols] * self.eps.to(dtype=dtype, device=device))
        S = S * self.sign.to(dtype=dtype, device=device)
        # importance weights for uniform components: prod_d Q w_{q_id}  (GPyTorch: prod_d sum_q w_q k_qd)
        a = (self.Q * w[comp]).prod(-1)
        return self._embed(S), a


class _ScaleSpectrum(torch.nn.Module):
    def __init__(self, kernel, base):
        super().__init__()
        self.kernel, self.base = kernel, base
        self.D = base.D

    def spectrum(self, dtype, device):
        S, a = self.base.spectrum(dtype, device)
        return S, a * self.kernel.outputscale.reshape(()).to(dtype)


class _ProductSpectrum(torch.nn.Module):
    def __init__(self, parts):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.D = parts[0].D

    def spectrum(self, dtype, device):
        S, a = self.parts[0].spectrum(dtype, device)
        for p in self.parts[1:]:
            S2, a2 = p.spectrum(dtype, device)
            S, a = S + S2, a * a2
        return S, a


class _SumSpectrum(torch.nn.Module):
    def __init__(self, parts, sizes):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.sizes = sizes
        self.D = sum(sizes)

    def spectrum(self, dtype, device):
        Ss, As = [], []
        for p, Di in zip(self.parts, self.sizes):
            S, a = p.spectrum(dtype, device)
            Ss.append(S)
            As.append(a * (self.D / Di))
        return torch.cat(Ss, 0), torch.cat(As, 0)


def _build_spectrum(kernel, D, d, generator, orthogonal):
    K = _kernels()
    if isinstance(kernel, K.ScaleKernel):
        act, base_act = getattr(kernel, "active_dims", None), getattr(kernel.base_kernel, "active_dims", None)
        # GPyTorch's ScaleKernel takes its base kernel's active_dims as its own (and then calls the base kernel's
        # forward on the inputs it selected): the same columns, once; other active_dims on the ScaleKernel would
        # override the base kernel's
        if act is not None and (base_act is None or not torch.equal(act.cpu(), base_act.cpu())):
            raise ValueError(f"RandomFourierFeatures: ScaleKernel active_dims {act.tolist()} differ from its base "
                             f"kernel's ({None if base_act is None else base_act.tolist()}); put active_dims on the "
                             f"base kernel only")
        return _ScaleSpectrum(kernel, _build_spectrum(kernel.base_kernel, D, d, generator, orthogonal))
    if isinstance(kernel, K.ProductKernel):
        return _ProductSpectrum([_build_spectrum(k, D, d, generator, orthogonal) for k in kernel.kernels])
    if isinstance(kernel, K.AdditiveKernel):
        n = len(kernel.kernels)
        sizes = [D // n + (1 if i < D % n else 0) for i in range(n)]
        if min(sizes) < 1:
            raise ValueError(f"RandomFourierFeatures: num_features={D} is too small for {n} additive terms")
        return _SumSpectrum([_build_spectrum(k, Di, d, generator, orthogonal) for k, Di in zip(kernel.kernels, sizes)],
                            sizes)
    # exact type checks: subclasses (e.g. gradient kernels) may change the covariance
    for cls, spec in ((K.RBFKernel, _RBFSpectrum), (K.MaternKernel, _MaternSpectrum), (K.RQKernel, _RQSpectrum),
                      (K.SpectralMixtureKernel, _SMSpectrum)):
        if type(kernel) is cls:
            return spec(kernel, D, d, generator, orthogonal)
    name = type(kernel).__name__
    hint = ""
    if name in ("LinearKernel", "PolynomialKernel", "CosineKernel", "ArcKernel", "IndexKernel", "PeriodicKernel"):
        hint = " (it is not a stationary kernel with a spectral density implemented here)"
    raise TypeError(f"RandomFourierFeatures: no spectral density for GPyTorch kernel {name}{hint}; supported: "
                    f"{', '.join(SUPPORTED_KERNELS)}")


class RandomFourierFeatures(torch.nn.Module):
    """Random Fourier features ``Phi(x)`` with ``Phi Phi^T ~= K`` for a GPyTorch stationary kernel.

    Steinberg et al. 2017, §1.4, Eqs. (32)-(35).  The kernel is held as a submodule: the feature map is
    differentiable with respect to its hyperparameters (lengthscales, outputscale, RQ ``alpha``,
    spectral-mixture weights, means and scales), so they can be learned through any objective
    built on the features (e.g. :class:`~pyro_convexvb.BayesianLinearRegression`'s marginal
    likelihood).

    :param kernel: a GPyTorch kernel (see the module table), e.g.
        ``ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=3))``.
    :param int num_features: ``D``, the number of frequencies; the map has ``2 D`` columns.
    :param int input_dim: dimension ``d`` of the inputs (default: taken from the first call).
    :param bool orthogonal: orthogonal random features (Yu et al. 2016) for the Gaussian directions.
    :param int seed: seed of the fixed random draws.
    :raises TypeError: for kernels without a spectral density here (e.g. ``LinearKernel``, ``PeriodicKernel``).

    Example::

        >>> import gpytorch, torch
        >>> k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).double()
        >>> rff = RandomFourierFeatures(k, num_features=4000, seed=0)
        >>> x = torch.randn(5, 2, dtype=torch.float64)
        >>> Phi = rff(x)
        >>> Phi.shape
        torch.Size([5, 8000])
        >>> bool((Phi @ Phi.T - k(x).to_dense()).abs().max() < 0.1)
        True
    """

    def __init__(self, kernel, num_features=256, input_dim=None, orthogonal=False, seed=0):
        super().__init__()
        if not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive integer, got {num_features!r}")
        K = _kernels()
        if not isinstance(kernel, K.Kernel):
            raise TypeError(f"kernel must be a GPyTorch kernel, got {type(kernel).__name__}")
        self.kernel = kernel
        self.num_features = num_features
        self.orthogonal = bool(orthogonal)
        self.seed = int(seed)
        self.spectral = None
        self.input_dim = None
        _check_supported(kernel)
        if input_dim is not None:
            self._build(int(input_dim))

    @property
    def output_dim(self):
        """``2 * num_features``."""
        return 2 * self.num_features

    def _build(self, d):
        gen = torch.Generator().manual_seed(self.seed)
        self.spectral = _build_spectrum(self.kernel, self.num_features, d, gen, self.orthogonal)
        self.input_dim = d

    def frequencies(self, dtype=torch.float64, device=None):
        """``(S (D, d), a (D,))``: angular frequencies and weights, ``k(tau) ~= mean_i a_i cos(s_i^T tau)``."""
        if self.spectral is None:
            raise RuntimeError("RandomFourierFeatures: input dimension unknown; call it on inputs or pass input_dim")
        device = torch.device("cpu") if device is None else torch.device(device)
        return self.spectral.spectrum(dtype, device)

    def forward(self, x):
        """``Phi(x)`` of shape ``(N, 2 D)`` for inputs ``x`` ``(N, d)`` (dtype and device follow ``x``)."""
        if not torch.is_tensor(x) or x.dim() != 2:
            raise ValueError(f"x must be a 2-D tensor (N, d), got {getattr(x, 'shape', type(x))}")
        if not x.is_floating_point():
            raise ValueError("x must be a floating-point tensor")
        if not torch.isfinite(x).all():
            raise ValueError("x contains NaN or inf")
        if self.spectral is None:
            self._build(int(x.shape[1]))
        elif x.shape[1] != self.input_dim:
            raise ValueError(f"x has {x.shape[1]} columns, the features were built for {self.input_dim}")
        S, a = self.spectral.spectrum(x.dtype, x.device)
        proj = x @ S.transpose(0, 1)  # (N, D)
        amp = torch.sqrt(a / self.num_features)
        return torch.cat([torch.cos(proj) * amp, torch.sin(proj) * amp], -1)

    def kernel_matrix(self, x1, x2=None):
        """The random-feature approximation ``Phi(x1) Phi(x2)^T``."""
        P1 = self(x1)
        return P1 @ (P1 if x2 is None else self(x2)).transpose(0, 1)

    def __repr__(self):
        return (f"RandomFourierFeatures(kernel={type(self.kernel).__name__}, num_features={self.num_features}, "
                f"orthogonal={self.orthogonal})")


def _check_supported(kernel):
    """Raise the clear TypeError for unsupported kernels at construction time."""
    K = _kernels()
    if isinstance(kernel, K.ScaleKernel):
        return _check_supported(kernel.base_kernel)
    if isinstance(kernel, (K.ProductKernel, K.AdditiveKernel)):
        for k in kernel.kernels:
            _check_supported(k)
        return
    if type(kernel) in (K.RBFKernel, K.MaternKernel, K.RQKernel, K.SpectralMixtureKernel):
        if type(kernel) is K.MaternKernel and float(kernel.nu) not in (0.5, 1.5, 2.5):
            raise ValueError(f"RandomFourierFeatures: MaternKernel nu must be 0.5, 1.5 or 2.5, got {kernel.nu}")
        return
    _build_spectrum(kernel, 1, 1, torch.Generator().manual_seed(0), False)  # raises the TypeError


_LIKELIHOODS = ("gaussian", "bernoulli", "poisson")


class RandomFeatureGP(PyroModule):
    """A GP approximated by random Fourier features, as a Pyro model whose weights are one latent site.

    ``w ~ N(0, I_{2D})`` (site ``"w"``), ``f = Phi(X) w + mean`` computed with
    :func:`pyro_convexvb.linear` (so :func:`pyro_convexvb.lgm_from_pyro` records the dense design
    ``Phi``), and ``y_n ~ Normal(f_n, noise_scale) | Bernoulli(logits=f_n) | Poisson(exp(f_n))`` in
    a plate named ``"data"`` (optionally subsampled).  Every engine applies: ``pcv.fit(gp, X, y=y,
    engine=...)``.

    :param kernel: GPyTorch kernel (see :class:`RandomFourierFeatures`).
    :param int num_features: number of frequencies ``D`` (``2 D`` weights).
    :param str likelihood: ``"gaussian"``, ``"bernoulli"`` or ``"poisson"``.
    :param float noise_scale: observation noise standard deviation (Gaussian likelihood; fixed).
    :param float mean: constant prior mean of ``f``.
    :param bool orthogonal: orthogonal random features.
    :param int seed: seed of the random frequencies.
    :param bool learn_kernel: register the kernel hyperparameters with ``pyro.module`` so SVI-based
        engines learn them (type-II maximum likelihood within the ELBO); otherwise ``Phi`` is a
        fixed (cached) design.
    :param int subsample_size: mini-batch size of the data plate (``None``: full data).

    Example::

        >>> import gpytorch, torch, pyro_convexvb as pcv
        >>> X = torch.linspace(-2, 2, 30, dtype=torch.float64).unsqueeze(-1); y = torch.sin(3 * X[:, 0])
        >>> gp = RandomFeatureGP(gpytorch.kernels.RBFKernel().double(), num_features=50, noise_scale=0.1)
        >>> lgm = pcv.lgm_from_pyro(gp, X, y=y)
        >>> lgm.n, lgm.num_sites
        (100, 30)
    """

    def __init__(self, kernel, num_features=256, likelihood="gaussian", noise_scale=1.0, mean=0.0, orthogonal=False,
                 seed=0, learn_kernel=False, subsample_size=None, name=""):
        super().__init__(name)
        if likelihood not in _LIKELIHOODS:
            raise ValueError(f"likelihood must be one of {_LIKELIHOODS}, got {likelihood!r}")
        if noise_scale <= 0:
            raise ValueError(f"noise_scale must be positive, got {noise_scale}")
        self.features = RandomFourierFeatures(kernel, num_features, orthogonal=orthogonal, seed=seed)
        self.likelihood = likelihood
        self.noise_scale = float(noise_scale)
        self.mean = float(mean)
        self.learn_kernel = bool(learn_kernel)
        self.subsample_size = subsample_size
        self._cache = None

    @property
    def _rff(self):
        """The feature map, read without :class:`~pyro.nn.PyroModule`'s automatic ``pyro.module`` registration of
        plain ``nn.Module`` children: the kernel's hyperparameters become ``pyro.param`` sites only when
        ``learn_kernel`` is set, and then once, under ``rff_kernel``."""
        return self._modules["features"]

    def design(self, X):
        """``Phi(X)`` ``(N, 2D)``; cached for a fixed kernel, keyed on the tensor ``X`` (object and version) and a
        copy of every hyperparameter's values (a change of any one entry recomputes it)."""
        if self.learn_kernel:
            return self._rff(X)
        values = [p.detach() for p in self._rff.kernel.parameters()]
        if self._cache is not None:
            key, X0, params, Phi = self._cache
            if X0 is X and key == (X._version, X.shape) and len(params) == len(values) and all(
                    a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(params, values)):
                return Phi
        with torch.no_grad():
            Phi = self._rff(X)
        self._cache = ((X._version, X.shape), X, [v.clone() for v in values], Phi)
        return Phi

    def forward(self, X, y=None):
        if y is not None:
            if y.shape != X.shape[:1]:
                raise ValueError(f"y must have shape ({X.shape[0]},), got {tuple(y.shape)}")
            if not torch.isfinite(y).all():
                raise ValueError("y contains NaN or inf")
            if self.likelihood == "bernoulli" and not ((y == 0) | (y == 1)).all():
                raise ValueError("y must hold labels in {0, 1} for the bernoulli likelihood")
        if self.learn_kernel:
            pyro.module("rff_kernel", self._rff)
        D2 = self._rff.output_dim
        w = pyro.sample("w", dist.Normal(X.new_zeros(D2), 1.0).to_event(1))
        # under vectorised particles w is (P, 1, 2D): drop the plate axis so f is (P, N)
        wl = w if w.dim() == 1 else w.reshape(w.shape[:-2] + w.shape[-1:]) if w.shape[-2] == 1 else w
        with pyro.plate("data", X.shape[0], subsample_size=self.subsample_size) as idx:
            if self.subsample_size is None:
                P = self.design(X)
            elif self.learn_kernel:  # features of the mini-batch only
                P = self._rff(X[idx])
            else:
                P = self.design(X)[idx]
            f = linear(P, wl) + self.mean
            obs = None if y is None else (y if self.subsample_size is None else y[idx])
            if self.likelihood == "gaussian":
                pyro.sample("y", dist.Normal(f, self.noise_scale), obs=obs)
            elif self.likelihood == "bernoulli":
                pyro.sample("y", dist.Bernoulli(logits=f), obs=obs)
            else:
                pyro.sample("y", dist.Poisson(torch.exp(f)), obs=obs)
        return f

    # ------------------------------------------------------------------ prediction
    def latent(self, X, posterior, num_samples=2000):
        """Latent ``f(X)`` mean and variance ``(N,)`` under a posterior over ``w``.

        Exact for dense and mixture posteriors; matrix-free (precision-operator) posteriors, whose
        marginals of new rows are not available, are summarised from ``num_samples`` exact samples.

        :param posterior: :class:`~pyro_convexvb.GaussianPosterior` or
            :class:`~pyro_convexvb.infer.diag_mixture.DiagMixturePosterior`.
        """
        X = _query(X, posterior)
        with torch.no_grad():
            Phi = self._rff(X)
            try:
                m, v = posterior.marginals(Phi)
            except NotImplementedError:  # matrix-free precision: estimate from exact posterior samples
                f = posterior.sample(num_samples) @ Phi.transpose(0, 1)
                m, v = f.mean(0), f.var(0)
        return m + self.mean, v

    def predict(self, X, posterior, return_std=False):
        """Predictive mean of ``y`` (``P(y=1)`` for bernoulli, the rate for poisson), and optionally its std.

        Mixture posteriors are averaged over their components (exact per-component Gaussian
        marginals; for the Bernoulli case the classifiers' probabilities,
        :func:`~pyro_convexvb.lgm.families.logit.predictive_log_probs`).
        """
        from ..lgm.families.logit import predictive_log_probs

        X = _query(X, posterior)
        with torch.no_grad():
            Phi = self._rff(X)
        if hasattr(posterior, "component_marginals"):
            M, V = posterior.component_marginals(Phi)
            M = M + self.mean
        else:
            m, v = self.latent(X, posterior)
            M, V = m.unsqueeze(0), v.unsqueeze(0)
        if self.likelihood == "gaussian":
            mean_k, second_k = M, V + M**2 + self.noise_scale**2
        elif self.likelihood == "bernoulli":
            mean_k = predictive_log_probs(M, V)[1].exp()  # the classifiers' probabilities (wide latents too)
            second_k = mean_k
        else:
            mean_k = torch.exp(M + 0.5 * V)
            second_k = mean_k + torch.exp(2 * M + 2 * V)
        mean = mean_k.mean(0)
        if not return_std:
            return mean
        return mean, (second_k.mean(0) - mean**2).clamp_min(0).sqrt()


def _query(X, posterior):
    """Query inputs ``X`` as a tensor in the posterior's dtype and device (float32 inputs of a float64 fit are
    promoted, as scikit-learn's estimators take any float input); anything else raises naming ``X``."""
    if not torch.is_tensor(X) or X.dim() != 2 or X.is_complex():
        raise ValueError(f"X: expected an (N, d) real tensor, got "
                         f"{tuple(X.shape) if torch.is_tensor(X) else type(X).__name__}")
    return X.to(dtype=posterior.dtype, device=posterior.device)
