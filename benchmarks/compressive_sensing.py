"""Experiment 2 of Seeger 2010 (§5): Bayesian design of Fourier "phase encodes" for a natural image.

A grey natural image (scikit-learn's ``china.jpg``, centre crop, block-averaged to ``H x W``, values in
``[0, 1]``) is measured through real and imaginary parts of its orthonormal 2-D DFT on chosen k-space
columns, with Gaussian noise ``sigma^2 = 1e-3`` on every real number (Seeger 2010 §5). Model (Seeger 2010
Eq. (1)): flat prior on ``u``, Laplace sites ``exp(-tau_j |s_j / sigma|)`` on ``s = [B_a; B_r] u`` (orthonormal
Haar wavelet, horizontal/vertical differences), all matrix-free
(:func:`pyro_convexvb.design.imaging.compressive_sensing_model`).

For a real image, k-space column ``-c`` is the complex conjugate of column ``c``: measuring one gives the
other. Candidates are therefore the non-redundant columns ``c = 0 .. W/2``; measuring ``c`` acquires the
pair ``+-c``. Every design starts from the central low frequencies ``c = 0 .. c0`` (``2 c0 + 1`` full columns)
and adds one column at a time by

* ``delta-lanczos-K``: sequential Bayesian design: refit the convex relaxation (K-Lanczos variances,
  ``K = lanczos_rank`` Lanczos steps,
  warm-started at the previous ``gamma``), score every remaining column by
  ``Delta = log|I + X_c Cov_Q X_c^T / sigma^2|`` (Seeger 2010 §2.2) on the K-Lanczos covariance, take the best;
* ``delta-pca-L``: the same with L-PCA variances and scores (``L = pca_rank``, ``lanczos_rank = 6 L``
  Lanczos steps, Seeger 2010 footnote 5);
* ``random`` (several seeds) and ``lowpass`` (next-lowest frequency first).

For every design and number of columns the error ``||u_MAP - u_true|| / ||u_true||`` of the MAP
reconstruction (an explicit MAP solve, :func:`~pyro_convexvb.design.imaging.laplace_map`, same sites and
noise) is recorded. A second study compares the variances and scores themselves against exact ones on a
32 x 32 image (dense Cholesky affordable): K-Lanczos and L-PCA site variances relative to the exact ``rho``
and the rank agreement of the ``Delta`` curves.

Usage::

    python benchmarks/compressive_sensing.py --quick    # 32 x 32, 4 added columns, ~1.5 minutes
    python benchmarks/compressive_sensing.py --tune     # 64 x 64, 13 added columns, ~13 minutes on 2 cores

Writes ``benchmarks/results/compressive_sensing[_quick].json`` and
``docs/figures/compressive_sensing[_quick].png``.
"""
import math
import os
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import make_parser, markdown_table, parse_args, save_figure, write_json  # noqa: E402

from pyro_convexvb.design.imaging import (  # noqa: E402
    compressive_sensing_model,
    covariance_factor,
    fourier_columns_operator,
    laplace_map,
    phase_encode_scores,
)
from pyro_convexvb.errors import ConvergenceWarning  # noqa: E402
from pyro_convexvb.infer.convex_relaxation import ConvexVariationalRelaxation  # noqa: E402
from pyro_convexvb.linalg.lanczos import lanczos_variances, pca_variances  # noqa: E402

D = torch.float64
NOISE_VAR = 1e-3  # Seeger 2010 §5
MAP_OPTS = dict(z_start=1e-4, z_factor=0.1, z_final=1e-5, cg_tol=1e-6, newton_tol=1e-9)


# ----------------------------------------------------------------------------- data
def load_image(size, name="china.jpg"):
    """Grey ``(size, size)`` image in ``[0, 1]``: centre square crop of 384 pixels, block-averaged."""
    from sklearn.datasets import load_sample_image

    im = load_sample_image(name).astype(np.float64).mean(2) / 255.0
    side = 384
    r0, c0 = (im.shape[0] - side) // 2, (im.shape[1] - side) // 2
    f = side // size
    crop = im[r0:r0 + side, c0:c0 + side]
    return torch.tensor(crop.reshape(size, f, size, f).mean((1, 3)), dtype=D)


