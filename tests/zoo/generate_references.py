"""Reference posteriors of the zoo, computed once and stored in ``references.json`` (never run in CI).

Usage (from the repository root)::

    python tests/zoo/generate_references.py                 # every model (long NUTS runs: tens of minutes)
    python tests/zoo/generate_references.py gp_rbf linear   # some models

Per model the JSON holds ``method`` (``exact``, ``quadrature`` or ``nuts``), a fingerprint of the data
(so a changed builder is noticed) and per latent site the mean and standard deviation of every coordinate
in unconstrained coordinates (``biject_to`` of the site's support).

NUTS references: 4 chains run one after another (seeds 100-103) of ``NUM_SAMPLES`` draws after
``WARMUP`` warm-up steps (target acceptance 0.9, tree depth up to 10), more draws until the largest split
R-hat over every coordinate is below 1.01; the 5/50/95% quantiles, the split R-hat and the smallest
effective sample size are stored with them. Models with a badly conditioned Gaussian prior are sampled in
whitened coordinates (the same posterior; ``nuts_model`` of the zoo entry) and mapped back to their sites:
GP classification as ``f = L v`` with ``K = L L^T``, GMRF models as ``x = L^{-T} v / sqrt(tau)`` with
``Q_0 = L L^T`` (a dense factor, independent of ``SparseGMRF``). Chains are JIT-compiled where the model
traces.
"""
import fcntl
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pyro  # noqa: E402
import torch  # noqa: E402
from pyro.infer import MCMC, NUTS  # noqa: E402
from torch.distributions import biject_to  # noqa: E402

from pyro_convexvb.lgm.extract import latent_sites  # noqa: E402
from tests.references.generate import summarize_chains  # noqa: E402
from tests.zoo.harness import REFERENCES, data_fingerprint  # noqa: E402
from tests.zoo.models import ZOO  # noqa: E402

CHAINS = 4
NUM_SAMPLES = 2000
WARMUP = 1000
MAX_RHAT = 1.01


def _run_chain(model, args, kwargs, num_samples, warmup):
    """One NUTS chain, JIT-compiled when the model traces (the answer is the same, only faster)."""
    for jit in (True, False):
        seed = pyro.util.get_rng_state()
        try:
            kernel = NUTS(model, target_accept_prob=0.9, max_tree_depth=10, jit_compile=jit, ignore_jit_warnings=True)
            mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup, disable_progbar=True)
            mcmc.run(*args, **kwargs)
            return mcmc
        except Exception as e:  # noqa: BLE001 - a model that does not trace runs without the JIT
            if not jit:
                raise
            print(f"  (no JIT: {type(e).__name__})", flush=True)
            pyro.util.set_rng_state(seed)


def nuts_reference(zm, chains=CHAINS, num_samples=NUM_SAMPLES, warmup=WARMUP):
    model, args, kwargs = zm.builder()
    supports = {n: s["fn"].support for n, s in latent_sites(model, args, kwargs)}
    run_model, to_sites = (model, None) if zm.nuts_model is None else zm.nuts_model(args, kwargs)
    while True:
        per_chain = []
        for c in range(chains):
            pyro.set_rng_seed(100 + c)
            mcmc = _run_chain(run_model, args, kwargs, num_samples, warmup)
            s = {k: v.detach() for k, v in mcmc.get_samples().items()}
            if to_sites is not None:
                s = to_sites(s)
            per_chain.append({k: biject_to(supports[k]).inv(v) for k, v in s.items() if k in supports})
        out = {"method": "nuts", "chains": chains, "num_samples": num_samples, "warmup_steps": warmup,
               "whitened": zm.nuts_model is not None}
        out.update(summarize_chains(per_chain, list(supports), num_samples))
        rhat = out["max_split_rhat"]
        if rhat < MAX_RHAT:
            return out
        print(f"  split R-hat {rhat:.4f} >= {MAX_RHAT}: doubling the draws", flush=True)
        num_samples, warmup = 2 * num_samples, 2 * warmup


def reference(name):
    zm = ZOO[name]
    model, args, kwargs = zm.builder()
    if zm.reference == "nuts":
        out = nuts_reference(zm)
    else:
        out = {"method": zm.reference, "sites": zm.reference_fn(args, kwargs)}
    out["fingerprint"] = data_fingerprint(args, kwargs)
    return out


def store(name, value):
    """Add one reference to the JSON file (locked: several processes may write at once)."""
    with open(os.path.join(tempfile.gettempdir(), "pyro_convexvb_zoo_references.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        refs = json.load(open(REFERENCES)) if os.path.exists(REFERENCES) else {}
        refs[name] = value
        refs = {k: refs[k] for k in sorted(refs, key=lambda k: list(ZOO).index(k) if k in ZOO else len(ZOO))}
        with open(REFERENCES, "w") as f:
            json.dump(refs, f, indent=1)
            f.write("\n")
        fcntl.flock(lock, fcntl.LOCK_UN)


def main(names):
    torch.set_num_threads(1)
    for name in names or list(ZOO):
        t0 = time.time()
        print(f"{name} ({ZOO[name].reference}) ...", flush=True)
        out = reference(name)
        extra = (f", split R-hat {out['max_split_rhat']:.4f}, min ESS {out['min_ess']:.0f}"
                 if out["method"] == "nuts" else "")
        print(f"  done in {time.time() - t0:.0f}s{extra}", flush=True)
        store(name, out)


if __name__ == "__main__":
    main(sys.argv[1:])
