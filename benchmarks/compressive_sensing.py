"""Experiment of Seeger 2010 §5: Bayesian design of Fourier phase encodes for natural images, K-Lanczos vs L-PCA.

Protocol (``--full``; docs/design.md describes it and how it maps onto the paper):

* Images: the natural photographs shipped inside the scikit-image wheel (``skimage/data/*.png|jpg``) and
  scikit-learn's two sample photographs, converted to grey (``skimage.color.rgb2gray``), centre square crop of side
  ``min(h, w)``, resized to ``S x S`` (``skimage.transform.resize``, ``order=1``, ``anti_aliasing=True``), values in
  ``[0, 1]``. Five blocks: block ``b`` designs on one image and is tested on five others drawn from the remaining
  pool (seeded); every image gets its own fixed measurement-noise draw.
* Model: :func:`pyro_convexvb.design.compressive_sensing_model` (orthonormal Haar ``tau_a``, horizontal/vertical
  differences ``tau_r``, ``sigma^2 = 1e-3``). ``tau_a, tau_r = f (0.08, 0.16)`` with ``f`` chosen on a grid by the
  mean MAP error of the five design images under a fixed ad hoc design (stage ``tau``).
* Candidates: conjugate column pairs ``c = 0 .. S/2`` (:mod:`pyro_convexvb.design.sequential`); every design
  starts from pairs ``0 .. 16`` (33 columns: the central 32 and the mirror of ``-16``) and adds 39 pairs
  (111 columns).
* Methods: K-Lanczos ``K_var/K_score`` in {50/50, 100/100, 200/200, 500/200, 800/200}, L-PCA ``L`` in {33, 133}
  (``6 L`` Lanczos steps), random (3 seeds), low-pass.
* Test error at every ``eval_every``-th step: ``||u* - u_true|| / ||u_lowpass - u_true||`` (same number of
  columns) and ``/ ||u_32 - u_true||`` (the start design), ``u`` MAP reconstructions, averaged over test images and
  blocks: the exact MAP by ADMM (``imaging_map``, ``--map-solver admm``, default) or the smoothed Newton path
  (``laplace_map``, ``--map-solver newton``); work and seconds of every solve go to ``map_stats`` in the JSON.
  The same errors on each block's own design image go to ``design_errors`` (a separate table, not in the test
  means): how much of a design's gain on the image it was learned from survives on other images.

Resumable: the JSON (``benchmarks/results/compressive_sensing_{quick,default,full}.json``) is rewritten after every
design run and every MAP evaluation unit; a rerun with the same settings skips what it holds (``--restart``
starts afresh). A design run in progress writes a checkpoint after every step
(``benchmarks/results/<name>_checkpoints/``: its chosen pairs, per-step records and the refit's state ``gamma``,
``z``, ``u``, ``log|A|`` in float64), and a rerun continues it from there with the same choices as an
uninterrupted run; the checkpoint is removed when the design is in the JSON. ``--blocks`` and ``--methods`` restrict a run (e.g. one timed block of one method); runs of disjoint
``--blocks`` may share the JSON at the same time (each save is locked and merges what the others wrote).

Usage::

    python benchmarks/compressive_sensing.py --quick     # 32 x 32, 1 block, 3 steps, 4 methods: about a minute
    python benchmarks/compressive_sensing.py             # 32 x 32, 2 blocks, 4 steps, 6 methods: a few minutes
    python benchmarks/compressive_sensing.py --full      # the paper's protocol at 256 x 256 (many hours)
    python benchmarks/compressive_sensing.py --full --blocks 0 --methods K200/200 --no-eval --tau-factor 1 \
        --tag timing --progress                                                             # one timed design
    python benchmarks/compressive_sensing.py --full --figures-only                            # redraw from JSON
    python benchmarks/compressive_sensing.py --full ... --preconditioner jacobi --map-preconditioner jacobi  # CG
                                                                 # preconditioners of refits and MAPs
"""
import json
import math
import os
import shutil
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import default_results_dir as results_dir  # noqa: E402
from _common import make_parser, markdown_table, parse_args, save_figure, write_json  # noqa: E402

from pyro_convexvb.design.imaging import compressive_sensing_model, fourier_columns_operator, laplace_map  # noqa: E402
from pyro_convexvb.design.imaging_map import imaging_map  # noqa: E402
from pyro_convexvb.design.sequential import (  # noqa: E402
    PER_STEP_FIELDS,
    DesignHistory,
    SequentialPhaseEncodeDesign,
    known_columns,
    lowpass_pairs,
    pair_candidates,
)
from pyro_convexvb.errors import ConvergenceWarning  # noqa: E402
from pyro_convexvb.infer.convex_relaxation import RelaxationState  # noqa: E402
from pyro_convexvb.infer.convex_relaxation.problem import PRECONDITIONERS  # noqa: E402

