"""``pyro_convexvb.design`` builds on public names only; ``site_designs`` against dense designs and the engine."""
import ast
import importlib
import pathlib

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv
import pyro_convexvb.design as design
from pyro_convexvb.infer.convex_relaxation import ConvexVariationalRelaxation, site_designs

D = torch.float64
DESIGN_DIR = pathlib.Path(design.__file__).parent
#: packages whose ``__all__`` design/ may import from (their public API)
PUBLIC_PACKAGES = ("pyro_convexvb.infer", "pyro_convexvb.infer.convex_relaxation", "pyro_convexvb.linalg")
GUARDED = ("pyro_convexvb.infer", "pyro_convexvb.linalg")


def _resolve(node, package):
    """Absolute module of an ``ImportFrom`` node in a module of ``package``."""
    if node.level == 0:
        return node.module
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _violations(source, package="pyro_convexvb.design"):
    """``(line, text)`` of every import of a private module or name of the guarded packages."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(node, package)
            if not any(mod == g or mod.startswith(g + ".") for g in GUARDED):
                continue
            if mod not in PUBLIC_PACKAGES:
                out.append((node.lineno, f"from {mod} import ... (not a public package)"))
                continue
            exported = set(importlib.import_module(mod).__all__)
            for alias in node.names:
                if alias.name == "*" or alias.name.startswith("_") or alias.name not in exported:
                    out.append((node.lineno, f"from {mod} import {alias.name} (not in {mod}.__all__)"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(alias.name.startswith(g) for g in GUARDED) and alias.name not in PUBLIC_PACKAGES:
                    out.append((node.lineno, f"import {alias.name} (not a public package)"))
    return out


@pytest.mark.parametrize("path", sorted(DESIGN_DIR.glob("*.py")), ids=lambda p: p.name)
def test_design_modules_import_only_public_names(path):
    assert _violations(path.read_text()) == []


def test_checker_flags_private_imports():
    src = ("from ..infer.convex_relaxation.problem import RelaxationProblem\n"
           "from ..infer.convex_relaxation import site_designs, _check_lgm\n"
           "def f():\n    from ..linalg.cg import cg\n"
           "import pyro_convexvb.infer.convex_relaxation.inner\n"
           "from ..infer.convex_relaxation import laplace_map\n"
           "from ..linalg import cg\n"
           "from .scores import _logdet_eye_plus\n")
    assert sorted(line for line, _ in _violations(src)) == [1, 2, 4, 5]


def test_laplace_map_is_the_engine_packages_function():
    from pyro_convexvb.infer.convex_relaxation import laplace_map

    assert design.laplace_map is laplace_map
    assert design.imaging.laplace_map is laplace_map


def _laplace_logit_model(X, y):
    loc = torch.tensor([0.3, -0.2, 0.1], dtype=X.dtype)
    u = pyro.sample("u", dist.Laplace(loc, 0.7).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, u) + 0.5), obs=y)


@pytest.mark.filterwarnings("ignore::pyro_convexvb.errors.ConvergenceWarning")  # two outer steps suffice here
def test_site_designs_dense_order_and_engine_layout():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(7, 3, generator=g, dtype=D)
    y = (torch.rand(7, generator=g, dtype=D) < 0.5).to(D)
    lgm = pcv.lgm_from_pyro(_laplace_logit_model, X, y)
    sd = site_designs(lgm)
    # Laplace prior sites on u - loc (design I, offset -loc), then the cases (design X, offset 0.5)
    assert sd.names == ("u", "y") and sd.slices == (slice(0, 3), slice(3, 10)) and sd.q == 10
    B = torch.cat([torch.eye(3, dtype=D), X])
    torch.testing.assert_close(sd.design.mv(torch.eye(3, dtype=D)), B, rtol=0, atol=1e-15)
    torch.testing.assert_close(sd.offset, torch.tensor([-0.3, 0.2, -0.1] + [0.5] * 7, dtype=D), rtol=0, atol=1e-15)
    # the engine's layout: gamma_all is the per-group gamma in this order, z_all = diag(B A^{-1} B^T)
    res = ConvexVariationalRelaxation(lgm, variance="exact", max_outer=2, progress=False).run()
    gam = res.state.gamma
    torch.testing.assert_close(torch.cat([res.info["gamma"][n] for n in sd.names]), gam, rtol=0, atol=0)
    for n, sl in zip(sd.names, sd.slices):
        torch.testing.assert_close(gam[sl], res.info["gamma"][n], rtol=0, atol=0)
    A = B.T @ (B / gam[:, None])  # Laplace prior: no Gaussian part
    z_ref = torch.diagonal(B @ torch.linalg.solve(A, B.T))
    torch.testing.assert_close(res.state.z, z_ref, rtol=1e-10, atol=1e-12)


def test_site_designs_without_nongaussian_sites_and_validation():
    from pyro_convexvb.lgm.model import LatentGaussianModel
    from pyro_convexvb.lgm.sites import Gaussian

    X = torch.randn(4, 2, dtype=D)
    lgm = LatentGaussianModel.from_design(X, Gaussian(torch.zeros(4, dtype=D), torch.ones(4, dtype=D)))
    sd = site_designs(lgm)
    assert sd.q == 0 and sd.design is None and sd.names == () and sd.offset.shape == (0,)
    with pytest.raises(TypeError, match="lgm"):
        site_designs(X)
