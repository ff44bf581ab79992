"""Long NUTS reference runs for the tests, computed once and stored as JSON (not run in CI).

Usage (from the repository root)::

    python tests/references/generate.py            # every reference; several minutes
    python tests/references/generate.py gp_lengthscale
    python tests/references/generate.py --numpyro bym   # the same protocol with NumPyro's NUTS (``bench`` extra)

Each reference: 4 chains run one after another (different seeds) of 3,000 samples after 1,500 warm-up
steps (GP models in whitened coordinates, the same posterior: ``NUTS_SAMPLERS``); per latent site the mean, standard deviation and the 5%, 50% and 95% quantiles of every
coordinate, with the largest split R-hat and the smallest effective sample size over the chains.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pyro  # noqa: E402
import torch  # noqa: E402
from pyro.infer import MCMC, NUTS  # noqa: E402
from pyro.ops.stats import effective_sample_size, split_gelman_rubin  # noqa: E402

from tests.references.hyper_models import NUTS_REFERENCES, NUTS_SAMPLERS  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "hyper_nuts.json")


def run(name, builder, chains=4, num_samples=3000, warmup=1500):
    model, args, kwargs = builder()
    model, to_sites = NUTS_SAMPLERS.get(name, (model, None))
    per_chain = []
    for c in range(chains):
        pyro.set_rng_seed(100 + c)
        mcmc = MCMC(NUTS(model, target_accept_prob=0.9), num_samples=num_samples, warmup_steps=warmup,
                    disable_progbar=True)
        mcmc.run(*args, **kwargs)
        s = {k: v.detach() for k, v in mcmc.get_samples().items()}
        per_chain.append(s if to_sites is None else to_sites(s, *args))
    out = {"chains": chains, "num_samples": num_samples, "warmup_steps": warmup}
    out.update(summarize_chains(per_chain, list(per_chain[0]), num_samples))
    return out


def run_numpyro(name, chains=4, num_samples=10000, warmup=2000):
    """:func:`run` with NumPyro's NUTS on the model of ``numpyro_models.py`` (the same posterior, written
    independently), longer chains (4 x 10,000 draws after 2,000 warm-up steps); for references whose Pyro NUTS
    run takes hours."""
    from tests.references import numpyro_models

    numpyro_models.setup()
    import jax
    import numpy as np
    from numpyro.infer import MCMC as NMCMC
    from numpyro.infer import NUTS as NNUTS

    _, args, kwargs = NUTS_REFERENCES[name]()
    model, mkw, to_sites = numpyro_models.NUMPYRO_MODELS[name](args, kwargs)
    per_chain = []
    for c in range(chains):
        mcmc = NMCMC(NNUTS(model, target_accept_prob=0.9), num_warmup=warmup, num_samples=num_samples,
                     progress_bar=False)
        mcmc.run(jax.random.PRNGKey(100 + c), **mkw)
        draws = to_sites({k: np.array(v) for k, v in mcmc.get_samples().items()})
        per_chain.append({k: torch.as_tensor(v, dtype=torch.float64) for k, v in draws.items()})
    out = {"chains": chains, "num_samples": num_samples, "warmup_steps": warmup, "sampler": "numpyro"}
    out.update(summarize_chains(per_chain, list(per_chain[0]), num_samples))
    return out


def summarize_chains(per_chain, sites, num_samples):
    """Per site, the mean, sd and 5/50/95% quantiles of every coordinate over all chains, with the largest
    split R-hat and the smallest effective sample size: ``{"sites": ..., "max_split_rhat", "min_ess"}``.

    :param per_chain: one ``{site: (num_samples, ...) draws}`` dict per chain.
    """
    out = {"sites": {}}
    rhat, ess = 1.0, float("inf")
    for site in sites:
        x = torch.stack([pc[site].reshape(num_samples, -1) for pc in per_chain])  # (C, S, k)
        rhat = max(rhat, float(split_gelman_rubin(x).max()))
        ess = min(ess, float(effective_sample_size(x).min()))
        flat = x.reshape(-1, x.shape[-1])
        q = torch.quantile(flat, torch.tensor([0.05, 0.5, 0.95], dtype=flat.dtype), dim=0)
        out["sites"][site] = {"mean": flat.mean(0).tolist(), "sd": flat.std(0).tolist(), "q05": q[0].tolist(),
                              "q50": q[1].tolist(), "q95": q[2].tolist()}
    out["max_split_rhat"], out["min_ess"] = rhat, ess
    return out


def main(names):
    use_numpyro = "--numpyro" in names
    names = [n for n in names if n != "--numpyro"]
    refs = json.load(open(PATH)) if os.path.exists(PATH) else {}
    for name in names or list(NUTS_REFERENCES):
        print(f"{name} ...", flush=True)
        refs[name] = run_numpyro(name) if use_numpyro else run(name, NUTS_REFERENCES[name])
        print(f"  split R-hat {refs[name]['max_split_rhat']:.4f}, min ESS {refs[name]['min_ess']:.0f}")
        with open(PATH, "w") as f:
            json.dump(refs, f, indent=1)


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    main(sys.argv[1:])
