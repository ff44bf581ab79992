"""List the functions of the package over 80 lines (docstring included) and whether their docstring gives the reason
("Over 80 lines: ..."). Exit status 1 if one has none.

    python .ci/long_functions.py [pyro_convexvb]
"""
import ast
import pathlib
import sys


def long_functions(root, limit=80):
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    reason = "over 80 lines" in (ast.get_docstring(node) or "").lower()
                    yield lines, f"{path}:{node.lineno}", node.name, reason


def main(root="pyro_convexvb"):
    """Print every function over 80 lines with ``reason given`` or ``NO REASON``; ``1`` if one has none, else ``0``
    (the exit status; ``tests/test_layering.py`` runs it on the package)."""
    rows = sorted(long_functions(root), reverse=True)
    for lines, where, name, reason in rows:
        print(f"{lines:5d}  {where}  {name}  {'reason given' if reason else 'NO REASON'}")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
