"""The shape of the run-time code, for any checkout: how crowded its hub is (issue 43's before/after table).

    python -m benchmarks.code_shape [--root=DIR ...]

Per checkout root (default: this one): lines and mwloop imports of the largest module of mwloop/run/, the
attributes and methods of the `Trainer` class, `.get(key, default)` calls in mwloop/, `raise` and `except`
statements in mwloop/ (per 1,000 lines too), and trailing comments (code, then `  # ...` on one line).
Static reading only (ast and tokenize): nothing is imported, so any checkout can be read.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import tokenize


def _python_files(root: str) -> list[str]:
    found = []
    for directory, _, names in os.walk(os.path.join(root, "mwloop")):
        found.extend(os.path.join(directory, n) for n in names if n.endswith(".py"))
    return sorted(found)


def _mwloop_imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mwloop"):
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("mwloop"))
    return names


def _class_shape(tree: ast.AST, name: str) -> tuple[int, int]:
    """(attributes assigned on self, methods and properties) of class `name` in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef)]
            attributes = {t.attr for n in ast.walk(node) for t in _targets(n)
                          if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
            return len(attributes), len(methods)
    return 0, 0


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _trailing_comments(source: str) -> int:
    count, code_on_line = 0, set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and token.start[0] in code_on_line:
            count += 1
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT,
                                tokenize.DEDENT):
            code_on_line.add(token.start[0])
    return count


def shape(root: str) -> dict[str, float]:
    """The figures of the checkout at `root`."""
    lines = raises = excepts = gets = trailing = 0
    run_modules: dict[str, tuple[int, int]] = {}
    trainer = (0, 0)
    for path in _python_files(root):
        with open(path) as f:
            source = f.read()
        tree = ast.parse(source)
        lines += source.count("\n")
        raises += sum(isinstance(n, ast.Raise) for n in ast.walk(tree))
        excepts += sum(isinstance(n, ast.ExceptHandler) for n in ast.walk(tree))
        gets += sum(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get"
                    and len(n.args) == 2 for n in ast.walk(tree))
        trailing += _trailing_comments(source)
        if os.sep + os.path.join("mwloop", "run") + os.sep in path:
            run_modules[os.path.relpath(path, root)] = (source.count("\n"), len(_mwloop_imports(tree)))
        if path.endswith(os.path.join("run", "trainer.py")):
            trainer = _class_shape(tree, "Trainer")
    biggest = max(run_modules, key=lambda p: run_modules[p][0])
    return {"largest run module": biggest, "its lines": run_modules[biggest][0],
            "its mwloop imports": run_modules[biggest][1], "trainer.py lines": run_modules.get(
                os.path.join("mwloop", "run", "trainer.py"), (0, 0))[0],
            "trainer.py mwloop imports": run_modules.get(os.path.join("mwloop", "run", "trainer.py"), (0, 0))[1],
            "Trainer attributes": trainer[0], "Trainer methods": trainer[1], ".get(key, default) calls": gets,
            "raise": raises, "except": excepts, "raise per 1,000 lines": round(1000 * raises / lines, 1),
            "except per 1,000 lines": round(1000 * excepts / lines, 1), "trailing comments": trailing,
            "lines of mwloop/": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", action="append", help="a checkout's root (repeatable; default: this one)")
    roots = parser.parse_args().root or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    figures = [shape(root) for root in roots]
    print("| figure | " + " | ".join(roots) + " |")
    print("|---|" + "---:|" * len(roots))
    for key in figures[0]:
        print(f"| {key} | " + " | ".join(str(f[key]) for f in figures) + " |")


if __name__ == "__main__":
    main()
