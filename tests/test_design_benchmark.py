"""The data side of benchmarks/compressive_sensing.py (Seeger 2010 §5 protocol): image pool, blocks, methods,
measurements and the MAP cache. No design runs here (those are the benchmark's)."""
import importlib.util
import math
import os

import numpy as np
import pytest
import torch

pytest.importorskip("skimage")
pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cs():
    spec = importlib.util.spec_from_file_location("compressive_sensing_bench",
                                                  os.path.join(ROOT, "benchmarks", "compressive_sensing.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_image_pool_is_offline_grey_and_recorded(cs):
    pool = cs.load_pool(16)
    assert len(pool) == 13
    for name, (img, rec) in pool.items():
        assert img.shape == (16, 16) and img.dtype == np.float64
        assert 0.0 <= img.min() and img.max() <= 1.0 and img.std() > 0
        side = min(rec["original_shape"][:2])
        assert rec["crop"]["side"] == side
        h, w = rec["original_shape"][:2]
        assert rec["crop"]["row"] == (h - side) // 2 and rec["crop"]["col"] == (w - side) // 2
    # camera.png is 512 x 512 grey: a 32 x 32 block average is close to the anti-aliased resize
    from skimage import io

    import skimage

    cam = io.imread(os.path.join(os.path.dirname(skimage.__file__), "data", "camera.png")) / 255.0
    block = cam.reshape(16, 32, 16, 32).mean((1, 3))
    assert np.abs(pool["camera"][0] - block).mean() < 0.05


def test_blocks_are_seeded_and_exclude_the_design_image(cs):
    names = [f"im{i}" for i in range(13)]
    b1, b2 = cs.make_blocks(names, 5, 5, 0), cs.make_blocks(names, 5, 5, 0)
    assert b1 == b2
    assert len({b["design_image"] for b in b1}) == 5
    for b in b1:
        assert len(set(b["test_images"])) == 5 and b["design_image"] not in b["test_images"]
    assert cs.make_blocks(names, 5, 5, 1) != b1


def test_methods_and_measurements(cs):
    assert cs.parse_method("K500/200") == dict(kind="lanczos", k_var=500, k_score=200)
    assert cs.parse_method("PCA33") == dict(kind="pca", pca_rank=33)
    assert cs.parse_method("random-2") == dict(kind="random", seed=2)
    with pytest.raises(ValueError, match="methods"):
        cs.parse_method("K200")
    g = torch.Generator().manual_seed(0)
    img = torch.rand(8, 8, generator=g, dtype=torch.float64).numpy()
    m = cs.Measurements(img, seed=3)
    # measurements of a pair set are the operator's rows plus one fixed noise draw
    from pyro_convexvb.design.imaging import fourier_columns_operator

    pairs = [0, 3, 1]
    noise = m(pairs) - fourier_columns_operator(8, 8, pairs).mv(m.u)
    assert abs(float(noise.std()) - math.sqrt(cs.NOISE_VAR)) < 0.5 * math.sqrt(cs.NOISE_VAR)
    assert torch.equal(m([3])[:8], m(pairs)[8:16])
    # low-pass and random designs are the documented orders
    assert cs.run_design(m, [0, 1], 2, "lowpass", (0.08, 0.16), 0, False)["added"] == [2, 3]
    r = [cs.run_design(m, [0, 1], 3, "random-1", (0.08, 0.16), 0, False)["added"] for _ in range(2)]
    assert r[0] == r[1] and len(set(r[0])) == 3 and not set(r[0]) & {0, 1}


def test_map_solvers_of_the_measurements(cs):
    """``--map-solver``: ADMM (the exact MAP) and the Newton path record their work; warm starts give the same MAP."""
    g = torch.Generator().manual_seed(1)
    img = torch.rand(8, 8, generator=g, dtype=torch.float64).numpy()
    with pytest.raises(ValueError, match="solver"):
        cs.Measurements(img, seed=3, solver="lbfgs")
    m = cs.Measurements(img, seed=3, solver="admm")
    u1 = m.map([0, 1, 2], (0.08, 0.16))
    u2 = m.map([0, 1, 2, 4], (0.08, 0.16), u1, m.last_state)
    u2c = m.map([0, 1, 2, 4], (0.08, 0.16))
    assert [s["solver"] for s in m.stats] == ["admm"] * 3 and all(s["converged"] for s in m.stats)
    assert m.stats[1]["iterations"] < m.stats[2]["iterations"]
    assert float(torch.linalg.vector_norm(u2 - u2c)) <= 1e-4 * float(torch.linalg.vector_norm(u2c))
    n = cs.Measurements(img, seed=3, solver="newton")
    n.map([0, 1, 2], (0.08, 0.16))
    assert n.stats[0]["solver"] == "newton" and n.stats[0]["cg_iterations"] > 0


def test_an_interrupted_design_run_continues_from_its_checkpoint(cs, tmp_path, monkeypatch):
    """A design run killed after a step continues from the checkpoint file with the choices of an uninterrupted
    run; the checkpoint records where it resumed and refuses another design's settings."""
    g = torch.Generator().manual_seed(2)
    img = torch.rand(8, 8, generator=g, dtype=torch.float64).numpy()
    m = cs.Measurements(img, seed=3)
    opts = dict(max_newton=4, cg_tol=1e-6)
    whole = cs.run_design(m, [0], 3, "K20/10", (0.08, 0.16), 5, False, opts)
    assert "resumed_at" not in whole
    path = str(tmp_path / "ck" / "block0_K20-10.pt")
    original = cs.save_checkpoint

    def killed_after_one_step(path_, key, hist, seconds, resumed_at):
        original(path_, key, hist, seconds, resumed_at)
        if len(hist.added) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(cs, "save_checkpoint", killed_after_one_step)
    with pytest.raises(KeyboardInterrupt):
        cs.run_design(m, [0], 3, "K20/10", (0.08, 0.16), 5, False, opts, checkpoint=path)
    monkeypatch.setattr(cs, "save_checkpoint", original)
    assert os.path.exists(path)
    with pytest.raises(SystemExit, match="another design"):
        cs.run_design(m, [0], 3, "K20/10", (0.08, 0.16), 6, False, opts, checkpoint=path)
    again = cs.run_design(m, [0], 3, "K20/10", (0.08, 0.16), 5, False, opts, checkpoint=path)
    assert again["added"] == whole["added"]
    assert again["best_scores"] == pytest.approx(whole["best_scores"], rel=1e-10)
    assert again["resumed_at"] == [1] and again["seconds_earlier"] > 0
    assert len(again["cg_iterations"]) == 3


def test_shared_results_merge_and_the_design_image_table(cs):
    """Two runs sharing the JSON: a save keeps the other's design runs, test errors and design-image errors; the
    design-image ratios to low-pass are averaged over blocks and kept out of the test means."""
    mine = dict(tau=None, blocks={"0": dict(design_image="a", test_images=["b"], methods={"K": {}},
                                            errors={"K|b": [1.0, 0.9], "lowpass|b": [1.0, 1.0]},
                                            design_errors={"lowpass|a": [1.0, 0.5]})}, map_errors={})
    theirs = dict(tau=dict(tau_a=0.08), blocks={
        "0": dict(design_image="a", test_images=["b"], methods={"lowpass": {}}, errors={},
                  design_errors={"K|a": [1.0, 0.4]}),
        "1": dict(design_image="c", test_images=["b"], methods={}, errors={},
                  design_errors={"K|c": [1.0, 0.3], "lowpass|c": [1.0, 0.6]})}, map_errors={"x": 1.0})
    cs.merge_missing(mine, theirs)
    assert set(mine["blocks"]) == {"0", "1"} and set(mine["blocks"]["0"]["methods"]) == {"K", "lowpass"}
    assert mine["blocks"]["0"]["design_errors"] == {"lowpass|a": [1.0, 0.5], "K|a": [1.0, 0.4]}
    assert mine["tau"] == dict(tau_a=0.08) and mine["map_errors"] == {"x": 1.0}
    own = cs.summarise_design_images(mine)
    assert own["K"]["count"] == 2 and own["K"]["vs_lowpass"] == pytest.approx([1.0, (0.8 + 0.5) / 2])
    mine["settings"], mine["eval_steps"] = {}, [0, 1]
    summ, _ = cs.summarise(mine)
    assert summ["K"]["vs_lowpass"] == pytest.approx([1.0, 0.9]) and summ["K"]["count"] == 1


def test_column_energy_table_against_a_closed_form(cs):
    """A cosine along the rows of frequency 5 has all its energy, ``||u||^2`` minus the mean's, in the column pair
    5 of the 2-D DFT: its ratio to the noise energy ``2 H sigma^2`` of a measured column is known in closed form."""
    H = 16
    j = np.arange(H)
    img = 0.5 + 0.25 * np.cos(2 * np.pi * 5 * j / H)[None, :].repeat(H, 0)
    settings = dict(size=H, central=4, noise_var=1e-3)
    (row,) = cs.column_snr(dict(settings=settings), {"wave": (img, {})})
    # energy of the cosine: H^2 * 0.25^2 / 2, split equally between columns 5 and H - 5; pair 5 counts column 5
    snr5 = (H * H * 0.25**2 / 4) / (2 * H * 1e-3)
    assert row["norm"] == pytest.approx(float(np.linalg.norm(img)), rel=1e-12)
    # pairs 0 (the mean: H^2 * 0.25 / (2 H sigma^2)) and 5 are above the noise, the others carry nothing
    assert row["pairs_above_noise"] == 2
    assert row["snr_next_40"] == pytest.approx(snr5 / 6, rel=1e-10)  # the pairs after the start: 3 .. 8


def test_report_prints_every_table(cs, tmp_path, monkeypatch, capsys):
    """The report prints the test-error tables (to low-pass and to the start design) whether or not design-image
    errors exist, the design-image table when they do, and the column-energy table."""
    monkeypatch.setenv("PYRO_CONVEXVB_FIGURES_DIR", str(tmp_path))
    monkeypatch.setenv("PYRO_CONVEXVB_RESULTS_DIR", str(tmp_path))
    settings = dict(size=16, central=4, steps=2, eval_every=1, blocks=1, tests=1, noise_var=1e-3)
    blk = dict(design_image="a", test_images=["b"], start=[0, 1, 2], methods={"K": {}, "lowpass": {}},
               errors={"K|b": [1.0, 0.9, 0.8], "lowpass|b": [1.0, 1.0, 1.0]})
    doc = dict(settings=settings, blocks={"0": blk}, map_errors={})
    pool = {"a": (np.full((16, 16), 0.5), {})}
    cs.report(doc, "t", pool)
    out = capsys.readouterr().out
    assert "relative to the central-32 start design" in out and "design images themselves" not in out
    assert "Signal against measurement noise" in out
    blk["design_errors"] = {"K|a": [1.0, 0.5, 0.5], "lowpass|a": [1.0, 1.0, 1.0]}
    cs.report(doc, "t", pool)
    out = capsys.readouterr().out
    assert "relative to the central-32 start design" in out and "design images themselves" in out
