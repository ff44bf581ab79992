"""Bayesian logistic GLM and random-feature GP classification (Steinberg et al. 2017).

Part A -- Bayesian logistic regression (linear basis + intercept, prior N(0, 1)) on keel magic and
spambase: ``diag_mixture`` (AutoDiagMixture, K = 1 and 4) vs Pyro SVI with AutoNormal and
AutoMultivariateNormal (same model, same Adam settings, same plateau stopping rule), Pyro's
Laplace approximation as a reference, and revrand 1.0.0's GeneralizedLinearModel run in a side
virtual environment (``--revrand-python``; its own defaults: learned prior variance, mini-batches).

Part B -- GP classification on magic: ``RandomFeatureGP`` (ScaleKernel(Matern 5/2, ARD), D random
frequencies, kernel hyperparameters learned inside the mixture ELBO, mini-batches) vs GPyTorch SVGP
with 256 learned inducing points (same kernel, Bernoulli likelihood, mini-batch Adam).  The
fitted random-feature model is then handed, kernel fixed, to the other engines that apply to its
extracted latent Gaussian model (``dual_vg``, ``convex_relaxation``) when they are registered.

Metrics: wall seconds to the stopping rule (part A: the median of ``--repeats`` runs in alternating order, each
run's seconds in ``seconds_runs``; part B: one run), test accuracy, test NLPD (nats per case) and, where
the model is a latent Gaussian model, the deterministic evidence lower bound of each posterior
(Gauss-Hermite site expectations; mixtures use the Eq. 24 entropy bound, and the Bhattacharyya
bound which is exact at K = 1).

Usage: ``python benchmarks/glm.py [--quick] [--threads 1] [--repeats 3]
[--revrand-python /tmp/revrand-venv/bin/python]``.
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Timer, classification_metrics, make_parser, markdown_table, parse_args, save_figure, write_json  # noqa: E402

import numpy as np  # noqa: E402
import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import torch  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402
from pyro_convexvb.datasets import load_keel  # noqa: E402
from pyro_convexvb.errors import ConvergenceWarning  # noqa: E402
from pyro_convexvb.gp.random_features import RandomFeatureGP  # noqa: E402
from pyro_convexvb.infer.diag_mixture import DiagMixturePosterior, mixture_evidence_bound  # noqa: E402
from pyro_convexvb.lgm.linear import linear  # noqa: E402
from pyro_convexvb.lgm.sites import gaussian_expectation  # noqa: E402

DT = torch.float64


def logistic_model(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    wl = w if w.dim() == 1 else w.reshape(w.shape[:-2] + w.shape[-1:])
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=linear(X, wl)), obs=y)


def add_ones(X):
    return torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype)], 1)


def proba(posterior, Phi, offset=0.0):
    """``P(y* = 1)``: per-component exact Gaussian marginals of ``f*`` + Gauss-Hermite."""
    if isinstance(posterior, DiagMixturePosterior):
        M, V = posterior.component_marginals(Phi)
    else:
        m, v = posterior.marginals(Phi)
        M, V = m[None], v[None]
    M = M + offset
    return gaussian_expectation(torch.sigmoid, M.reshape(-1), V.reshape(-1)).reshape(M.shape).mean(0)


def bounds(lgm, posterior):
    if lgm is None:
        return None, None
    if isinstance(posterior, DiagMixturePosterior):
        return mixture_evidence_bound(lgm, posterior, "eq24"), mixture_evidence_bound(lgm, posterior, "bhattacharyya")
    cov = posterior.covariance()
    b = float(lgm.evidence_lower_bound(posterior.loc, cov))
    return b, b


# ----------------------------------------------------------------------------- revrand (side venv)
REVRAND_SCRIPT = r"""
import json, sys, time
import numpy as np
if not hasattr(np, "asscalar"):
    np.asscalar = lambda a: a.item()
from revrand import GeneralizedLinearModel
from revrand.likelihoods import Bernoulli
from revrand.basis_functions import LinearBasis
d = np.load(sys.argv[1])
out = {}
for K in json.loads(sys.argv[3]):
    glm = GeneralizedLinearModel(Bernoulli(), LinearBasis(onescol=True), K=K, maxiter=int(sys.argv[4]),
                                 batch_size=int(sys.argv[5]), random_state=0)
    t = time.perf_counter()
    glm.fit(d["Xtr"], d["ytr"])
    sec = time.perf_counter() - t
    Ey, _ = glm.predict_moments(d["Xte"])
    out[str(K)] = {"seconds": sec, "p": np.clip(Ey, 0, 1).tolist()}