D = torch.float64
NOISE_VAR = 1e-3  # Seeger 2010 §5
TAU_PAPER = (0.08, 0.16)  # Seeger 2010 §5, on the paper's (unstated) image and transform scaling
#: MAP reconstructions, --map-solver newton: smoothing path z = 1e-4 -> 1e-5 (laplace_map), warm-started along each
#: design
MAP_OPTS = dict(z_start=1e-4, z_factor=0.1, z_final=1e-5, cg_tol=1e-6, newton_tol=1e-9)
#: --map-solver admm (default): the exact MAP (imaging_map), residuals to 1e-5 relative (reconstruction errors within
#: ~4e-5 relative of tighter solves at 256 x 256, docs/design.md), warm-started along each design
ADMM_OPTS = dict(tol=1e-5, max_iter=20000)
MAP_SOLVER = "admm"
#: the double loop inside each design step (Seeger et al. 2009: a few Newton steps per refit)
DESIGN_ENGINE = dict(max_newton=8, cg_tol=1e-5)
#: CG preconditioners of the design refits (--preconditioner) and of the MAP solves (--map-preconditioner);
#: docs/design.md, "Cost and the 15-minute target", has the CG counts of each on the start design
PRECONDITIONER = "block4"
MAP_PRECONDITIONER = "block4"
SKIMAGE_PHOTOS = ["astronaut.png", "brick.png", "camera.png", "chelsea.png", "coffee.png", "coins.png", "grass.png",
                  "gravel.png", "moon.png", "motorcycle_left.png", "rocket.jpg"]
SKLEARN_PHOTOS = ["china.jpg", "flower.jpg"]

CONFIGS = {
    "quick": dict(size=32, central=8, steps=3, eval_every=1, blocks=1, tests=2, tau_factors=None,
                  methods=["K20/20", "PCA4", "random-0", "lowpass"], residual_steps=[1, 3],
                  residual_methods=["K20/20"]),
    "default": dict(size=32, central=8, steps=4, eval_every=2, blocks=2, tests=2, tau_factors=None,
                    methods=["K20/20", "K40/20", "PCA4", "random-0", "random-1", "lowpass"],
                    residual_steps=[2, 4], residual_methods=["K20/20", "K40/20"]),
    "full": dict(size=256, central=32, steps=39, eval_every=5, blocks=5, tests=5, tau_factors=[0.25, 0.5, 1, 2, 4],
                 methods=["K50/50", "K100/100", "K200/200", "K500/200", "K800/200", "PCA33", "PCA133",
                          "random-0", "random-1", "random-2", "lowpass"],
                 residual_steps=[19, 24, 29, 34, 39], residual_methods=["K50/50", "K100/100", "K200/200"]),
}


# ----------------------------------------------------------------------------- images
def _photo_paths():
    import skimage
    import sklearn.datasets

    sk = os.path.join(os.path.dirname(skimage.__file__), "data")
    sl = os.path.join(os.path.dirname(sklearn.datasets.__file__), "images")
    return [("scikit-image", f, os.path.join(sk, f)) for f in SKIMAGE_PHOTOS] + \
           [("scikit-learn", f, os.path.join(sl, f)) for f in SKLEARN_PHOTOS]


def load_pool(size):
    """``{name: (image (size, size) float64 in [0, 1], record)}``; record says file, original shape, crop, resize."""
    from skimage import color, io, transform

    pool = {}
    for source, fname, path in _photo_paths():
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: not shipped with the installed {source}; the image pool needs it")
        im = io.imread(path)
        shape = list(im.shape)
        if im.ndim == 3:
            im = color.rgb2gray(im[..., :3])
        else:
            im = im.astype(np.float64) / (255.0 if im.dtype == np.uint8 else 1.0)
        h, w = im.shape
        s = min(h, w)
        r0, c0 = (h - s) // 2, (w - s) // 2
        crop = im[r0:r0 + s, c0:c0 + s]
        out = transform.resize(crop, (size, size), order=1, anti_aliasing=True)
        name = fname.rsplit(".", 1)[0]
        pool[name] = (np.clip(out, 0.0, 1.0), dict(
            source=source, file=fname, original_shape=shape, grey="skimage.color.rgb2gray" if len(shape) == 3 else
            "uint8 / 255", crop=dict(row=r0, col=c0, side=s),
            resize=f"skimage.transform.resize(crop, ({size}, {size}), order=1, anti_aliasing=True), clipped to [0, 1]"))
    return pool


def make_blocks(names, num_blocks, num_tests, seed):
    """Block ``b``: design image ``perm[b]``, ``num_tests`` test images drawn from the others (seeded)."""
    rng = np.random.default_rng(seed)
    perm = [names[i] for i in rng.permutation(len(names))]
    blocks = []
    for b in range(num_blocks):
        design = perm[b % len(perm)]
        rest = [n for n in names if n != design]
        tests = [rest[i] for i in sorted(rng.choice(len(rest), size=num_tests, replace=False))]
        blocks.append(dict(design_image=design, test_images=tests))
    return blocks


