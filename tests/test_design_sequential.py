"""Sequential phase-encode design (Seeger 2010 §5): FFT scores against dense log-determinants with the exact
covariance, the K_var / K_score split, conjugate pairs, reproducibility from a seed."""
import math

import pytest
import torch

from pyro_convexvb.design.imaging import (
    compressive_sensing_model,
    covariance_factor,
    fourier_columns_operator,
    phase_encode_scores,
)
from pyro_convexvb.design.sequential import (
    PER_STEP_FIELDS,
    DesignHistory,
    SequentialPhaseEncodeDesign,
    known_columns,
    lowpass_pairs,
    pair_candidates,
)
from pyro_convexvb.infer.convex_relaxation import ConvexVariationalRelaxation, site_designs
from pyro_convexvb.linalg.lanczos import lanczos

D = torch.float64
# the fits below stop at their outer budget on purpose
pytestmark = pytest.mark.filterwarnings("ignore:engine .convex_relaxation. did not converge")
H = 8
SIG2 = 1e-3


def _image(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(0, 1, H, dtype=D)
    img = 0.5 + 0.3 * torch.outer(torch.sin(3 * x), torch.cos(2 * x)) + 0.05 * torch.randn(H, H, generator=g, dtype=D)
    return img.reshape(-1)


def _measure(u, seed=1):
    cand = pair_candidates(H)
    X = fourier_columns_operator(H, H, cand)
    g = torch.Generator().manual_seed(seed)
    y = X.mv(u) + math.sqrt(SIG2) * torch.randn(X.shape[0], generator=g, dtype=D)
    m = len(cand)

    def measure(pairs):
        return torch.cat([y[c * H:(c + 1) * H] for c in pairs] + [y[H * m + c * H:H * m + (c + 1) * H] for c in pairs])

    return measure


def _dense_precision(lgm, gamma, pairs):
    """A = X^T X / sigma^2 + B^T diag(1/gamma) B, formed densely from the operators (sigma^2 = 1 convention)."""
    eye = torch.eye(lgm.n, dtype=D)
    X = fourier_columns_operator(H, H, pairs).mv(eye)
    B = site_designs(lgm).design.mv(eye)
    return X.T @ X / SIG2 + B.T @ torch.diag(1 / gamma) @ B


def _dense_scores(cov, cands):
    out = []
    for c in cands:
        Xc = fourier_columns_operator(H, H, [c]).mv(torch.eye(H * H, dtype=D))
        out.append(torch.logdet(torch.eye(2 * H, dtype=D) + Xc @ cov @ Xc.T / SIG2))
    return torch.stack(out)


def test_pairs_and_column_counts():
    assert pair_candidates(8) == [0, 1, 2, 3, 4]
    assert known_columns([0], 8) == 1 and known_columns([4], 8) == 1 and known_columns([1, 3], 8) == 4
    assert lowpass_pairs(256) == list(range(17)) and known_columns(lowpass_pairs(256), 256) == 33
    # 33 start columns + 39 pairs of 2 = 111 >= 110 (Seeger 2010 §5 grows to 110)
    assert known_columns(lowpass_pairs(256) + list(range(17, 56)), 256) == 111
    with pytest.raises(ValueError, match="pairs"):
        known_columns([5], 8)
    with pytest.raises(ValueError, match="central"):
        lowpass_pairs(8, 0)


def test_mirror_column_has_the_same_score_and_chunking_does_not_matter():
    n = H * H
    g = torch.Generator().manual_seed(2)
    G = torch.randn(n, n, generator=g, dtype=D)
    F = torch.linalg.cholesky(G @ G.T / n + 0.05 * torch.eye(n, dtype=D))
    ref = _dense_scores(F @ F.T, range(H))
    for chunk in (1, 7, 64):
        got = phase_encode_scores(F, H, H, SIG2, chunk_size=chunk)
        assert torch.allclose(got, ref, rtol=1e-10, atol=1e-9)
    # column W - c is the conjugate of c (rows reversed): equal scores, exactly as the dense reference says
    assert torch.allclose(ref[1:H // 2], ref.flip(0)[:H // 2 - 1], rtol=1e-10)


def test_fft_scores_equal_dense_logdets_with_exact_covariance():
    u = _image()
    measure = _measure(u)
    start = [0, 1]
    lgm = compressive_sensing_model(measure(start), H, H, start, SIG2, 0.08, 0.16)
    res = ConvexVariationalRelaxation(lgm, variance="exact", max_outer=30, progress=False).run()
    cov = torch.linalg.inv(_dense_precision(lgm, res.state.gamma, start))
    cands = [2, 3, 4]
    ref = _dense_scores(cov, cands)
    got = phase_encode_scores(covariance_factor(res), H, H, SIG2, candidates=cands)
    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9)
    # K-Lanczos with K = n at the same gamma is exact
    gamma = res.state.gamma
    lz = ConvexVariationalRelaxation(lgm, variance="lanczos", lanczos_rank=H * H, max_outer=0, gamma_init=gamma,
                                     progress=False).run()
    assert torch.allclose(phase_encode_scores(covariance_factor(lz), H, H, SIG2, candidates=cands), ref, rtol=1e-6)


def test_k_score_truncation_equals_a_shorter_lanczos_run():
    u = _image(3)
    measure = _measure(u, 4)
    start = [0, 1]
    lgm = compressive_sensing_model(measure(start), H, H, start, SIG2, 0.08, 0.16)
    res = ConvexVariationalRelaxation(lgm, variance="lanczos", lanczos_rank=30, max_outer=2, seed=5,
                                      progress=False).run()
    gamma = res.state.gamma
    A = _dense_precision(lgm, gamma, start)
    lr = res.state.lanczos
    # an independent 12-step Lanczos run from the same start vector on the dense A
    short = lanczos(lambda v: A @ v, lr.Q[:, 0].clone(), 12)
    F_short = short.Q @ torch.linalg.inv(torch.linalg.cholesky(short.T())).T
    F12 = covariance_factor(res, score_steps=12)
    assert F12.shape == (H * H, 12)
    assert torch.allclose(F12 @ F12.T, F_short @ F_short.T, rtol=1e-7, atol=1e-9)
    cands = [2, 3, 4]
    ref = _dense_scores(F_short @ F_short.T, cands)
    d12 = phase_encode_scores(F12, H, H, SIG2, candidates=cands)
    assert torch.allclose(d12, ref, rtol=1e-7, atol=1e-9)
    # fewer Lanczos steps: every score a lower bound on the exact one (Seeger 2010 §4.3)
    exact = _dense_scores(torch.linalg.inv(A), cands)
    assert bool((d12 <= exact + 1e-9).all())
    with pytest.raises(ValueError, match="score_steps"):
        covariance_factor(res, score_steps=0)


def test_design_loop_scores_are_the_dense_ones_and_reproducible():
    u = _image(5)
    measure = _measure(u, 6)
    d = SequentialPhaseEncodeDesign(measure, H, H, SIG2, 0.08, 0.16, variance="exact", init_outer=3, refit_outer=2,
                                    progress=False)
    h = d.run([0], 3)
    assert len(h.added) == 3 and len(set(h.columns)) == 4 and set(h.columns) <= set(pair_candidates(H))
    assert len(h.seconds_inference) == len(h.seconds_scoring) == 3
    # step 0's scores equal dense log-determinants at the fit of the start design
    res, _ = d.fit([0])
    cov = torch.linalg.inv(_dense_precision(d.model([0]), res.state.gamma, [0]))
    cands = sorted(h.scores[0])
    ref = _dense_scores(cov, cands)
    assert torch.allclose(torch.tensor([h.scores[0][c] for c in cands], dtype=D), ref, rtol=1e-8, atol=1e-8)
    assert h.added[0] == cands[int(torch.argmax(ref))]
    # K-Lanczos designs are reproducible from the seed
    runs = [SequentialPhaseEncodeDesign(measure, H, H, SIG2, 0.08, 0.16, k_var=20, k_score=10, seed=s,
                                        progress=False).run([0], 3) for s in (7, 7)]
    assert runs[0].added == runs[1].added
    assert runs[0].best_scores == runs[1].best_scores


def test_a_resumed_design_makes_the_choices_of_an_uninterrupted_one():
    """The callback's history (with its state) is a checkpoint: continuing from step 2 of 4 repeats the refits, the
    seeded Lanczos runs and the choices of the uninterrupted run."""
    measure = _measure(_image(2), 3)

    def design():
        return SequentialPhaseEncodeDesign(measure, H, H, SIG2, 0.08, 0.16, k_var=20, k_score=10, seed=4,
                                           progress=False)

    saved = {}

    def keep(h):
        if len(h.added) == 2:
            saved["h"] = DesignHistory(start=list(h.start), state=h.state, settings=dict(h.settings),
                                       **{f: list(getattr(h, f)) for f in PER_STEP_FIELDS})

    full = design().run([0], 4, callback=keep)
    assert saved["h"].added == full.added[:2] and saved["h"].state is not None
    resumed = design().run([0], 4, resume=saved["h"])
    assert resumed.added == full.added
    assert resumed.best_scores[:2] == full.best_scores[:2]
    assert torch.allclose(torch.tensor(resumed.best_scores), torch.tensor(full.best_scores), rtol=1e-10, atol=0)
    assert resumed.scores[3] == pytest.approx(full.scores[3], rel=1e-10)
    assert torch.allclose(resumed.state.gamma, full.state.gamma, rtol=1e-10, atol=0)
    assert len(resumed.seconds_inference) == len(resumed.cg_iterations) == 4
    # a finished history resumes to itself; bad checkpoints are refused
    assert design().run([0], 2, resume=saved["h"]).added == full.added[:2]
    with pytest.raises(ValueError, match="start pairs"):
        design().run([0, 1], 3, resume=saved["h"])
    with pytest.raises(ValueError, match="num_steps"):
        design().run([0], 1, resume=saved["h"])
    other = SequentialPhaseEncodeDesign(measure, H, H, SIG2, 0.08, 0.16, k_var=20, k_score=10, seed=5,
                                        progress=False)
    with pytest.raises(ValueError, match=r"other design settings \(\['seed'\]\)"):
        other.run([0], 4, resume=saved["h"])
    bad = DesignHistory(start=[0], added=list(saved["h"].added), state=None, settings=saved["h"].settings,
                        **{f: list(getattr(saved["h"], f)) for f in PER_STEP_FIELDS if f != "added"})
    with pytest.raises(ValueError, match="no state"):
        design().run([0], 4, resume=bad)
    bad.state, bad.scores = saved["h"].state, bad.scores[:1]
    with pytest.raises(ValueError, match="unequal lengths"):
        design().run([0], 4, resume=bad)


def test_design_validation():
    m = _measure(_image())
    with pytest.raises(ValueError, match="variance"):
        SequentialPhaseEncodeDesign(m, H, H, SIG2, 0.08, 0.16, variance="dense")
    with pytest.raises(ValueError, match="k_score"):
        SequentialPhaseEncodeDesign(m, H, H, SIG2, 0.08, 0.16, k_var=10, k_score=20)
    with pytest.raises(ValueError, match="pca_rank"):
        SequentialPhaseEncodeDesign(m, H, H, SIG2, 0.08, 0.16, variance="pca")
    with pytest.raises(ValueError, match="engine_options"):
        SequentialPhaseEncodeDesign(m, H, H, SIG2, 0.08, 0.16, engine_options={"lanczos_rank": 5})
    with pytest.raises(ValueError, match="k_var"):  # accepted and unused with variance='exact'
        SequentialPhaseEncodeDesign(m, H, H, SIG2, 0.08, 0.16, variance="exact", k_var=5)
    with pytest.raises(ValueError, match="engine_options"):
        SequentialPhaseEncodeDesign(m, H, H, SIG2, 0.08, 0.16, engine_options={"init": None})
    assert SequentialPhaseEncodeDesign(m, H, H, SIG2, 0.08, 0.16).k_var == 200
    d = SequentialPhaseEncodeDesign(m, H, H, SIG2, 0.08, 0.16, variance="exact", progress=False)
    with pytest.raises(ValueError, match="num_steps"):
        d.run([0, 1], 10)
    with pytest.raises(ValueError, match="start: expected at least one"):
        d.run([], 1)
    with pytest.raises(ValueError, match="start: expected integer"):
        d.run([0, 1.5], 1)


def test_scales_and_k_score_are_checked_when_constructed():
    """noise_var / tau_a / tau_r were not checked by the constructor (a string tau failed at run() with Python's
    'could not convert string to float'), NumPy and 0-d torch scalars were refused at run(), and k_score > n was
    refused after the cold fit under the name score_steps."""
    import numpy as np

    def never(pairs):
        raise AssertionError("measure called: the check came after a fit")

    for kw, msg in ((dict(noise_var=-1.0), "noise_var: expected a positive finite number, got -1.0"),
                    (dict(tau_a=float("nan")), "tau_a: expected a positive finite number, got nan"),
                    (dict(tau_a="x"), "tau_a: expected a positive finite number, got 'x'"),
                    (dict(tau_r=True), "tau_r: expected a positive finite number, got True"),
                    (dict(tau_r=torch.zeros(2)), "tau_r: expected a positive finite number")):
        args = {**dict(noise_var=SIG2, tau_a=0.08, tau_r=0.16), **kw}
        with pytest.raises(ValueError, match=msg):
            SequentialPhaseEncodeDesign(never, H, H, **args, variance="exact")
    with pytest.raises(ValueError, match=r"k_score: a fit runs at most n = H W = 64 Lanczos steps, got 150"):
        SequentialPhaseEncodeDesign(never, H, H, SIG2, 0.08, 0.16, k_var=200, k_score=150)
    assert SequentialPhaseEncodeDesign(never, H, H, SIG2, 0.08, 0.16, k_var=200, k_score=64).k_score == 64
    # NumPy and one-element torch scalars are the numbers they hold
    m = _measure(_image(), 2)
    ref = SequentialPhaseEncodeDesign(m, H, H, SIG2, 0.08, 0.16, variance="exact", progress=False).run([0], 1)
    for nv, ta in ((np.float64(SIG2), np.float64(0.08)), (torch.tensor(SIG2, dtype=D), torch.tensor([0.08], dtype=D))):
        d = SequentialPhaseEncodeDesign(m, H, H, nv, ta, 0.16, variance="exact", progress=False)
        h = d.run([0], 1)
        assert h.added == ref.added and h.best_scores == pytest.approx(ref.best_scores, rel=1e-12)
        assert h.settings["noise_var"] == SIG2 and h.settings["tau_a"] == 0.08
    d32 = SequentialPhaseEncodeDesign(m, H, H, np.float32(SIG2), 0.08, 0.16, variance="exact", progress=False)
    assert d32.settings()["noise_var"] == float(np.float32(SIG2))
    y = m([0, 1])
    plain = compressive_sensing_model(y, H, H, [0, 1], SIG2, 0.08, 0.16)
    other = compressive_sensing_model(y, H, H, [0, 1], np.float64(SIG2), torch.tensor(0.08, dtype=D), np.float64(0.16))
    for g1, g2 in zip(plain.sites, other.sites):
        assert torch.equal(g1.family.params["scale"], g2.family.params["scale"])
