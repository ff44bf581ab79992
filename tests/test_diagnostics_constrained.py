"""A posterior over a linearly constrained field (an intrinsic GMRF with a sum-to-zero constraint) has a singular
covariance; the proposals of the importance diagnostics need a density on the whole space, so
``res.diagnostics`` and ``correct="psis"`` refuse such a result with the constrained site named, rather than
failing inside a Cholesky factorisation."""
import warnings

import pytest

import pyro_convexvb as pcv
from tests.zoo.models import ZOO


def test_diagnostics_of_a_constrained_field_name_the_site_and_say_why():
    model, args, kwargs = ZOO["bym_icar"].builder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pcv.fit(model, *args, engine="dual_vg", progress=False, **kwargs)
    for access in (lambda: res.diagnostics, lambda: res.corrected(200)):
        with pytest.raises(NotImplementedError, match=r"singular in 1 direction\(s\) \(sites 's'\).*sum-to-zero"):
            access()
    assert res.posterior.loc.isfinite().all()  # the engine's answer stands


def test_a_covariance_singular_up_to_rounding_is_refused_too():
    """An RW1 trend with its sum-to-zero constraint: the Cholesky factorisation of its covariance can succeed by
    rounding, with a pivot at rounding level; the diagnostics refuse it as well (their density would be noise)."""
    model, args, kwargs = ZOO["rw1_intrinsic"].builder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pcv.fit(model, *args, engine="dual_vg", progress=False, **kwargs)
    with pytest.raises(NotImplementedError, match=r"singular in 1 direction\(s\)"):
        res.diagnostics