class Measurements:
    """Noisy measurements of every candidate pair of one image (one fixed draw per image)."""

    def __init__(self, img, seed, preconditioner=MAP_PRECONDITIONER, solver=MAP_SOLVER, noise_var=NOISE_VAR):
        if solver not in ("admm", "newton"):
            raise ValueError(f"solver: expected 'admm' or 'newton', got {solver!r}")
        self.H = img.shape[0]
        self.preconditioner, self.solver, self.noise_var = preconditioner, solver, float(noise_var)
        self.stats = []  # per MAP solve: solver, work counts, seconds
        self.u = torch.tensor(img, dtype=D).reshape(-1)
        self.cand = pair_candidates(self.H)
        X = fourier_columns_operator(self.H, self.H, self.cand)
        g = torch.Generator().manual_seed(int(seed))
        y = X.mv(self.u) + math.sqrt(self.noise_var) * torch.randn(X.shape[0], generator=g, dtype=D)
        m, H = len(self.cand), self.H
        self.re = [y[j * H:(j + 1) * H] for j in range(m)]
        self.im = [y[H * m + j * H:H * m + (j + 1) * H] for j in range(m)]

    def __call__(self, pairs):
        return torch.cat([self.re[c] for c in pairs] + [self.im[c] for c in pairs])

    def map(self, pairs, tau, u0=None, init=None):
        """MAP reconstruction under the design ``pairs``; ``u0`` (and, for ADMM, ``init``: the ``state`` of the
        previous solve, kept in ``self.last_state``) warm-start it."""
        lgm = compressive_sensing_model(self(pairs), self.H, self.H, list(pairs), self.noise_var, *tau)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            if self.solver == "admm":
                if init is not None and u0 is not None:  # the previous solve's state (its u, s, multipliers)
                    u, info = imaging_map(lgm, init=init, progress=False, **ADMM_OPTS)
                else:
                    u, info = imaging_map(lgm, u0, progress=False, **ADMM_OPTS)
                rec = dict(solver="admm", iterations=info["iterations"], products=info["products"])
                self.last_state = info["state"]
            else:
                u, info = laplace_map(lgm, u0, preconditioner=self.preconditioner, **MAP_OPTS)
                rec = dict(solver="newton", newton_steps=sum(info["newton_steps"]),
                           cg_iterations=sum(sum(c) for c in info["cg_iterations"]))
        rec.update(seconds=time.perf_counter() - t0, converged=info["converged"], warnings=len(caught))
        self.stats.append(rec)
        return u

    def error(self, u):
        return float(torch.linalg.vector_norm(u - self.u))


# ----------------------------------------------------------------------------- methods
def parse_method(m):
    import re

    if re.fullmatch(r"K\d+/\d+", m):
        kv, ks = (int(x) for x in m[1:].split("/"))
        if 1 <= ks <= kv:
            return dict(kind="lanczos", k_var=kv, k_score=ks)
    elif re.fullmatch(r"PCA\d+", m) and int(m[3:]) >= 1:
        return dict(kind="pca", pca_rank=int(m[3:]))
    elif re.fullmatch(r"random-\d+", m):
        return dict(kind="random", seed=int(m.split("-")[1]))
    elif m == "lowpass":
        return dict(kind="lowpass")
    raise ValueError(f"--methods: unknown method {m!r} (K<var>/<score>, PCA<L>, random-<seed>, lowpass)")


def load_checkpoint(path, key):
    """``(history, seconds, resumed_at)`` of an interrupted design run saved at ``path`` by
    :func:`save_checkpoint` (``resumed_at``: the steps it continued from before), or ``(None, 0, [])`` if there is
    none; a checkpoint of another design (``key``: method, start, steps, tau, seed,
    engine options) is an error."""
    if path is None or not os.path.exists(path):
        return None, 0.0, []
    ck = torch.load(path, weights_only=True)
    if ck.get("key") != key:
        raise SystemExit(f"{path}: a checkpoint of another design ({ck.get('key')}, expected {key}); delete it or "
                         "pass --restart")
    st = ck["state"]
    hist = DesignHistory(start=list(key["start"]), **{f: list(ck["history"][f]) for f in PER_STEP_FIELDS},
                         state=RelaxationState(st["gamma"], st["u"], st["z"], st["logdet"]),
                         settings=ck["history"]["settings"])
    return hist, float(ck["seconds"]), [int(t) for t in ck["resumed_at"]]


def save_checkpoint(path, key, hist, seconds, resumed_at):
    """Write the design run's history and the refit's warm-start state to ``path`` (atomically)."""
    st = hist.state
    state = {f: getattr(st, f).detach().to("cpu", copy=True) if getattr(st, f) is not None else None
             for f in ("gamma", "z", "u")}
    state["logdet"] = None if st.logdet is None else float(st.logdet)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    history = {f: list(getattr(hist, f)) for f in PER_STEP_FIELDS}
    history["settings"] = hist.settings
    torch.save(dict(key=key, history=history, state=state,
                    seconds=float(seconds), resumed_at=list(resumed_at)), tmp)
    os.replace(tmp, path)


