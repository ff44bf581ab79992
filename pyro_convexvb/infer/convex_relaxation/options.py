"""``ConvexRelaxationOptions``: the options of the ``convex_relaxation`` engine, the only place of their defaults."""
import typing
from dataclasses import dataclass

from ..engine import LGMEngineOptions, option

__all__ = ["ConvexRelaxationOptions"]


@dataclass(frozen=True)
class ConvexRelaxationOptions(LGMEngineOptions):
    lanczos_rank: int = option(80, "Lanczos steps k per variance update (80 for a9a, 750 for real-sim/rcv1 in "
                                    "Nickisch & Seeger 2009)", min=1)
    max_outer: int = option(5, "outer-loop variance updates (each followed by one inner loop)", min=0)
    max_newton: int = option(20, "Newton steps per inner loop", min=1)
    cg_tol: float = option(1e-6, "relative CG residual of the final Newton systems", gt=0)
    variance: typing.Literal["auto", "lanczos", "exact", "pca"] = option(
        "auto", "variance method: exact (dense Cholesky) when cheaper than K-Lanczos ('auto'), K-Lanczos, exact, "
                "or L-PCA (Seeger 2010)")
    lanczos_block_size: int = option(1, "block size b of block Lanczos (1: Nickisch & Seeger's Lanczos)", min=1)
    lanczos_estimator: typing.Literal["auto", "k-lanczos", "whitened"] = option(
        "auto", "Lanczos variance estimator: K-Lanczos lower bounds on the precision (sparse designs), the "
                "whitened covariance form (GP-type dense prior covariances), or chosen by the model ('auto')")
    pca_rank: typing.Optional[int] = option(None, "L of L-PCA (default lanczos_rank // 6)", min=1)
    newton_tol: float = option(1e-8, "Newton decrement tolerance (relative to |Psi|)", gt=0)
    gamma_tol: float = option(1e-3, "convergence: relative change of gamma between outer iterations", min=0)
    phi_tol: float = option(1e-6, "convergence: relative change of phi between outer iterations", min=0)
    z_min: float = option(1e-10, "floor on the site variances z fed to the inner loop", gt=0)
    gamma_init: typing.Any = option(None, "initial gamma (number or (q,) tensor); default: Gaussians touching each "
                                          "site at 1 + s_0^2")
    z_init: typing.Any = option(None, "warm start: (q,) site variances valid at gamma_init (skips the first "
                                      "variance step)")
    u_init: typing.Any = option(None, "warm start: (n,) mean valid at gamma_init (with z_init)")
    logdet_init: typing.Optional[float] = option(None, "warm start: log|A| at gamma_init (with z_init)")
    dense_logdet_max: int = option(2000, "largest n with an exact log|A| (dense Cholesky) in the Lanczos/PCA modes",
                                   min=0)
    exact_max: int = option(5000, "largest n accepted by variance='exact'", min=1)
    cg_max_iter: typing.Optional[int] = option(None, "CG iteration cap (default: n)", min=1)
    seed: int = option(0, "seed of the Lanczos start vectors")

    def check(self):
        if self.z_init is not None and self.gamma_init is None:
            raise ValueError("option 'z_init' needs 'gamma_init' (the widths the variances belong to)")
        if self.z_init is not None and self.max_outer < 1:
            raise ValueError("option 'z_init' needs 'max_outer' >= 1 (the warm start replaces the first variance "
                             "step only)")
