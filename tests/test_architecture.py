"""The tree is the architecture: mwloop's folders are layers, and a module imports only from its own folder
or the layers below it (`if TYPE_CHECKING:` imports and imports inside functions count too); the import
graph has no circle.

Also: examples/ and configs/ use only mwloop's public names, and those names are what `dir(mwloop)` shows.
"""

from __future__ import annotations

import ast
import os

import pytest

import mwloop
from tests.helpers import ROOT

PACKAGE = os.path.join(ROOT, "mwloop")

# Bottom to top. A unit is a folder of mwloop/ or a file at its top; each imports only units below it.
# `__init__.py` (the public API, loaded lazily by import string) belongs to no layer.
LAYERS = [
    "errors.py",  # exit codes, UserError
    "task.py",  # the Task contract
    "config",  # every knob's default, the one check
    "data", "models",  # datasets and models by name
    "artifacts",  # what a run leaves on disk: the workdir's files, checkpoints, exports, writers
    "cluster",  # strategies, joining a cluster, peers, the parameter-server watch (they name the workdir's files)
    "step",  # the per-replica math
    "tasks",  # the built-in tasks, on the same public path as a user's
    "loop",  # inputs, feeds, the update, the loops (also the parameter servers')
    "run",  # Trainer, actions, evaluation, the modes, the side-car, preemption
    "launcher",  # the local launcher's processes
    "sweep",  # the sweep tools (no TensorFlow)
    "main.py", "launch.py", "goodput.py", "testing",  # commands and the testing helpers on top
]
RANK = {unit: rank for rank, unit in enumerate(LAYERS)}


def package_sources() -> dict[str, str]:
    """Path under mwloop/ (e.g. "step/steps.py") -> its source."""
    sources = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                sources[os.path.relpath(path, PACKAGE)] = open(path).read()
    return sources


def dotted(path: str) -> str:
    return ("mwloop." + path[:-3].replace(os.sep, ".")).removesuffix(".__init__")


def unit(path: str) -> str:
    """The layer unit of a module: its folder under mwloop/, or the file itself at the top."""
    return path.split(os.sep)[0]


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Path -> the paths of the package's modules it imports, anywhere in the file (`from pkg import name`
    counts as an import of pkg.name when that is a module, else of pkg)."""
    path_of = {dotted(path): path for path in sources}
    graph = {}
    for path, source in sources.items():
        here = dotted(path).split(".") if path.endswith("__init__.py") else dotted(path).split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    module = ".".join(here[:len(here) - node.level + 1] + ([module] if module else []))
                names = [f"{module}.{a.name}" if f"{module}.{a.name}" in path_of else module for a in node.names]
            else:
                continue
            found |= {path_of[name] for name in names if name in path_of and path_of[name] != path}
        graph[path] = found
    return graph


def upward_imports(sources: dict[str, str]) -> list[str]:
    problems = []
    for path, imported in sorted(import_graph(sources).items()):
        if path == "__init__.py":
            continue
        for other in sorted(imported):
            if unit(other) != unit(path) and RANK[unit(other)] > RANK[unit(path)]:
                problems.append(f"{path} ({unit(path)}) imports {other} ({unit(other)}, a layer above it)")
    return problems


def circles(sources: dict[str, str]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    graph, index, low, stack, on_stack, found = import_graph(sources), {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_is_in_a_layer():
    units = {unit(path) for path in package_sources()} - {"__init__.py"}
    assert not units - set(RANK), f"place these in LAYERS (and ARCHITECTURE.md): {sorted(units - set(RANK))}"
    assert not set(RANK) - units, f"LAYERS names what does not exist: {sorted(set(RANK) - units)}"


def test_architecture_md_tells_every_folder():
    text = open(os.path.join(ROOT, "ARCHITECTURE.md")).read()
    untold = [u for u in LAYERS if f"`{u}/`" not in text and f"`{u}`" not in text]
    assert not untold, f"ARCHITECTURE.md does not tell of {untold}"


def test_no_module_imports_a_layer_above_its_own():
    problems = upward_imports(package_sources())
    assert not problems, "upward imports (move the code or the module):\n" + "\n".join(problems)


def test_the_import_graph_has_no_circle():
    found = circles(package_sources())
    assert not found, f"import circles: {found}"


def test_a_planted_upward_import_is_caught():
    sources = package_sources()
    planted = dict(sources)
    planted[os.path.join("config", "check.py")] += "\n\ndef _planted():\n    from mwloop.run import trainer  # noqa\n"
    assert not upward_imports(sources)
    assert upward_imports(planted) == ["config/check.py (config) imports run/trainer.py (run, a layer above it)"]


def test_a_planted_type_checking_circle_is_caught():
    sources = package_sources()
    planted = dict(sources)
    # steps.py imports losses.py; a type-only import back makes a circle inside one folder.
    planted[os.path.join("step", "losses.py")] += ("\n\nfrom typing import TYPE_CHECKING\n\n"
                                                   "if TYPE_CHECKING:\n    from mwloop.step import steps  # noqa\n")
    assert not circles(sources)
    assert [os.path.join("step", "losses.py"), os.path.join("step", "steps.py")] in circles(planted)


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
