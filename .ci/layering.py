"""Check the package's layering (docs/architecture.md, "How to check the layering"); exit status 1 if a check fails.

    python .ci/layering.py [pyro_convexvb]

Static (``ast``; nothing is imported). The checks:

* ``cycles``: no import cycle among the modules' import-time (module-level) imports (the cycles that function-level
  imports close are listed, not failed);
* ``floors``: ``lgm/``, ``linalg/`` and ``posterior/`` import nothing from ``infer/`` (at any level, lazy imports
  included), and ``infer/engine.py`` and ``infer/meta.py`` do not import the registry;
* ``info``: no module outside ``infer/`` reads a result's ``info`` by key (``x.info[...]``, ``x.info.get(...)``);
* ``private``: no module imports a private name (``_x``) of an engine's package from outside that package, and
  none reads a private attribute of an engine, result or state object (``engine._x``, ``result._x``,
  ``state._x``) that it does not define itself;
* ``names``: no comparison with a built-in engine's name (``== "dual_vg"``, ``in ("nuts", ...)``) outside
  ``infer/registry.py``.
"""
import ast
import pathlib
import sys

ENGINE_NAMES = {"convex_relaxation", "dual_vg", "diag_mixture", "svi_autonormal", "svi_automvn", "svi_lowrank",
                "laplace", "nuts"}
ENGINE_PACKAGES = ("infer.convex_relaxation", "infer.dual_vg", "infer.diag_mixture", "infer.pyro_engines")
PRIVATE_OWNERS = {"engine", "eng", "inner", "result", "res", "result_", "state"}


def modules(root):
    """``{dotted module name: (path, tree)}`` of every module under ``root``."""
    root = pathlib.Path(root)
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = (path, ast.parse(path.read_text()))
    return out


def _is_package(name, mods):
    return mods[name][0].name == "__init__.py"


def imports(name, tree, mods, top_level_only):
    """``[(line, imported module)]`` of module ``name`` (only modules of the package; ``from x import y`` counts as
    ``x.y`` when that is a module, else ``x``)."""
    pkg = name if _is_package(name, mods) else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        else:
            continue
        out += [(node.lineno, t) for t in targets if t in mods]
    return out


def cycles(mods, top_level_only=True):
    """Strongly connected components (more than one module) of the import graph: of the import-time imports, or
    with ``top_level_only=False`` of every import (function-level ones included). An import of the module's own
    package (``from .. import x`` inside that package) is not an edge: the package is initialising already when
    one of its modules runs."""
    graph = {m: {t for _, t in imports(m, tree, mods, top_level_only) if t != m and not m.startswith(t + ".")}
             for m, (_, tree) in mods.items()}
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return comps


def floors(mods):
    bad = []
    for name, (path, tree) in mods.items():
        low = name.split(".")[1:2] in (["lgm"], ["linalg"], ["posterior"])
        for line, t in imports(name, tree, mods, False):
            if low and t.split(".")[1:2] == ["infer"]:
                bad.append(f"{path}:{line}: {name} imports {t}")
            if name in ("pyro_convexvb.infer.engine", "pyro_convexvb.infer.meta") and \
                    t == "pyro_convexvb.infer.registry":
                bad.append(f"{path}:{line}: {name} imports the registry")
    return bad


def info_reads(mods):
    bad = []
    for name, (path, tree) in mods.items():
        if name.startswith("pyro_convexvb.infer"):
            continue
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Subscript):
                target = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                target = node.func.value
            if isinstance(target, ast.Attribute) and target.attr == "info":
                bad.append(f"{path}:{node.lineno}: {ast.unparse(node)[:80]}")
    return bad


def _own_names(tree):
    """Private names a module defines itself (functions, class attributes, attributes it assigns): its own to use."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute):
                        own.add(sub.attr)
                    elif isinstance(sub, ast.Name):
                        own.add(sub.id)
    return own


def private_reads(mods):
    bad = []
    for name, (path, tree) in mods.items():
        own = _own_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for line, t in imports(name, ast.Module(body=[node], type_ignores=[]), mods, True):
                    owner = next((p for p in ENGINE_PACKAGES if t.startswith(f"pyro_convexvb.{p}")), None)
                    if owner and not name.startswith(f"pyro_convexvb.{owner}"):
                        bad += [f"{path}:{line}: {name} imports {a.name} from {t}" for a in node.names
                                if a.name.startswith("_") and not a.name.startswith("__")]
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                owner = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                if owner in PRIVATE_OWNERS and node.attr not in own:
                    bad.append(f"{path}:{node.lineno}: {ast.unparse(node)[:80]}")
    return bad


def name_branches(mods):
    bad = []
    for name, (path, tree) in mods.items():
        if name == "pyro_convexvb.infer.registry":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            consts = []
            for side in [node.left] + node.comparators:
                elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                consts += [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if ENGINE_NAMES & set(consts):
                bad.append(f"{path}:{node.lineno}: {ast.unparse(node)[:80]}")
    return bad


def main(root="pyro_convexvb"):
    mods = modules(root)
    checks = {"cycles": [" <-> ".join(c) for c in cycles(mods)], "floors": floors(mods), "info": info_reads(mods),
              "private": private_reads(mods), "names": name_branches(mods)}
    for check, found in checks.items():
        print(f"{check}: {'ok' if not found else f'{len(found)} found'}")
        for f in found:
            print(f"    {f}")
    lazy = cycles(mods, top_level_only=False)
    print(f"(not a failure) cycles through function-level imports: {len(lazy)}")
    for c in lazy:
        print(f"    {' <-> '.join(c)}")
    return 0 if not any(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
