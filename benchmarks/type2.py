"""Type-II maximum likelihood of ``pyro.param`` sites: model executions and wall time of one fit.

Cases (float64): Bayesian logistic regression with a learned prior scale ``tau`` (``pyro.param``, positive) on
synthetic data, ``N`` rows and ``d`` features (quick: 60 x 3; full: 2,000 x 20), and a linear-Gaussian regression
with a learned prior scale and noise scale (two params; quick 40 x 3, full 2,000 x 20). Engines: ``dual_vg``
(envelope gradients by autograd), ``convex_relaxation`` (envelope gradients by central differences) and
``laplace`` (central differences of refits). Reported per case and engine: model executions of one fit (a
counting wrapper around the model), inner fits, the learned values, the final bound, and the median wall
seconds over ``--repeats`` runs.

Usage::

    python benchmarks/type2.py --quick
    python benchmarks/type2.py            # on a quiet machine
"""
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import torch  # noqa: E402
from _common import Timer, make_parser, markdown_table, parse_args, write_json  # noqa: E402
from torch.distributions import constraints  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402

D = torch.float64


class Counting:
    """A Pyro model that counts its executions."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def logistic_case(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=D)
    y = (torch.rand(n, generator=g, dtype=D) < torch.sigmoid(X @ torch.randn(d, generator=g, dtype=D))).to(D)

    def model(X, y=None):
        tau = pyro.param("tau", torch.tensor(1.0, dtype=D), constraint=constraints.positive)
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), tau).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, X, y


def linear_case(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=D)
    y = X @ torch.randn(d, generator=g, dtype=D) + 0.4 * torch.randn(n, generator=g, dtype=D)

    def model(X, y=None):
        tau = pyro.param("tau", torch.tensor(1.0, dtype=D), constraint=constraints.positive)
        sigma = pyro.param("sigma", torch.tensor(1.0, dtype=D), constraint=constraints.positive)
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), tau).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, sigma), obs=y)

    return model, X, y


def main():
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="runs per engine (default 3, quick 1)")
    args = parse_args(parser=parser)
    repeats = args.repeats or (1 if args.quick else 3)
    sizes = {"logistic": (60, 3) if args.quick else (2000, 20), "linear": (40, 3) if args.quick else (2000, 20)}
    rows = []
    for case, make in (("logistic", logistic_case), ("linear", linear_case)):
        model, X, y = make(*sizes[case], args.seed)
        for engine in ("dual_vg", "convex_relaxation", "laplace"):
            seconds = []
            for _ in range(repeats):
                pyro.clear_param_store()
                pyro.set_rng_seed(args.seed)
                counted = Counting(model)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with Timer() as t:
                        res = pcv.fit(counted, X, y=y, engine=engine, progress=False)
                seconds.append(t.seconds)
            info = res.info["type2"]
            rows.append({"case": case, "N": X.shape[0], "d": X.shape[1], "engine": engine,
                         "model runs": counted.calls, "fits": info["fits"], "iterations": info["iterations"],
                         "bound": info["value"], "converged": res.converged,
                         "learned": {k: float(v) for k, v in res.hyperparameters.items()},
                         "seconds": statistics.median(seconds)})
            print(f"[{case}] {engine}: {counted.calls} model runs, {statistics.median(seconds):.3g} s", flush=True)
    cols = ["case", "N", "d", "engine", "model runs", "fits", "iterations", "bound", "converged", "seconds"]
    print(markdown_table(rows, cols))
    print(write_json("type2_quick" if args.quick else "type2", {"quick": args.quick, "repeats": repeats, "rows": rows}))


if __name__ == "__main__":
    main()
