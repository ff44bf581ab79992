"""Shared numerical linear algebra, device/dtype generic.

* operators (:mod:`.operators`): the product protocol ``mv``/``rmv``/``squared``/``to_dense``;
* :func:`cg`: preconditioned conjugate gradients with batched right-hand sides (and a reduction hook for rows
  spread over processes);
* :func:`backtrack` (:mod:`.linesearch`): the step-halving line search of every damped iteration;
  :class:`LBFGSMemory` and :func:`minimize_lbfgs` (:mod:`.lbfgs`): the L-BFGS two-loop recursion and a
  torch L-BFGS driver;
* :func:`lanczos`, :func:`block_lanczos` (one :class:`LanczosResult`; single-vector Lanczos is block size 1),
  :func:`lanczos_variances`, :func:`pca_variances`: Lanczos with full reorthogonalisation and the K-Lanczos /
  L-PCA variance estimators (Nickisch & Seeger 2009 §2.3, Seeger 2010 §3);
* :func:`newton_bisect_root`, :func:`expand_bracket`, :func:`minimize_convex_scalar`: vectorised
  safeguarded Newton/bisection for many independent scalar problems;
* :class:`SparseCholesky`: sparse Cholesky with a fill-reducing ordering, log-determinant, solves,
  sampling and selected inversion (Rue & Held 2005, §2.4; Takahashi et al. 1973);
* :class:`CirculantSymbol`, :func:`shift_class_symbol` (:mod:`.circulant`): 2-D circulant matrices applied with
  real FFTs and T. Chan's (1988) optimal circulant approximation of ``B^T diag(w) B``; :class:`TileBlocks`
  (:mod:`.tiles`): block diagonals over image tiles (block Jacobi).
"""
from . import operators as _operators
from .circulant import CirculantSymbol, shift_class_symbol
from .tiles import TileBlocks, rows_in_tiles_blocks, tile_layout
from .cg import CGResult, NotPositiveDefiniteError, cg, default_max_iter
from .lanczos import (
    LanczosResult,
    banded_lanczos_z,
    block_lanczos,
    lanczos,
    lanczos_variances,
    pca_variances,
    tridiagonal_cholesky,
)
from .lbfgs import LBFGSMemory, LBFGSResult, minimize_lbfgs
from .linesearch import armijo, backtrack
from .operators import *  # noqa: F401,F403  (every operator class and helper in operators.__all__)
from .scalar import expand_bracket, minimize_convex_scalar, newton_bisect_root
from .sparse_cholesky import SparseCholesky

__all__ = list(_operators.__all__) + [
    "CGResult",
    "cg",
    "default_max_iter",
    "NotPositiveDefiniteError",
    "backtrack",
    "armijo",
    "LBFGSMemory",
    "LBFGSResult",
    "minimize_lbfgs",
    "LanczosResult",
    "lanczos",
    "block_lanczos",
    "banded_lanczos_z",
    "lanczos_variances",
    "pca_variances",
    "tridiagonal_cholesky",
    "newton_bisect_root",
    "expand_bracket",
    "minimize_convex_scalar",
    "SparseCholesky",
    "CirculantSymbol",
    "shift_class_symbol",
    "TileBlocks",
    "rows_in_tiles_blocks",
    "tile_layout",
]