def run_design(meas, start, steps, method, tau, seed, progress, engine_options=None, checkpoint=None):
    """Ordered added pairs of one design, with per-step times for the Bayesian ones; with ``checkpoint`` (a path)
    the Bayesian ones save their progress after every step and continue from a checkpoint found there
    (``resumed_at``: the steps a run continued from; ``seconds_earlier``: the seconds spent before them)."""
    spec = parse_method(method)
    rest = [c for c in meas.cand if c not in start]
    if spec["kind"] == "lowpass":
        return dict(added=rest[:steps])
    if spec["kind"] == "random":
        rng = np.random.default_rng([spec["seed"], seed])  # method seed and block seed: a new draw per block
        return dict(added=[int(c) for c in rng.choice(rest, size=steps, replace=False)])
    kw = dict(variance="lanczos", k_var=spec["k_var"], k_score=spec["k_score"]) if spec["kind"] == "lanczos" else \
        dict(variance="pca", pca_rank=spec["pca_rank"])
    d = SequentialPhaseEncodeDesign(meas, meas.H, meas.H, meas.noise_var, *tau, seed=seed,
                                    engine_options=DESIGN_ENGINE if engine_options is None else engine_options,
                                    progress=progress, **kw)
    key = dict(method=method, start=[int(c) for c in start], steps=int(steps), tau=[float(t) for t in tau],
               seed=int(seed), engine_options=dict(d.engine_options))
    resume, earlier, resumed_at = load_checkpoint(checkpoint, key)
    if resume is not None:
        resumed_at = resumed_at + [len(resume.added)]
    t0 = time.perf_counter()
    callback = None if checkpoint is None else \
        (lambda h: save_checkpoint(checkpoint, key, h, earlier + time.perf_counter() - t0, resumed_at))
    h = d.run(start, steps, callback=callback, resume=resume)
    out = {f: getattr(h, f) for f in PER_STEP_FIELDS if f != "converged"}
    if resumed_at:
        out["resumed_at"] = resumed_at
        out["seconds_earlier"] = earlier
    return out