json.dump(out, open(sys.argv[2], "w"))
"""


def run_revrand(python, data, Ks, maxiter, batch_size):
    """Fit revrand's GLM in the side venv; returns ({K: (seconds, p)}, None) or (None, reason)."""
    if not python or not os.path.exists(python):
        return None, f"revrand venv python not found at {python!r}"
    with tempfile.TemporaryDirectory() as tmp:
        npz, out, script = os.path.join(tmp, "d.npz"), os.path.join(tmp, "o.json"), os.path.join(tmp, "r.py")
        np.savez(npz, Xtr=data.X_train.numpy(), ytr=data.y_train.numpy(), Xte=data.X_test.numpy())
        with open(script, "w") as f:
            f.write(REVRAND_SCRIPT)
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        proc = subprocess.run([python, script, npz, out, json.dumps(Ks), str(maxiter), str(batch_size)],
                              capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode != 0:
            return None, "revrand failed: " + proc.stderr.strip().splitlines()[-1][:300]
        res = json.load(open(out))
    return {int(k): (v["seconds"], np.asarray(v["p"])) for k, v in res.items()}, None


# ----------------------------------------------------------------------------- part A
def part_a(name, args):
    data = load_keel(name, seed=args.seed)
    Xtr, ytr, Xte, yte = add_ones(data.X_train), data.y_train, add_ones(data.X_test), data.y_test
    if args.quick:  # a random subset (the split is stored class by class)
        keep = torch.randperm(Xtr.shape[0], generator=torch.Generator().manual_seed(args.seed))[:2000]
        Xtr, ytr = Xtr[keep], ytr[keep]
        data.X_train, data.y_train = data.X_train[keep], data.y_train[keep]
    lgm = pcv.lgm_from_pyro(logistic_model, Xtr, y=ytr)
    svi = dict(lr=0.02, max_steps=1000 if args.quick else 20000, min_steps=500, window=250, rtol=2e-4)
    methods = [
        ("diag_mixture K=1", "diag_mixture", dict(svi, num_components=1, vectorize_particles=True)),
        ("diag_mixture K=4", "diag_mixture", dict(svi, num_components=4, vectorize_particles=True)),
        ("Pyro AutoNormal", "svi_autonormal", dict(svi)),
        ("Pyro AutoMultivariateNormal", "svi_automvn", dict(svi)),
        ("Pyro Laplace (reference)", "laplace", {}),
    ]
    Ks = [1, 4]
    revrand = [f"revrand 1.0.0 GLM K={K}" for K in Ks]
    order = [m[0] for m in methods] + revrand
    rows, times = {}, {label: [] for label in order}
    runs = methods + [("revrand", None, None)]
    for rep in range(args.repeats):  # alternating order; the answers are those of the first repetition
        for label, engine, opts in (runs if rep % 2 == 0 else runs[::-1]):
            if engine is None:
                rr, why = run_revrand(args.revrand_python, data, Ks, 500 if args.quick else 3000, 100)
                for K, lab in zip(Ks, revrand):
                    if rr is None:
                        rows.setdefault(lab, dict(dataset=name, method=lab, note=why))
                        continue
                    sec, p = rr[K]
                    times[lab].append(sec)
                    if lab not in rows:
                        m = classification_metrics(p, yte)
                        rows[lab] = dict(dataset=name, method=lab, steps=3000 if not args.quick else 500,
                                         converged=None, accuracy=m["accuracy"], nlpd=m["nlpd"], elbo_eq24=None,
                                         elbo_exact_entropy=None)
                    print(f"  {name:9s} {lab:30s} {sec:7.2f}s acc={rows[lab]['accuracy']:.4f} "
                          f"nlpd={rows[lab]['nlpd']:.4f}", flush=True)
                continue
            pyro.clear_param_store()
            pyro.set_rng_seed(args.seed)  # every run of a method the same fit, whatever ran before it
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ConvergenceWarning)
                with Timer() as t:
                    res = pcv.fit(logistic_model, Xtr, y=ytr, engine=engine, options=opts, progress=False)
            times[label].append(t.seconds)
            if label not in rows:
                p = proba(res.posterior, Xte)
                b24, bb = bounds(lgm, res.posterior)
                m = classification_metrics(p, yte)
                rows[label] = dict(dataset=name, method=label, steps=res.info.get("steps"),
                                   converged=bool(res.converged) and not caught, accuracy=m["accuracy"],
                                   nlpd=m["nlpd"], elbo_eq24=b24, elbo_exact_entropy=bb)
            print(f"  {name:9s} {label:30s} {t.seconds:7.2f}s acc={rows[label]['accuracy']:.4f} "
                  f"nlpd={rows[label]['nlpd']:.4f} elbo={rows[label]['elbo_exact_entropy']}", flush=True)
    out = []
    for label in order:
        r = rows[label]
        if times[label]:
            r["seconds"], r["seconds_runs"] = float(np.median(times[label])), times[label]
        out.append(r)
    ref = rows["diag_mixture K=1"]
    for r in out:
        if r.get("seconds"):
            r["time_vs_diag_mixture_k1"] = r["seconds"] / ref["seconds"]
    return out


