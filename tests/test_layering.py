"""The layering checks of docs/architecture.md ("How to check the layering") hold, and find what they look for."""
import importlib.util
import pathlib
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("layering", ROOT / ".ci" / "layering.py")
layering = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layering)


def test_the_package_passes_every_check(capsys):
    assert layering.main(str(ROOT / "pyro_convexvb")) == 0, capsys.readouterr().out


def _package(tmp_path, files):
    root = tmp_path / "pyro_convexvb"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return layering.modules(root)


def test_each_check_finds_its_violation(tmp_path):
    mods = _package(tmp_path, {
        "__init__.py": "",
        "io.py": "def save(r):\n    return r.info.get('dropped')\n",
        "cli.py": "def demo(names):\n    if 'nuts' in names:\n        return 1\n",
        "a.py": "from . import b\n",
        "b.py": "from . import a\n",
        "lgm/__init__.py": "",
        "lgm/model.py": "def f():\n    from ..infer.engine import Engine\n",
        "infer/__init__.py": "",
        "infer/engine.py": "def g(engine):\n    return engine._secret()\n",
        "infer/registry.py": "def h(name):\n    return name == 'dual_vg'\n",
    })
    assert layering.cycles(mods) == [["pyro_convexvb.a", "pyro_convexvb.b"]]
    assert [f.split(": ", 1)[1] for f in layering.floors(mods)] == ["pyro_convexvb.lgm.model imports "
                                                                    "pyro_convexvb.infer.engine"]
    assert [f.split(": ", 1)[1] for f in layering.info_reads(mods)] == ["r.info.get('dropped')"]
    assert [f.split(": ", 1)[1] for f in layering.private_reads(mods)] == ["engine._secret"]
    assert [f.split(": ", 1)[1] for f in layering.name_branches(mods)] == ["'nuts' in names"]  # not the registry's