# ----------------------------------------------------------------------------- state
class State:
    """The results JSON, rewritten after every unit of work."""

    def __init__(self, name, settings, restart):
        self.name, self.path = name, os.path.join(results_dir(), name + ".json")
        doc = None
        if os.path.exists(self.path) and not restart:
            with open(self.path) as f:
                doc = json.load(f)
            if "settings" not in doc:  # a result of the earlier one-image benchmark: not resumable, replaced
                doc = None
            elif doc.get("settings") != settings:
                raise SystemExit(f"{self.path} was written with other settings; pass --restart to start afresh")
        self.doc = doc or dict(settings=settings, images={}, tau=None, blocks={}, map_errors={})

    def save(self):
        """Write the JSON; under a lock, after merging what another run with the same settings wrote meanwhile
        (runs of disjoint ``--blocks`` can share the file, e.g. one per core)."""
        import fcntl

        os.makedirs(os.path.dirname(self.path), exist_ok=True)  # a fresh $PYRO_CONVEXVB_RESULTS_DIR
        with open(self.path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.path.exists(self.path):
                with open(self.path) as f:
                    disk = json.load(f)
                if disk.get("settings") == self.doc["settings"]:
                    merge_missing(self.doc, disk)
            write_json(self.name, {k: v for k, v in self.doc.items() if k not in ("benchmark", "machine")})


def merge_missing(doc, other):
    """Add to ``doc`` (in place) the units of work ``other`` holds and ``doc`` does not: the tau choice, blocks,
    their design runs, test errors and design-image errors, MAP errors and their stats, session times."""
    if doc.get("tau") is None and other.get("tau") is not None:
        doc["tau"] = other["tau"]
    for b, blk in other.get("blocks", {}).items():
        mine = doc["blocks"].setdefault(b, blk)
        if mine is not blk:
            for part in ("methods", "errors", "design_errors"):
                mine.setdefault(part, {})
                for k, v in blk.get(part, {}).items():
                    mine[part].setdefault(k, v)
    for k, v in other.get("map_errors", {}).items():
        doc["map_errors"].setdefault(k, v)
    have = {s["key"] for s in doc.get("map_stats", [])}
    extra = [s for s in other.get("map_stats", []) if s["key"] not in have]
    if extra:
        doc.setdefault("map_stats", []).extend(extra)
    theirs = [v for v in other.get("seconds_sessions", []) if v not in doc.get("seconds_sessions", [])]
    if theirs:
        doc.setdefault("seconds_sessions", []).extend(theirs)


def map_key(image, pairs):
    return image + "|" + ",".join(str(c) for c in sorted(pairs))


def evaluate(state, meas_of, image, designs, tau, quiet=True):
    """MAP errors of ``image`` under each design (list of pair lists), cached by (image, pairs), warm-started."""
    cache = state.doc["map_errors"]
    u0, init = None, None
    out = []
    for pairs in designs:
        key = map_key(image, pairs)
        if key not in cache:
            mm = meas_of(image)
            u0 = mm.map(pairs, tau, u0, init)
            init = getattr(mm, "last_state", None)
            cache[key] = mm.error(u0)
            state.doc.setdefault("map_stats", []).append(dict(key=key, **mm.stats[-1], quiet=quiet,
                                                              threads=torch.get_num_threads()))
        out.append(cache[key])
    return out


# ----------------------------------------------------------------------------- main
def main(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the paper's protocol at 256 x 256")
    parser.add_argument("--blocks", default=None, help="comma-separated block indices (default all)")
    parser.add_argument("--methods", default=None, help="comma-separated methods (default all of the mode)")
    parser.add_argument("--no-eval", action="store_true", help="design runs only (no MAP test errors)")
    parser.add_argument("--restart", action="store_true", help="ignore an existing results JSON")
    parser.add_argument("--figures-only", action="store_true", help="redraw figures and tables from the JSON")
    parser.add_argument("--progress", action="store_true", help="tqdm bars over design steps")
    parser.add_argument("--tau-factor", type=float, default=None,
                        help="fix tau = F (0.08, 0.16) instead of choosing F on the grid (no tau MAP solves)")
    parser.add_argument("--tag", default=None, help="suffix of the results/figure names (e.g. a timing run)")
    parser.add_argument("--shared-cpu", action="store_true",
                        help="the machine is not quiet (other work beside this run): the design runs and MAP solves "
                             "of this session are marked quiet=False in the JSON and the timing tables")
    parser.add_argument("--design-newton", type=int, default=DESIGN_ENGINE["max_newton"],
                        help="Newton steps per refit of a design step (recorded in the settings)")
    parser.add_argument("--design-cg-tol", type=float, default=DESIGN_ENGINE["cg_tol"],
                        help="final CG tolerance of the refits (recorded in the settings)")
    parser.add_argument("--preconditioner", choices=list(PRECONDITIONERS), default=PRECONDITIONER,
                        help="CG preconditioner of the design refits (recorded in the settings)")
    parser.add_argument("--map-preconditioner", choices=list(PRECONDITIONERS), default=MAP_PRECONDITIONER,
                        help="CG preconditioner of the Newton MAP reconstructions (recorded in the settings)")
    parser.add_argument("--noise-var", type=float, default=NOISE_VAR,
                        help="measurement noise variance sigma^2 on [0, 1] grey values (default 1e-3, Seeger 2010 "
                             "§5; recorded in the settings; use with --tag)")
    parser.add_argument("--map-solver", choices=["admm", "newton"], default=MAP_SOLVER,
                        help="MAP reconstructions: exact by ADMM (imaging_map) or the smoothed Newton path "
                             "(laplace_map); recorded in the settings")
    args = parse_args(parser=parser, argv=argv)
    if args.design_newton < 1 or not 0 < args.design_cg_tol < 1:
        parser.error("--design-newton must be >= 1 and --design-cg-tol in (0, 1)")
    if not (math.isfinite(args.noise_var) and args.noise_var > 0):
        parser.error("--noise-var must be a positive number")
    design_engine = dict(max_newton=args.design_newton, cg_tol=args.design_cg_tol, preconditioner=args.preconditioner)
    mode = "full" if args.full else ("quick" if args.quick else "default")
    cfg = dict(CONFIGS[mode])
    if args.tau_factor is not None:
        if not (math.isfinite(args.tau_factor) and args.tau_factor > 0):
            parser.error("--tau-factor must be a positive number")
        cfg["tau_factors"] = [args.tau_factor]
    name = "compressive_sensing_" + mode + ("_" + args.tag if args.tag else "")
    settings = dict(mode=mode, seed=args.seed, noise_var=args.noise_var, design_engine=design_engine,
                    map_solver=args.map_solver,
                    map_options=dict(ADMM_OPTS) if args.map_solver == "admm" else
                    dict(MAP_OPTS, preconditioner=args.map_preconditioner),
                    **{k: v for k, v in cfg.items() if k not in ("methods",)})
    state = State(name, settings, args.restart)
    ck_dir = os.path.join(results_dir(), name + "_checkpoints")
    if args.restart and os.path.exists(os.path.join(results_dir(), name + "_residuals.npz")):
        os.remove(os.path.join(results_dir(), name + "_residuals.npz"))
    if args.restart and os.path.isdir(ck_dir):
        shutil.rmtree(ck_dir)
    if args.figures_only:
        report(state.doc, name)
        return
    size, steps = cfg["size"], cfg["steps"]
    start = lowpass_pairs(size, cfg["central"])
    methods = cfg["methods"] if args.methods is None else args.methods.split(",")
    for m in methods:
        parse_method(m)
    pool = load_pool(size)
    names = sorted(pool)
    state.doc["images"] = {k: pool[k][1] for k in names}
    blocks = make_blocks(names, cfg["blocks"], cfg["tests"], args.seed)
    which = range(cfg["blocks"]) if args.blocks is None else [int(b) for b in args.blocks.split(",")]
    meas_cache = {}

    def meas_of(image):
        if image not in meas_cache:
            meas_cache[image] = Measurements(pool[image][0], args.seed * 7919 + names.index(image),
                                             args.map_preconditioner, args.map_solver, args.noise_var)
        return meas_cache[image]

    t_all = time.perf_counter()
    # ---- tau: one global pair from MAP errors of the design images under a fixed ad hoc design
    if state.doc["tau"] is None:
        if cfg["tau_factors"] is None or len(cfg["tau_factors"]) == 1:
            f = 1.0 if cfg["tau_factors"] is None else float(cfg["tau_factors"][0])
            state.doc["tau"] = dict(tau_a=TAU_PAPER[0] * f, tau_r=TAU_PAPER[1] * f, factor=f, grid=None)
        else:
            adhoc = start + [c for c in pair_candidates(size) if c > start[-1] and c % 4 == 0]
            grid = []
            for f in cfg["tau_factors"]:
                tau = (TAU_PAPER[0] * f, TAU_PAPER[1] * f)
                errs = []
                for b in blocks:
                    mm = meas_of(b["design_image"])
                    errs.append(mm.error(mm.map(adhoc, tau)) / float(torch.linalg.vector_norm(mm.u)))
                grid.append(dict(factor=f, tau_a=tau[0], tau_r=tau[1], mean_rel_error=float(np.mean(errs))))
                print(f"tau factor {f}: mean relative MAP error {np.mean(errs):.4f}", flush=True)
            best = min(grid, key=lambda r: r["mean_rel_error"])
            state.doc["tau"] = dict(tau_a=best["tau_a"], tau_r=best["tau_r"], factor=best["factor"], grid=grid,
                                    adhoc_pairs=adhoc, adhoc_columns=known_columns(adhoc, size))
        state.save()
    tau = (state.doc["tau"]["tau_a"], state.doc["tau"]["tau_r"])
    eval_steps = evaluation_steps(settings)
    for b in which:
        blk = state.doc["blocks"].setdefault(str(b), dict(**blocks[b], start=start, methods={}, errors={}))
        if blk["design_image"] != blocks[b]["design_image"] or blk["test_images"] != blocks[b]["test_images"]:
            raise SystemExit(f"block {b}: the JSON holds other images; pass --restart")
        for m in methods:
            if m not in blk["methods"]:
                t0 = time.perf_counter()
                ck = os.path.join(ck_dir, f"block{b}_{m.replace('/', '-')}.pt")
                out = run_design(meas_of(blk["design_image"]), start, steps, m, tau, args.seed * 1009 + b,
                                 args.progress, design_engine, checkpoint=ck)
                out["seconds_total"] = time.perf_counter() - t0 + out.pop("seconds_earlier", 0.0)
                out["threads"] = torch.get_num_threads()
                out["quiet"] = not args.shared_cpu
                blk["methods"][m] = out
                state.save()
                if os.path.exists(ck):
                    os.remove(ck)
                print(f"block {b} {m}: added {blk['methods'][m]['added']}", flush=True)
            if args.no_eval:
                continue
            designs = [start + blk["methods"][m]["added"][:t] for t in eval_steps]
            for image in blk["test_images"]:
                key = f"{m}|{image}"
                if key not in blk["errors"]:
                    blk["errors"][key] = evaluate(state, meas_of, image, designs, tau, not args.shared_cpu)
                    state.save()
            # the design image itself (not in the test means): how much of a design's gain survives the transfer
            key = f"{m}|{blk['design_image']}"
            if key not in blk.setdefault("design_errors", {}):
                blk["design_errors"][key] = evaluate(state, meas_of, blk["design_image"], designs, tau,
                                                     not args.shared_cpu)
                state.save()
        if not args.no_eval and b == 0:  # residual images of the design image (Figure 3 analogue)
            res_path = os.path.join(results_dir(), name + "_residuals.npz")
            arrays = dict(np.load(res_path)) if os.path.exists(res_path) else {}
            mm, added = meas_of(blk["design_image"]), False
            for m in cfg["residual_methods"]:
                if m not in blk["methods"] or all(f"{m}|{t}" in arrays for t in cfg["residual_steps"]):
                    continue
                u0, init = None, None
                for t in cfg["residual_steps"]:
                    u0 = mm.map(start + blk["methods"][m]["added"][:t], tau, u0, init)
                    init = getattr(mm, "last_state", None)
                    arrays[f"{m}|{t}"] = (u0 - mm.u).reshape(size, size).numpy()
                added = True
            if added:
                np.savez_compressed(res_path, **arrays)
    state.doc["eval_steps"] = eval_steps
    state.doc["columns_at_eval"] = columns_at(settings, eval_steps)
    state.doc.setdefault("seconds_sessions", []).append(time.perf_counter() - t_all)
    state.save()
    report(state.doc, name, pool)


# ----------------------------------------------------------------------------- report
def evaluation_steps(settings):
    """Design steps at which the test errors are computed: every ``eval_every``-th and the last."""
    steps = settings["steps"]
    return sorted(set(list(range(0, steps + 1, settings["eval_every"])) + [steps]))


def columns_at(settings, eval_steps):
    """Known k-space columns of a design after each of ``eval_steps`` steps (conjugate pairs counted as placed)."""
    size = settings["size"]
    start = lowpass_pairs(size, settings["central"])
    return [known_columns(start + list(range(start[-1] + 1, start[-1] + 1 + t)), size) for t in eval_steps]


def summarise(doc):
    """Mean test-error ratios per method and evaluation step (over test images and blocks)."""
    steps = doc.get("eval_steps") or evaluation_steps(doc["settings"])
    out = {}
    for blk in doc["blocks"].values():
        low = {img: e for key, e in blk["errors"].items() for m, img in [key.split("|")] if m == "lowpass"}
        for key, errs in blk["errors"].items():
            m, img = key.split("|")
            if img not in low:
                continue
            r = out.setdefault(m, dict(vs_lowpass=[], vs_start=[]))
            r["vs_lowpass"].append(np.array(errs) / np.array(low[img]))
            r["vs_start"].append(np.array(errs) / errs[0])
    return {m: dict(vs_lowpass=np.mean(v["vs_lowpass"], 0).tolist(), vs_start=np.mean(v["vs_start"], 0).tolist(),
                    count=len(v["vs_lowpass"])) for m, v in out.items()}, steps


def column_snr(doc, pool=None):
    """Per image of the pool (``pool``, as :func:`load_pool` gives it, loaded if ``None``): ``||u||`` and, per
    conjugate pair of k-space columns, the image's energy in a column over the energy of the noise its
    measurement adds there (``sigma^2`` on the real and on the imaginary part of each of its ``H``
    coefficients: ``2 H sigma^2``): the mean over the (at most 40) pairs just above the start design (the band
    the designs choose from first) and the number of pairs above 1. Rows ``{image, norm, snr_next_40,
    pairs_above_noise}``."""
    size = doc["settings"]["size"]
    lo = doc["settings"]["central"] // 2 + 1
    rows = []
    for name, (img, _) in sorted((pool or load_pool(size)).items()):
        energy = (np.abs(np.fft.fft2(img, norm="ortho")) ** 2).sum(0)[: size // 2 + 1]
        snr = energy / (2 * size * doc["settings"]["noise_var"])
        rows.append(dict(image=name, norm=float(np.linalg.norm(img)), snr_next_40=float(snr[lo:lo + 40].mean()),
                         pairs_above_noise=int((snr > 1).sum())))
    return rows


def summarise_design_images(doc):
    """Error ratios to low-pass on each block's own design image (not a test image), mean over blocks."""
    out = {}
    for blk in doc["blocks"].values():
        de = blk.get("design_errors", {})
        low = de.get(f"lowpass|{blk['design_image']}")
        if low is None:
            continue
        for key, errs in de.items():
            out.setdefault(key.split("|")[0], []).append(np.array(errs) / np.array(low))
    return {m: dict(vs_lowpass=np.mean(v, 0).tolist(), count=len(v)) for m, v in out.items()}


def report(doc, name, pool=None):
    summ, steps = summarise(doc)
    cols = doc.get("columns_at_eval") or columns_at(doc["settings"], steps)
    if summ:
        rows = [dict(method=m, count=v["count"], **{f"c{c}": x for c, x in zip(cols, v["vs_lowpass"])})
                for m, v in summ.items()]
        print("\nMean test error ||u* - u|| / ||u_lowpass - u|| (same number of columns) by number of known columns:\n")
        print(markdown_table(rows, floatfmt=".4f"))
        rows = [dict(method=m, **{f"c{c}": x for c, x in zip(cols, v["vs_start"])}) for m, v in summ.items()]
        print("\nMean test error relative to the central-32 start design:\n")
        print(markdown_table(rows, floatfmt=".4f"))
    own = summarise_design_images(doc)
    if own:
        rows = [dict(method=m, blocks=v["count"], **{f"c{c}": x for c, x in zip(cols, v["vs_lowpass"])})
                for m, v in own.items()]
        print("\nOn the design images themselves (not test images): error relative to low-pass, mean over blocks:\n")
        print(markdown_table(rows, floatfmt=".4f"))
    print("\nSignal against measurement noise per k-space column pair (image energy / noise energy of a measurement; "
          "snr_next_40: mean over the (at most) 40 pairs after the start design):\n")
    print(markdown_table(column_snr(doc, pool), floatfmt=".2f"))
    trows = []
    for b, blk in doc["blocks"].items():
        for m, r in blk["methods"].items():
            if "seconds_inference" in r:
                inf = r["seconds_inference"]
                trows.append(dict(block=b, method=m, threads=r.get("threads", 2), quiet=r.get("quiet", True),
                                  steps=len(r["added"]), cold_fit_s=inf[0],
                                  inference_s_per_step=float(np.mean(inf[1:])) if len(inf) > 1 else float("nan"),
                                  scoring_s_per_step=float(np.mean(r["seconds_scoring"])),
                                  newton_per_step=float(np.mean(r["newton_steps"][1:] or [math.nan])),
                                  cg_per_step=float(np.mean(r["cg_iterations"][1:] or [math.nan])),
                                  total_s=r["seconds_total"]))
    stats = doc.get("map_stats", [])
    if stats:
        mrows = []
        for solver, quiet in sorted({(s["solver"], s.get("quiet", True)) for s in stats}):
            ss = [s for s in stats if s["solver"] == solver and s.get("quiet", True) == quiet]
            row = dict(solver=solver, quiet=quiet, solves=len(ss),
                       seconds_per_solve=float(np.mean([s["seconds"] for s in ss])),
                       not_converged=sum(not s["converged"] for s in ss))
            for k in ("iterations", "products", "newton_steps", "cg_iterations"):
                if k in ss[0]:
                    row[k + "_per_solve"] = float(np.mean([s[k] for s in ss]))
            mrows.append(row)
        print("\nMAP reconstructions of the test errors (warm-started along each design):\n")
        print(markdown_table(mrows, floatfmt=".4g"))
    if trows:
        print("\nDesign runs: cold fit of the start design, then per step: inference (warm double loop), scoring "
              "(FFT scores), Newton steps, CG iterations:\n")
        print(markdown_table(trows, floatfmt=".3g"))
    if summ:
        figures(doc, name, summ, cols)


def figures(doc, name, summ, cols):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 1, figsize=(7, 8), sharex=True)
    rnd = [m for m in summ if m.startswith("random")]
    for a, prefix, title in ((ax[0], "K", "K-Lanczos (K_var/K_score)"), (ax[1], "PCA", "L-PCA (L, 6L Lanczos steps)")):
        for m, v in summ.items():
            if m.startswith(prefix):
                a.plot(cols, v["vs_lowpass"], "o-", ms=3, label=m)
        if rnd:
            a.plot(cols, np.mean([summ[m]["vs_lowpass"] for m in rnd], 0), "s--", color="grey",
                   label=f"random (mean of {len(rnd)})")
        a.axhline(1.0, color="k", lw=0.8, ls=":", label="low-pass")
        a.set_ylabel("test error / low-pass error")
        a.set_title(title)
        a.legend(fontsize=8)
    ax[1].set_xlabel("known k-space columns")
    done = sorted((b for b, blk in doc["blocks"].items()
                   if any(k.startswith("lowpass|") for k in blk.get("errors", {}))), key=int)
    fig.suptitle(f"mean over {len(done)} of {doc['settings']['blocks']} blocks (blocks {', '.join(done)}), "
                 f"{doc['settings']['tests']} test images each", fontsize=9)
    save_figure(fig, name + "_errors")
    own = summarise_design_images(doc)
    if own:
        fig, a = plt.subplots(1, 1, figsize=(7, 4.5))
        for m, v in own.items():
            if not m.startswith(("random", "lowpass")):
                a.plot(cols, v["vs_lowpass"], "o-", ms=3, label=m)
        rnd = [m for m in own if m.startswith("random")]
        if rnd:
            a.plot(cols, np.mean([own[m]["vs_lowpass"] for m in rnd], 0), "s--", color="grey",
                   label=f"random (mean of {len(rnd)})")
        a.axhline(1.0, color="k", lw=0.8, ls=":", label="low-pass")
        a.set_xlabel("known k-space columns")
        a.set_ylabel("error / low-pass error")
        a.set_title(f"on the design images themselves (mean over {max(v['count'] for v in own.values())} blocks)",
                    fontsize=9)
        a.legend(fontsize=8, ncol=2)
        save_figure(fig, name + "_design_images")
    res_path = os.path.join(results_dir(), name + "_residuals.npz")
    if os.path.exists(res_path):
        arr = np.load(res_path)
        keys = list(arr.keys())
        ms = list(dict.fromkeys(k.split("|")[0] for k in keys))
        ts = list(dict.fromkeys(int(k.split("|")[1]) for k in keys))
        size = arr[keys[0]].shape[0]
        start = doc["blocks"]["0"]["start"]
        vmax = max(float(np.abs(arr[k]).max()) for k in keys)
        fig, ax = plt.subplots(len(ms), len(ts), figsize=(2.2 * len(ts), 2.3 * len(ms)), squeeze=False)
        for i, m in enumerate(ms):
            for j, t in enumerate(ts):
                a = ax[i, j]
                if f"{m}|{t}" in arr:
                    a.imshow(np.abs(arr[f"{m}|{t}"]), cmap="gray_r", vmin=0, vmax=0.5 * vmax)
                a.set_xticks([])
                a.set_yticks([])
                added = doc["blocks"]["0"]["methods"][m]["added"][:t]
                a.set_title(f"{m}, {known_columns(start + added, size)} cols", fontsize=8)
        save_figure(fig, name + "_residuals")


if __name__ == "__main__":
    main()