# ----------------------------------------------------------------------------- part B
def matern_kernel(d):
    import gpytorch

    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=d)).double()
    k.base_kernel.lengthscale = torch.full((1, d), 2.0, dtype=DT)
    k.outputscale = 1.0
    return k


def run_svgp(Xtr, ytr, Xte, yte, num_inducing, epochs, batch, seed):
    import gpytorch

    torch.manual_seed(seed)

    class SVGP(gpytorch.models.ApproximateGP):
        def __init__(self, Z):
            q = gpytorch.variational.CholeskyVariationalDistribution(Z.shape[0])
            s = gpytorch.variational.VariationalStrategy(self, Z, q, learn_inducing_locations=True)
            super().__init__(s)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = matern_kernel(Z.shape[1])

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    Z = Xtr[torch.randperm(Xtr.shape[0])[:num_inducing]].clone()
    model = SVGP(Z).double()
    lik = gpytorch.likelihoods.BernoulliLikelihood().double()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=Xtr.shape[0])
    opt = torch.optim.Adam(list(model.parameters()) + list(lik.parameters()), lr=0.01)
    model.train()
    lik.train()
    N = Xtr.shape[0]
    with Timer() as t:
        for _ in range(epochs):
            perm = torch.randperm(N)
            for i in range(0, N, batch):
                idx = perm[i:i + batch]
                opt.zero_grad()
                loss = -mll(model(Xtr[idx]), ytr[idx])
                loss.backward()
                opt.step()
    model.eval()
    lik.eval()
    with torch.no_grad():
        p = lik(model(Xte)).mean
    m = classification_metrics(p, yte)
    return dict(seconds=t.seconds, steps=epochs * math.ceil(N / batch), accuracy=m["accuracy"], nlpd=m["nlpd"])


def part_b(args):
    data = load_keel("magic", seed=args.seed)
    Xtr, ytr, Xte, yte = data.X_train, data.y_train, data.X_test, data.y_test
    if args.quick:
        keep = torch.randperm(Xtr.shape[0], generator=torch.Generator().manual_seed(args.seed))[:2000]
        Xtr, ytr = Xtr[keep], ytr[keep]
    D = 64 if args.quick else args.num_features
    batch = 512
    rows = []
    pyro.clear_param_store()
    gp = RandomFeatureGP(matern_kernel(Xtr.shape[1]), num_features=D, likelihood="bernoulli", learn_kernel=True,
                         subsample_size=batch, seed=args.seed)
    opts = dict(num_components=1, lr=0.02, max_steps=600 if args.quick else 8000, min_steps=500, window=250,
                rtol=2e-4, vectorize_particles=True)
    with Timer() as t:
        res = pcv.fit(gp, Xtr, y=ytr, engine="diag_mixture", options=opts, progress=False)
    p = gp.predict(Xte, res.posterior)
    m = classification_metrics(p, yte)
    rows.append(dict(method=f"RandomFeatureGP D={D} + diag_mixture K=1 (kernel learned)", seconds=t.seconds,
                     steps=res.info["steps"], accuracy=m["accuracy"], nlpd=m["nlpd"]))
    print(f"  rff diag_mixture {t.seconds:.1f}s acc={m['accuracy']:.4f} nlpd={m['nlpd']:.4f}", flush=True)
    # the same features, kernel now fixed, through the engines that work on the extracted LGM
    fixed = gp
    fixed.learn_kernel, fixed.subsample_size = False, None
    for engine in ("dual_vg", "convex_relaxation"):
        if engine not in pcv.engines():
            continue
        try:
            with Timer() as t:
                r = pcv.fit(fixed, Xtr, y=ytr, engine=engine, progress=False)
            with Timer() as tp:
                p = fixed.predict(Xte, r.posterior)
            m = classification_metrics(p, yte)
            note = None if r.posterior.kind != "precision_operator" else \
                f"predictions from 2000 exact posterior samples ({tp.seconds:.1f} s, not in the fit time)"
            rows.append(dict(method=f"RandomFeatureGP D={D} (learned kernel fixed) + {engine}", seconds=t.seconds,
                             steps=None, accuracy=m["accuracy"], nlpd=m["nlpd"], note=note))
            print(f"  rff {engine} {t.seconds:.1f}s acc={m['accuracy']:.4f} nlpd={m['nlpd']:.4f}", flush=True)
        except Exception as e:  # report, do not hide
            rows.append(dict(method=f"RandomFeatureGP D={D} + {engine}", note=f"failed: {type(e).__name__}: {e}"[:300]))
    epochs = 2 if args.quick else args.svgp_epochs
    r = run_svgp(Xtr, ytr, Xte, yte, 64 if args.quick else 256, epochs, batch, args.seed)
    rows.append(dict(method=f"GPyTorch SVGP, {64 if args.quick else 256} learned inducing points ({epochs} epochs)",
                     **r))
    print(f"  svgp {r['seconds']:.1f}s acc={r['accuracy']:.4f} nlpd={r['nlpd']:.4f}", flush=True)
    ref = rows[0]["seconds"]
    for row in rows:
        if row.get("seconds"):
            row["time_vs_rff_diag_mixture"] = row["seconds"] / ref
    return rows


