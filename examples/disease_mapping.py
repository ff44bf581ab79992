"""Disease mapping: Poisson counts on a map-like lattice with a spatial GMRF of unknown precision.

Observed counts ``y_i`` in the areas of a map, with expected counts ``E_i`` (population times a
reference rate), follow ``y_i ~ Poisson(E_i exp(f_i))``: ``exp(f_i)`` is the area's relative risk. The
log relative risks form a spatial Gaussian Markov random field ``f ~ N(0, (kappa Q0)^{-1})`` with
``Q0 = D - 0.99 W`` (``W``: areas sharing a border), a sparse precision, and the precision ``kappa`` is
unknown with a ``Gamma(1, 0.1)`` prior -- the classic model of disease mapping (Besag, York & Mollié
1991, here with a proper CAR prior), the bread and butter of R-INLA (Rue, Martino & Chopin 2009).

The "map" is a 40 x 40 lattice with irregular borders (a disc with a bay cut out), exposures varying
from rural to urban areas, and a true risk surface with two hot spots. ``dual_vg`` integrates over
``kappa`` (INLA-style design points, each a sparse-Cholesky dual fit of the 1,020-area field) and
returns the posterior relative-risk map, its uncertainty and the marginal of ``kappa``.

Run::

    python examples/disease_mapping.py            # writes docs/figures/disease_mapping.png
"""
import math
import os
import time

import pyro
import pyro.distributions as dist
import torch

import pyro_convexvb as pcv

D = torch.float64
HERE = os.path.dirname(os.path.abspath(__file__))


def make_map(m=40):
    """Areas of an ``m x m`` lattice inside a disc with a bay cut out; their 4-neighbour adjacency."""
    ii, jj = torch.meshgrid(torch.arange(m, dtype=D), torch.arange(m, dtype=D), indexing="ij")
    c = (m - 1) / 2
    inside = ((ii - c) ** 2 + (jj - c) ** 2 <= (0.48 * m) ** 2) & ~((ii > 0.6 * m) & (jj - c).abs().lt(0.12 * m))
    idx = -torch.ones(m, m, dtype=torch.long)
    idx[inside] = torch.arange(int(inside.sum()))
    pairs = []
    for di, dj in ((0, 1), (1, 0)):
        a, b = idx[: m - di, : m - dj], idx[di:, dj:]
        ok = (a >= 0) & (b >= 0)
        pairs.append(torch.stack([a[ok], b[ok]]))
    pairs = torch.cat(pairs, 1)
    n = int(inside.sum())
    rows, cols = torch.cat([pairs[0], pairs[1]]), torch.cat([pairs[1], pairs[0]])
    deg = torch.bincount(rows, minlength=n).to(D)
    ar = torch.arange(n)
    Q0 = torch.sparse_coo_tensor(torch.stack([torch.cat([ar, rows]), torch.cat([ar, cols])]),
                                 torch.cat([deg, -0.99 * torch.ones(rows.numel(), dtype=D)]), (n, n)).coalesce()
    return inside, idx, Q0, ii[inside], jj[inside]


def simulate(inside, xi, xj, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = inside.shape[0]
    hot = 0.7 * torch.exp(-((xi - 0.3 * m) ** 2 + (xj - 0.35 * m) ** 2) / (2 * (0.08 * m) ** 2)) + \
        0.5 * torch.exp(-((xi - 0.65 * m) ** 2 + (xj - 0.75 * m) ** 2) / (2 * (0.1 * m) ** 2))
    f_true = hot - hot.mean() + 0.1 * torch.randn(xi.shape[0], generator=g, dtype=D)
    urban = torch.exp(-((xi - 0.5 * m) ** 2 + (xj - 0.5 * m) ** 2) / (2 * (0.2 * m) ** 2))
    E = 2.0 + 40.0 * urban * torch.rand(xi.shape[0], generator=g, dtype=D)
    y = torch.poisson(E * torch.exp(f_true), generator=g)
    return E, y, f_true


def model(E, Q0, y=None):
    kappa = pyro.sample("kappa", dist.Gamma(torch.tensor(1.0, dtype=D), torch.tensor(0.1, dtype=D)))
    f = pyro.sample("f", pcv.distributions.SparseGMRF(torch.zeros(E.shape[0], dtype=D), Q0, precision_scale=kappa))
    with pyro.plate("areas", E.shape[0]):
        pyro.sample("y", dist.Poisson(E * torch.exp(f)), obs=y)


def main(out=os.path.join(HERE, "..", "docs", "figures", "disease_mapping.png")):
    torch.set_default_dtype(D)
    inside, idx, Q0, xi, xj = make_map()
    E, y, f_true = simulate(inside, xi, xj)
    n = E.shape[0]
    t0 = time.perf_counter()
    res = pcv.fit(model, E, Q0, y=y, engine="dual_vg", progress=False)
    secs = time.perf_counter() - t0
    kappa = res.hyper["marginals"]["kappa"]
    q = {p: float(v) for p, v in kappa["quantiles"].items()}
    print(f"{n} areas, {int(y.sum())} cases; dual_vg with kappa integrated over: {secs:.1f} s, "
          f"{res.hyper['evaluations']} fits, converged={res.converged}")
    print(f"kappa: median {q[0.5]:.3g}, 90% interval [{q[0.05]:.3g}, {q[0.95]:.3g}]")
    f_mean, f_sd = res.posterior.loc, res.posterior.scale
    rr = torch.exp(f_mean)
    print(f"relative risk: range {float(rr.min()):.2f}-{float(rr.max()):.2f}; correlation with the true log risk "
          f"{float(torch.corrcoef(torch.stack([f_mean, f_true]))[0, 1]):.3f}")
    raw = torch.log((y + 0.5) / (E + 0.5))  # the empirical log risk, smoothed by half a case

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def to_map(v):
        img = torch.full(inside.shape, float("nan"), dtype=D)
        img[inside] = v
        return img.numpy()

    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    lim = float(raw.abs().quantile(0.98))
    for ax, v, title, cmap in ((axes[0], raw.clamp(-lim, lim), "empirical log((y + 1/2) / (E + 1/2))", "RdBu_r"),
                               (axes[1], f_mean, "posterior mean of log relative risk", "RdBu_r"),
                               (axes[2], f_sd, "posterior sd", "viridis")):
        vmax = float(v.abs().max()) if cmap == "RdBu_r" else None
        im = ax.imshow(to_map(v), cmap=cmap, vmin=-vmax if vmax else None, vmax=vmax)
        ax.set_title(title)
        ax.axis("off")
        fig.colorbar(im, ax=ax, shrink=0.8)
    z, _ = res.posterior.sample_z(20000, torch.Generator().manual_seed(0))
    kap = torch.exp(z[:, 0])
    axes[3].hist(kap.numpy(), bins=60, density=True, color="tab:blue", alpha=0.7)
    axes[3].set_title("posterior of the precision kappa")
    axes[3].set_xlabel("kappa")
    fig.suptitle(f"Disease mapping, {n} areas: Poisson counts, exposure offset, spatial GMRF with unknown precision")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"figure written to {os.path.abspath(out)}")
    return res


if __name__ == "__main__":
    main()
