"""Convex variational relaxation for super-Gaussian sites at scale (Nickisch & Seeger 2009; Seeger 2010 §2-4).

Importing this package registers the engine ``convex_relaxation``::

    import pyro_convexvb as pcv
    res = pcv.fit(model, X, y=y, engine="convex_relaxation", options={"lanczos_rank": 80})

Modules: :mod:`.potentials` (super-Gaussian sites, implicit ``h``/``h^*``), :mod:`.problem` (an LGM
in Nickisch & Seeger's (2009) form, constants of the bound), :mod:`.inner` (Newton/IRLS with PCG), :mod:`.outer`
(Lanczos/PCA/exact variance updates, the double loop and its state in and out), :mod:`~pyro_convexvb.infer.convex_relaxation.engine` (the options
and the public class).
"""
from .api import SiteDesigns, laplace_map, site_designs
from .engine import ConvexRelaxationOptions, ConvexVariationalRelaxation, applies, predictive_marginals
from .potentials import (
    GenericPotential,
    LaplacePotential,
    LogisticPotential,
    StudentT,
    StudentTPotential,
    SuperGaussianPotential,
    gaussian_lower_bound,
    h_implicit,
    h_star,
    h_star_implicit,
    potential_for,
)
from .outer import RelaxationState
from .problem import RelaxationProblem

__all__ = [
    "ConvexVariationalRelaxation",
    "applies",
    "ConvexRelaxationOptions",
    "RelaxationState",
    "predictive_marginals",
    "RelaxationProblem",
    "SuperGaussianPotential",
    "LaplacePotential",
    "LogisticPotential",
    "StudentTPotential",
    "GenericPotential",
    "StudentT",
    "potential_for",
    "h_star",
    "h_implicit",
    "h_star_implicit",
    "gaussian_lower_bound",
    "SiteDesigns",
    "site_designs",
    "laplace_map",
]
