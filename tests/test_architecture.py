"""ARCHITECTURE.md cannot drift: its layers are read from the file and checked against the package's imports.

Also: examples/ and configs/ use only mwloop's public names, and those names are what `dir(mwloop)` shows.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

import mwloop
from tests.helpers import ROOT

PACKAGE = os.path.join(ROOT, "mwloop")


def documented_layers(text: str) -> dict[str, int]:
    """Module path (e.g. "data/pipeline.py") -> its layer's number (1 = top), from "### N. name" sections."""
    layers, layer = {}, None
    for line in text.split("## Layers", 1)[1].splitlines():
        heading = re.match(r"### (\d+)\. ", line)
        if heading:
            layer = int(heading[1])
        elif line.startswith("## "):
            break
        elif layer is not None and line.startswith("| `"):
            for path in re.findall(r"`([\w/]+\.py)`", line.split("|")[1]):
                layers[path] = layer
    return layers


def package_modules() -> dict[str, str]:
    """Dotted module name -> its path under mwloop/ (the package's own __init__ is left out: no layer)."""
    modules = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.relpath(os.path.join(directory, name), PACKAGE)
                if path != "__init__.py":
                    dotted = "mwloop." + path[:-3].replace(os.sep, ".")
                    modules[dotted.removesuffix(".__init__")] = path
    return modules


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(path: str, modules: dict[str, str]) -> set[str]:
    """The package modules `path` imports (at run time: `if TYPE_CHECKING:` blocks are left out)."""
    tree = ast.parse(open(os.path.join(PACKAGE, path)).read())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def upward_imports(text: str) -> list[str]:
    layers, modules = documented_layers(text), package_modules()
    problems = []
    for dotted, path in sorted(modules.items()):
        for imported in sorted(imports_of(path, modules)):
            if imported != dotted and layers.get(modules[imported], 0) < layers.get(path, 0):
                problems.append(f"{path} (layer {layers[path]}) imports {modules[imported]} "
                                f"(layer {layers[modules[imported]]}, above it)")
    return problems


def test_every_module_is_in_the_documented_layers():
    layers = documented_layers(open(os.path.join(ROOT, "ARCHITECTURE.md")).read())
    missing = sorted(set(package_modules().values()) - set(layers))
    assert not missing, f"add these modules to ARCHITECTURE.md's layer tables: {missing}"
    gone = sorted(set(layers) - set(package_modules().values()))
    assert not gone, f"ARCHITECTURE.md lists modules that do not exist: {gone}"


def test_no_module_imports_a_layer_above_its_own():
    problems = upward_imports(open(os.path.join(ROOT, "ARCHITECTURE.md")).read())
    assert not problems, "upward imports (move the code or the module):\n" + "\n".join(problems)


def test_a_planted_upward_import_is_caught():
    text = open(os.path.join(ROOT, "ARCHITECTURE.md")).read()
    # steps.py imports task.py; documenting task.py above steps.py makes that import an upward one.
    planted = text.replace("| `task.py` |", "| `task_.py` |").replace(
        "### 1. commands\n", "### 1. commands\n\n| module | holds |\n|---|---|\n| `task.py` | planted |\n")
    assert "mwloop/step/steps.py" not in "".join(upward_imports(text))
    assert any(p.startswith("steps.py (layer 6) imports task.py (layer 1") for p in upward_imports(planted))


def _mwloop_imports(path: str) -> list[str]:
    tree = ast.parse(open(path).read())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.startswith("mwloop")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mwloop"):
            names.append(node.module)
    return names


@pytest.mark.parametrize("folder", ["examples", "configs"])
def test_examples_and_configs_use_only_the_public_api(folder):
    for name in sorted(os.listdir(os.path.join(ROOT, folder))):
        if name.endswith(".py"):
            private = [m for m in _mwloop_imports(os.path.join(ROOT, folder, name))
                       if m not in ("mwloop", "mwloop.testing")]
            assert not private, f"{folder}/{name} imports {private}; use `import mwloop` and its public names"


def test_the_public_api_is_what_dir_shows_and_every_name_resolves():
    assert dir(mwloop) == mwloop.__all__
    for name in mwloop.__all__:
        assert getattr(mwloop, name) is not None
    with pytest.raises(AttributeError):
        _ = mwloop.trainer_internals