def main():
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--revrand-python", default="/tmp/revrand-venv/bin/python")
    parser.add_argument("--num-features", type=int, default=256)
    parser.add_argument("--svgp-epochs", type=int, default=20)
    parser.add_argument("--skip-gp", action="store_true")
    parser.add_argument("--skip-glm", action="store_true", help="reuse part A from the last results JSON")
    parser.add_argument("--repeats", type=int, default=None,
                        help="part A: alternating runs of every method, median time (default 3, quick 1)")
    args = parse_args(parser=parser)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    torch.manual_seed(args.seed)
    name = "glm_quick" if args.quick else "glm"
    rows_a = []
    if args.skip_glm:  # reuse part A of the last run
        from _common import default_results_dir

        with open(os.path.join(default_results_dir(), f"{name}.json")) as f:
            rows_a = json.load(f)["glm"]
    else:
        for ds in ("magic", "spambase"):
            rows_a += part_a(ds, args)
        write_json(name, {"glm": rows_a, "gp": [], "args": vars(args)})
    cols_a = ["dataset", "method", ("seconds", "seconds"), ("time_vs_diag_mixture_k1", "time / K=1"),
              "steps", ("accuracy", "test acc."), ("nlpd", "test NLPD"), ("elbo_exact_entropy", "ELBO"),
              ("elbo_eq24", "ELBO (Eq. 24 entropy)"), "note"]
    print("\n### Bayesian logistic GLM\n")
    print(markdown_table(rows_a, cols_a, floatfmt={"seconds": ".2f", "time_vs_diag_mixture_k1": ".2f",
                                                   "accuracy": ".4f", "nlpd": ".4f", "elbo_exact_entropy": ".2f",
                                                   "elbo_eq24": ".2f"}))
    rows_b = [] if args.skip_gp else part_b(args)
    if rows_b:
        print("\n### GP classification on magic\n")
        print(markdown_table(rows_b, ["method", ("seconds", "seconds"), ("time_vs_rff_diag_mixture", "time ratio"),
                                      "steps", ("accuracy", "test acc."), ("nlpd", "test NLPD"), "note"],
                             floatfmt={"seconds": ".1f", "time_vs_rff_diag_mixture": ".2f", "accuracy": ".4f",
                                       "nlpd": ".4f"}))
    path = write_json(name, {"glm": rows_a, "gp": rows_b, "args": vars(args)})
    print(f"\nwrote {path}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, ds in zip(axes, ("magic", "spambase")):
        rs = [r for r in rows_a if r["dataset"] == ds and r.get("seconds")]
        for r in rs:
            ax.scatter(r["seconds"], r["nlpd"], s=30)
            ax.annotate(r["method"].replace("Pyro ", "").replace("revrand 1.0.0 ", "revrand "), (r["seconds"], r["nlpd"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("seconds to stop (log)")
        ax.set_ylabel("test NLPD")
        ax.set_title(f"Bayesian logistic GLM, {ds}")
    fig.tight_layout()
    print(save_figure(fig, name))


if __name__ == "__main__":
    main()
