"""Every zoo model through every registered engine, against its reference posterior.

A cell (model, engine) either fits, and its posterior mean and sd must be within the engine's tolerance of
the reference (``harness.TOLERANCES``), or refuses with an :class:`~pyro_convexvb.UnsupportedModelError`
that names a site of the model and lists exactly the other engines that ``pcv.engines_that_fit`` lists
(each of which runs in its own cell). Known misses are ``xfail(strict=True)`` with their measured numbers
(``harness.KNOWN_MISSES``); cells too slow for CI are marked ``slow`` (``harness.is_slow``).

Regenerate the references with ``python tests/zoo/generate_references.py`` and the supported-models page
with ``python tests/zoo/make_table.py``.
"""
import math
import pathlib

import pyro.poutine as poutine
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.lgm.extract import full_data_plates

from .harness import (
    EXACT_TOLERANCE,
    KNOWN_LISTING,
    KNOWN_MISSES,
    data_fingerprint,
    is_slow,
    load_references,
    run_cell,
)
from .models import ZOO

ENGINES = sorted(pcv.engines())
PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "supported_models.md"

_CELLS = {}


@pytest.fixture(scope="module")
def refs():
    return load_references()


def _cell(model, engine, refs):
    if (model, engine) not in _CELLS:
        _CELLS[(model, engine)] = run_cell(model, engine, refs)
    return _CELLS[(model, engine)]


def _params():
    for m in ZOO:
        for e in ENGINES:
            marks = []
            if (m, e) in KNOWN_MISSES:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[(m, e)]))
            if is_slow(m, e):
                marks.append(pytest.mark.slow)
            yield pytest.param(m, e, marks=marks, id=f"{m}-{e}")


def _site_names(model, args, kwargs):
    with torch.no_grad(), full_data_plates():
        tr = poutine.trace(model).get_trace(*args, **kwargs)
    return {n for n, s in tr.nodes.items() if s["type"] == "sample"} | {"<model>"}


def _listed_in(message):
    if message.endswith("no registered engine fits this model"):
        return []
    tail = message.split("engines that fit this model: ")[-1]
    return [s.strip() for s in tail.split(",")]


@pytest.mark.parametrize("model_name, engine", list(_params()))
def test_engine_on_zoo_model(model_name, engine, refs):
    c = _cell(model_name, engine, refs)
    if c.status == "refused":
        err = c.error
        model, args, kwargs = ZOO[model_name].builder()
        assert err.site in _site_names(model, args, kwargs), (err.site, str(err))
        assert f"engine '{engine}' does not apply" in str(err)
        assert not c.listed, f"pcv.engines_that_fit lists '{engine}', which refuses: {err}"
        # the refusal lists every other engine that pcv.engines_that_fit lists (each runs in its own cell) ...
        listed = _listed_in(str(err))
        assert [e for e in c.fitting if e != engine and e not in listed] == [], str(err)
        # ... and any engine it lists beyond those does run on the model
        for e in listed:
            if e not in c.fitting:
                assert _cell(model_name, e, refs).status == "fit", (e, str(err))
        return
    assert c.status == "fit", f"engine '{engine}' failed on '{model_name}': {type(c.error).__name__}: {c.error}"
    t = c.tol
    assert math.isfinite(c.mean_err), c.details
    assert c.mean_err <= t.mean, (f"max |mean - ref| / ref sd = {c.mean_err:.3g} at {c.worst} > {t.mean}", c.details)
    if t.sd is not None:
        assert c.sd_err <= t.sd, (f"max |sd / ref sd - 1| = {c.sd_err:.3g} > {t.sd}", c.details)


def _listing_params():
    for m in ZOO:
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_LISTING[m])] if m in KNOWN_LISTING else []
        yield pytest.param(m, marks=marks, id=m)


@pytest.mark.parametrize("model_name", list(_listing_params()))
def test_engines_that_fit_lists_the_engines_that_run(model_name, refs):
    """``pcv.engines_that_fit`` names exactly the engines that run on the model (the refusals are cheap; the
    engines it does not list must refuse)."""
    model, args, kwargs = ZOO[model_name].builder()
    fitting = pcv.engines_that_fit(model, *args, **kwargs)
    for e in ENGINES:
        if e in fitting:
            continue
        c = _cell(model_name, e, refs)
        assert c.status == "refused", (f"pcv.engines_that_fit does not list '{e}', which "
                                       + ("runs" if c.status == "fit" else f"raises {type(c.error).__name__}"))


def test_exact_references_are_reproduced(refs):
    """The stored closed-form references are what the closed forms give for the builders' data."""
    for name, zm in ZOO.items():
        if zm.reference != "exact":
            continue
        model, args, kwargs = zm.builder()
        got = zm.reference_fn(args, kwargs)
        for site, v in refs[name]["sites"].items():
            torch.testing.assert_close(torch.tensor(got[site]["mean"]), torch.tensor(v["mean"]), rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(torch.tensor(got[site]["sd"]), torch.tensor(v["sd"]), rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_quadrature_references_are_reproduced(refs):
    for name, zm in ZOO.items():
        if zm.reference != "quadrature":
            continue
        model, args, kwargs = zm.builder()
        got = zm.reference_fn(args, kwargs)
        for site, v in refs[name]["sites"].items():
            torch.testing.assert_close(torch.tensor(got[site]["mean"]), torch.tensor(v["mean"]), rtol=1e-9, atol=1e-12)


def test_references_match_the_builders_data(refs):
    """Every model has a reference made from the data its builder draws now; NUTS references converged."""
    assert set(refs) == set(ZOO)
    for name, zm in ZOO.items():
        model, args, kwargs = zm.builder()
        ref = refs[name]
        assert ref["method"] == zm.reference, name
        assert ref["fingerprint"] == pytest.approx(data_fingerprint(args, kwargs), rel=1e-12), name
        if ref["method"] == "nuts":
            assert ref["chains"] == 4 and ref["max_split_rhat"] < 1.01 and ref["min_ess"] > 1000, name
        for site in zm.compare or ref["sites"]:
            assert all(s > 0 for s in ref["sites"][site]["sd"]), (name, site)


def test_zoo_covers_the_model_classes():
    assert len(ZOO) >= 25
    groups = {zm.group for zm in ZOO.values()}
    assert {"GLM", "linear", "sparse", "GP classification", "GMRF", "model structure", "hierarchical",
            "outside the class"} <= groups
    assert {zm.reference for zm in ZOO.values()} == {"exact", "quadrature", "nuts"}
    assert EXACT_TOLERANCE.mean < 1e-4


def test_supported_models_page_lists_every_model_and_engine():
    """``docs/supported_models.md`` (written by ``make_table.py``) has a row per zoo model and a column per engine."""
    text = PAGE.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| model |"))
    columns = [c.strip().strip("`") for c in header.strip("|").split("|")]
    assert columns[1:] == ENGINES, columns
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines()
            if line.startswith("| `")}
    assert set(ZOO) <= rows, set(ZOO) - rows
    index = (PAGE.parent / "index.md").read_text()
    assert "supported_models" in index
