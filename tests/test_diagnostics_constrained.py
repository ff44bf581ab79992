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