class Problem:
    """Image, noisy measurements of every candidate column (fixed once, shared by all designs) and the
    model for any subset of columns."""

    def __init__(self, img, tau_a, tau_r, noise_var=NOISE_VAR, seed=0):
        self.H, self.W = img.shape
        self.img = img
        self.u = img.reshape(-1)
        self.tau_a, self.tau_r, self.noise_var = tau_a, tau_r, noise_var
        self.candidates = list(range(self.W // 2 + 1))
        X = fourier_columns_operator(self.H, self.W, self.candidates)
        g = torch.Generator().manual_seed(seed)
        y = X.mv(self.u) + math.sqrt(noise_var) * torch.randn(X.shape[0], generator=g, dtype=D)
        m, H = len(self.candidates), self.H
        self.re = {c: y[j * H:(j + 1) * H] for j, c in enumerate(self.candidates)}
        self.im = {c: y[H * m + j * H:H * m + (j + 1) * H] for j, c in enumerate(self.candidates)}

    def y(self, cols):
        return torch.cat([self.re[c] for c in cols] + [self.im[c] for c in cols])

    def lgm(self, cols):
        return compressive_sensing_model(self.y(cols), self.H, self.W, cols, self.noise_var, self.tau_a, self.tau_r)

    def map_error(self, cols, u0=None, **opts):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            u, info = laplace_map(self.lgm(cols), u0, **{**MAP_OPTS, **opts})
        return float(torch.linalg.vector_norm(u - self.u) / torch.linalg.vector_norm(self.u)), u


# ----------------------------------------------------------------------------- designs
def run_design(prob, kind, init, n_add, lanczos_rank=None, pca_rank=None, seed=0, max_outer=2):
    """One sequential design; returns the chosen columns and the MAP error after each size."""
    torch.set_num_threads(1)
    cols = list(init)
    rng = np.random.default_rng(seed)
    errs, gamma, u_map = [], None, None
    t_fit = t_map = 0.0
    first_scores = None
    for t in range(n_add + 1):
        t0 = time.perf_counter()
        err, u_map = prob.map_error(cols, u_map)
        t_map += time.perf_counter() - t0
        errs.append(err)
        if t == n_add:
            break
        rest = [c for c in prob.candidates if c not in cols]
        if kind == "random":
            c = int(rng.choice(rest))
        elif kind == "lowpass":
            c = min(rest)
        else:
            t0 = time.perf_counter()
            opts = dict(variance="lanczos", lanczos_rank=lanczos_rank) if kind == "delta-lanczos" else \
                dict(variance="pca", lanczos_rank=6 * pca_rank, pca_rank=pca_rank)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                res = ConvexVariationalRelaxation(prob.lgm(cols), max_outer=max_outer, gamma_init=gamma,
                                                  dense_logdet_max=0, seed=seed + t, progress=False, **opts).run()
            gamma = res.info["gamma_all"]
            F = covariance_factor(res, pca_rank=pca_rank)
            scores = phase_encode_scores(F, prob.H, prob.W, prob.noise_var, candidates=rest)
            if first_scores is None:
                first_scores = dict(zip(rest, scores.tolist()))
            c = rest[int(torch.argmax(scores))]
            t_fit += time.perf_counter() - t0
        cols.append(c)
    label = {"delta-lanczos": f"delta-lanczos-{lanczos_rank}", "delta-pca": f"delta-pca-{pca_rank}",
             "random": f"random-{seed}", "lowpass": "lowpass"}[kind]
    return dict(design=label, kind=kind, lanczos_rank=lanczos_rank, pca_rank=pca_rank, seed=seed, columns=cols,
                errors=errs, seconds_fit=t_fit, seconds_map=t_map)


def _run(args):
    prob, kw = args
    return run_design(prob, **kw)


# ----------------------------------------------------------------------------- variance study
def variance_study(img, tau_a, tau_r, init, Ks, Ls, seed=0):
    """Exact vs K-Lanczos vs L-PCA site variances and Delta curves at the exact fit of the initial design."""
    torch.set_num_threads(1)
    prob = Problem(img, tau_a, tau_r, seed=seed)
    lgm = prob.lgm(init)
    res = ConvexVariationalRelaxation(lgm, variance="exact", max_outer=5, progress=False).run()
    A = res.posterior.precision_operator
    B = lgm.design(lgm.nongaussian_groups)
    rho = res.info["z_all"]
    rest = [c for c in prob.candidates if c not in init]
    d_exact = phase_encode_scores(covariance_factor(res), prob.H, prob.W, prob.noise_var, candidates=rest)
    rows, curves = [], {"exact": d_exact.tolist()}
    gen = torch.Generator().manual_seed(seed)

    def summarise(name, z, F):
        ratio = z / rho
        d = phase_encode_scores(F, prob.H, prob.W, prob.noise_var, candidates=rest)
        curves[name] = d.tolist()
        from scipy.stats import spearmanr

        rows.append(dict(approximation=name, mean_ratio=float(ratio.mean()), median_ratio=float(ratio.median()),
                         frac_below_half=float((ratio < 0.5).double().mean()),
                         delta_ratio_at_best=float(d[int(torch.argmax(d_exact))] / d_exact.max()),
                         spearman_delta=float(spearmanr(d.numpy(), d_exact.numpy())[0]),
                         same_argmax=bool(int(torch.argmax(d)) == int(torch.argmax(d_exact))),
                         exact_rank_of_choice=int((d_exact > d_exact[int(torch.argmax(d))]).sum()) + 1))

    for K in Ks:
        z, lr = lanczos_variances(A, B, K, return_result=True, generator=gen)
        from pyro_convexvb.design.scores import lanczos_covariance_factor

        summarise(f"lanczos-{K}", z, lanczos_covariance_factor(lr))
    for L in Ls:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            z, pr = pca_variances(A, B, L, num_steps=6 * L, max_steps=6 * L, return_result=True, generator=gen,
                                  on_fail="ignore")
        U = pr.ritz_vectors(torch.arange(L))
        summarise(f"pca-{L}", z, U / torch.sqrt(pr.ritz_values[:L]))
    return dict(n=lgm.n, q=int(B.shape[0]), init=init, candidates=rest, rows=rows, curves=curves)


# ----------------------------------------------------------------------------- tau
def tune_tau(img, init_cols, grid, seed=0):
    """MAP error of a fixed ad hoc design for each ``(tau_a, tau_r)`` of ``grid`` (as Seeger 2010 §5 did)."""
    out = []
    for ta, tr in grid:
        prob = Problem(img, ta, tr, seed=seed)
        err, _ = prob.map_error(init_cols)
        out.append(dict(tau_a=ta, tau_r=tr, map_error=err))
    return out


# ----------------------------------------------------------------------------- main
def main(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="processes running designs in parallel")
    parser.add_argument("--tune", action="store_true", help="re-run the tau grid on the ad hoc design")
    parser.add_argument("--image", default="china.jpg", choices=["china.jpg", "flower.jpg"],
                        help="scikit-learn sample image (results of flower.jpg get the suffix _flower)")
    args = parse_args(parser=parser, argv=argv)
    if args.quick:
        size, c0, n_add, Ks, Ls, seeds = 32, 2, 4, [20, 60], [8], [0, 1]
        var_Ks, var_Ls = [10, 40, 120], [4, 16]
    else:
        size, c0, n_add, Ks, Ls, seeds = 64, 4, 13, [20, 50, 150], [5, 20], [0, 1, 2]
        var_Ks, var_Ls = [20, 50, 150], [5, 20]
    tau_a, tau_r = TAU
    img = load_image(size, args.image)
    init = list(range(c0 + 1))
    t_start = time.perf_counter()
    tuning = None
    if args.tune:
        adhoc = list(range(2 * c0 + 1))
        grid = [(tau_a * f, tau_r * f) for f in (0.125, 0.25, 0.5, 1.0, 2.0)]
        tuning = tune_tau(img, adhoc, grid, args.seed)
        print(markdown_table(tuning))
        best = min(tuning, key=lambda r: r["map_error"])
        tau_a, tau_r = best["tau_a"], best["tau_r"]
    prob = Problem(img, tau_a, tau_r, seed=args.seed)
    jobs = [dict(kind="delta-lanczos", lanczos_rank=K) for K in Ks] + [dict(kind="delta-pca", pca_rank=L) for L in Ls]
    jobs += [dict(kind="random", seed=s) for s in seeds] + [dict(kind="lowpass")]
    for j in jobs:
        j.update(init=init, n_add=n_add)
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as ex:
            runs = list(ex.map(_run, [(prob, j) for j in jobs]))
    else:
        runs = [_run((prob, j)) for j in jobs]
    # variance study on a 32 x 32 image (the centre crop of the full image, or the quick image itself)
    H = img.shape[0]
    vimg = img if H == 32 else img[H // 2 - 16:H // 2 + 16, H // 2 - 16:H // 2 + 16].contiguous()
    vstudy = variance_study(vimg, tau_a, tau_r, list(range(3)), var_Ks, var_Ls, args.seed)
    seconds = time.perf_counter() - t_start

    # ---- tables
    sizes = [len(init) + t for t in range(n_add + 1)]
    rnd = [r for r in runs if r["kind"] == "random"]
    rnd_mean = np.mean([r["errors"] for r in rnd], 0)
    low = next(r for r in runs if r["kind"] == "lowpass")
    rows = []
    for r in runs:
        e = np.array(r["errors"])
        rows.append(dict(design=r["design"], err_start=e[0], err_mid=e[len(e) // 2], err_end=e[-1],
                         err_mean_curve=float(e[1:].mean()),
                         vs_random=float(e[1:].mean() / rnd_mean[1:].mean()),
                         vs_lowpass=float(e[1:].mean() / np.mean(low["errors"][1:])),
                         added=" ".join(str(c) for c in r["columns"][len(init):]),
                         seconds=r["seconds_fit"] + r["seconds_map"]))
    print(f"\n{args.image}, {size}x{size}, sigma^2 = {NOISE_VAR}, tau_a = {tau_a}, tau_r = {tau_r}; "
          f"start: half-plane columns "
          f"0..{c0} ({2 * c0 + 1} of {size} k-space columns), {n_add} added; MAP error ||u - u_true||/||u_true||\n")
    print(markdown_table(rows, ["design", "err_start", "err_mid", "err_end", "err_mean_curve", "vs_random",
                                "vs_lowpass", "seconds", "added"],
                         {k: ".4f" for k in ("err_start", "err_mid", "err_end", "err_mean_curve", "vs_random",
                                             "vs_lowpass")} | {"seconds": ".0f"}))
    print(f"\nVariances and Delta scores vs exact ({vstudy['n']} pixels, {vstudy['q']} sites, exact fit of "
          f"columns {vstudy['init']}):\n")
    print(markdown_table(vstudy["rows"], floatfmt=".3f"))
    print(f"\ntotal {seconds:.0f} s")

    name = "compressive_sensing_quick" if args.quick else "compressive_sensing"
    if args.image != "china.jpg":
        name += "_" + args.image.split(".")[0]
    write_json(name, dict(image=args.image, size=size, noise_var=NOISE_VAR, tau_a=tau_a, tau_r=tau_r, init=init,
                          n_add=n_add,
                          sizes=sizes, map_options=MAP_OPTS, runs=runs, table=rows,
                          variance_study=vstudy, tau_tuning=tuning, seconds=seconds))
    figure(name, runs, sizes, vstudy)


def figure(name, runs, sizes, vstudy):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.6))
    x = np.array(sizes)
    rnd = [r for r in runs if r["kind"] == "random"]
    best_lz = max((r for r in runs if r["kind"] == "delta-lanczos"), key=lambda r: r["lanczos_rank"])
    a = ax[0]
    a.plot(x, best_lz["errors"], "o-", label=f"Delta design (K = {best_lz['lanczos_rank']} Lanczos)")
    a.plot(x, np.mean([r["errors"] for r in rnd], 0), "s--", label=f"random (mean of {len(rnd)})")
    for r in rnd:
        a.plot(x, r["errors"], color="C1", alpha=0.25, lw=0.8)
    a.plot(x, next(r for r in runs if r["kind"] == "lowpass")["errors"], "^:", label="low-pass")
    a.set_xlabel("columns measured (c >= 0; each acquires +-c)")
    a.set_ylabel("MAP error ||u - u_true|| / ||u_true||")
    a.set_title("design strategies")
    a.legend()
    a = ax[1]
    for r in runs:
        if r["kind"] == "delta-lanczos":
            a.plot(x, r["errors"], "o-", label=f"K = {r['lanczos_rank']} Lanczos")
        elif r["kind"] == "delta-pca":
            a.plot(x, r["errors"], "x--", label=f"L = {r['pca_rank']} PCA ({6 * r['pca_rank']} steps)")
    a.set_xlabel("columns measured (c >= 0; each acquires +-c)")
    a.set_title("Delta designs: K-Lanczos vs L-PCA")
    a.legend()
    a = ax[2]
    cand = vstudy["candidates"]
    for k, v in vstudy["curves"].items():
        v = np.array(v)
        a.plot(cand, v / v.max(), "k-" if k == "exact" else "-", lw=2 if k == "exact" else 1, label=k)
    a.set_xlabel("candidate column c")
    a.set_ylabel("Delta / max Delta")
    a.set_title("Delta curves (32x32, initial design)")
    a.legend(fontsize=8)
    save_figure(fig, name)


#: (tau_a, tau_r): Seeger 2010 §5's values; also the best of the ``--tune`` grid on the 64 x 64 image (docs/design.md)
TAU = (0.08, 0.16)

if __name__ == "__main__":
    main()
