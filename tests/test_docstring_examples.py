"""Every docstring example of the package runs as written (``doctest``), module by module."""
import doctest
import importlib
import pkgutil
import warnings

import pyro
import pyro.util
import pytest

import pyro_convexvb
from pyro_convexvb.infer import registry

MODULES = sorted(m.name for m in pkgutil.walk_packages(pyro_convexvb.__path__, "pyro_convexvb.")
                 if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_the_modules_docstring_examples_run(name):
    try:
        mod = importlib.import_module(name)
    except ImportError as e:  # an optional dependency (an extra) is missing
        pytest.skip(str(e))
    pyro_convexvb.engines()  # the built-in engines loaded, then kept
    engines = dict(registry._ENGINES)  # an example registers an engine, seeds the RNGs and fills the param store:
    rng = pyro.util.get_rng_state()  # the tests that run after it in this process see none of that
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # examples may show a fit that warns; the text says so where it matters
            out = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    finally:
        registry._ENGINES.clear()
        registry._ENGINES.update(engines)
        pyro.util.set_rng_state(rng)
        pyro.clear_param_store()
    assert out.failed == 0, f"{out.failed} of {out.attempted} example lines of {name} failed"


def test_the_user_facing_names_have_examples():
    """The names a user meets first (the package's top level, the estimators, the diagnostics) show an example."""
    import inspect

    from pyro_convexvb import diagnostics, online

    missing = []
    for mod in (pyro_convexvb, diagnostics, online):
        for n in getattr(mod, "__all__", [n for n in dir(mod) if not n.startswith("_")]):
            obj = getattr(mod, n)
            ours = getattr(obj, "__module__", "").startswith("pyro_convexvb")
            if ours and (inspect.isfunction(obj) or inspect.isclass(obj)) and not issubclass(
                    obj if inspect.isclass(obj) else object, (Warning, Exception)):
                if ">>>" not in (inspect.getdoc(obj) or ""):
                    missing.append(f"{mod.__name__}.{n}")
    assert missing == []
