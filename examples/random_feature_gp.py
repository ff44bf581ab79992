"""Random-feature GP regression and classification with a GPyTorch Matérn kernel (Steinberg et al. 2017, §1.4).

Regression: the kernel hyperparameters are learned by type-II maximum likelihood of
:class:`~pyro_convexvb.BayesianLinearRegression` on the random features (exact posterior, Eq. 14),
compared with the exact GP (same hyperparameters, dense Cholesky).  Classification: the same
features inside :class:`~pyro_convexvb.gp.RandomFeatureGP`, a Pyro model whose weights are one
latent Gaussian site, fitted with the ``diag_mixture`` engine (K = 2) and with ``dual_vg`` on the
extracted latent Gaussian model when that engine is registered.

Writes ``docs/figures/rff_gp_example.png``.  Runs in well under a minute.
"""
import os

import gpytorch
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402
from pyro_convexvb.blr import BayesianLinearRegression  # noqa: E402
from pyro_convexvb.gp.random_features import RandomFeatureGP, RandomFourierFeatures  # noqa: E402

DT = torch.float64
torch.set_num_threads(1)
torch.manual_seed(0)
FIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "figures",
                   "rff_gp_example.png")

# ------------------------------------------------------------------ regression
X = torch.rand(80, 1, dtype=DT) * 8 - 4
y = torch.sin(1.5 * X[:, 0]) + 0.3 * torch.cos(4 * X[:, 0]) + 0.15 * torch.randn(80, dtype=DT)
Xs = torch.linspace(-5, 5, 300, dtype=DT).unsqueeze(-1)

kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).double()
rff = RandomFourierFeatures(kernel, num_features=200, seed=0)
blr = BayesianLinearRegression(basis=rff, noise_var=0.1, prior_var=1.0, learn_prior_var=False).fit(X, y)
mean, std = (torch.from_numpy(a) for a in blr.predict(Xs, return_std=True))
kernel = blr.basis_.kernel  # the learned copy (the kernel passed in is left as it was)
print(f"regression: lengthscale {kernel.base_kernel.lengthscale.item():.3f}, outputscale "
      f"{kernel.outputscale.item():.3f}, noise var {blr.noise_var_:.4f}, log ML {blr.log_marginal_likelihood_:.2f}")

# the exact GP with the same hyperparameters
with torch.no_grad():
    K = kernel(X).to_dense() + blr.noise_var_ * torch.eye(80, dtype=DT)
    Ks = kernel(Xs, X).to_dense()
    L = torch.linalg.cholesky(K)
    gp_mean = Ks @ torch.cholesky_solve(y.unsqueeze(-1), L).squeeze(-1)
    V = torch.linalg.solve_triangular(L, Ks.T, upper=False)
    gp_std = (kernel(Xs, diag=True) - (V**2).sum(0) + blr.noise_var_).clamp_min(0).sqrt()
print(f"max |RFF mean - exact GP mean| on the plot grid: {float((mean - gp_mean).abs().max()):.3f}")

# ------------------------------------------------------------------ classification
Xc = torch.rand(200, 1, dtype=DT) * 8 - 4
pc = torch.sigmoid(3 * torch.sin(1.2 * Xc[:, 0]))
yc = torch.bernoulli(pc)
ck = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).double()
ck.base_kernel.lengthscale = 1.0
ck.outputscale = 4.0
gp = RandomFeatureGP(ck, num_features=100, likelihood="bernoulli", seed=1)
# natural-gradient steps on the mixture's exact evidence bound (the default optimiser for a latent Gaussian model)
res = pcv.fit(gp, Xc, y=yc, engine="diag_mixture", progress=False, options=dict(num_components=2))
p_mix, s_mix = gp.predict(Xs, res.posterior, return_std=True)
mf, vf = gp.latent(Xs, res.posterior)
print(f"classification: diag_mixture K=2 converged={res.converged} after {res.info['steps']} natural-gradient "
      f"steps, evidence bound {res.log_evidence_bound:.2f}")
other = None
if "dual_vg" in pcv.engines():
    other = pcv.fit(gp, Xc, y=yc, engine="dual_vg", progress=False)
    p_dual = gp.predict(Xs, other.posterior)
    # a full-covariance Gaussian: the posterior of the 200 feature weights is strongly correlated, which two
    # diagonal components cannot follow, so its bound is higher
    print(f"dual_vg on the same model: evidence bound {other.log_evidence_bound:.2f}")

# ------------------------------------------------------------------ figure
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
ax = axes[0]
ax.plot(X[:, 0], y, "k.", ms=4, label="data")
ax.plot(Xs[:, 0], gp_mean, "C1--", lw=1, label="exact GP")
ax.fill_between(Xs[:, 0], gp_mean - 2 * gp_std, gp_mean + 2 * gp_std, color="C1", alpha=0.12)
ax.plot(Xs[:, 0], mean, "C0", lw=1.5, label="RFF BLR (D=200)")
ax.fill_between(Xs[:, 0], mean - 2 * std, mean + 2 * std, color="C0", alpha=0.2)
ax.set_title("Regression, Matérn 5/2 (type-II ML on the features)")
ax.legend(fontsize=8)
ax = axes[1]
ax.plot(Xc[:, 0], yc, "k|", ms=6, label="labels")
ax.plot(Xs[:, 0], torch.sigmoid(3 * torch.sin(1.2 * Xs[:, 0])), "k:", lw=1, label="true P(y=1)")
ax.plot(Xs[:, 0], p_mix, "C0", lw=1.5, label="RandomFeatureGP + diag_mixture K=2")
lo = torch.sigmoid(mf - 2 * vf.sqrt())
hi = torch.sigmoid(mf + 2 * vf.sqrt())
ax.fill_between(Xs[:, 0], lo, hi, color="C0", alpha=0.2, label="sigmoid(f) ± 2 sd band")
if other is not None:
    ax.plot(Xs[:, 0], p_dual, "C3--", lw=1, label="same model, dual_vg")
ax.set_title("Classification, Matérn 3/2, D=100")
ax.legend(fontsize=7, loc="lower left")
fig.tight_layout()
os.makedirs(os.path.dirname(FIG), exist_ok=True)
fig.savefig(FIG, dpi=120)
print(f"wrote {FIG}")
