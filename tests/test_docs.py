"""Docs name public things only (issue 28): README.md and docs/*.md send users to mwloop's public API.

Public is what `mwloop/__init__.py` exports (`mwloop.__all__`), `mwloop.testing`, the sweep file API
(`mwloop.sweep.__all__`) and the commands `python -m mwloop.main|launch|sweep|goodput|data.make_tfrecords|data.convert`.

- ```python blocks are parsed with `ast`: an import of any other mwloop module, a name imported from
  `mwloop` that it does not export, or `mwloop.X` with X not exported fails. A block that does not parse
  (a fragment) is checked line by line for the same imports and names instead, and most blocks must parse.
- Every block (bash, sh, plain, yaml, python) is searched for `-m mwloop.X`: X must be a command.
- The prose is searched for dotted `mwloop.X...` names (inline code, mostly): X must be public, a command,
  or one of NOT_PYTHON (names that only look like Python).
Each failure names the file, the line (of the block, for a block) and the offending name.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import textwrap
from dataclasses import dataclass, field

import pytest

import mwloop
import mwloop.sweep
from tests.helpers import ROOT

DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
COMMANDS = {"main", "launch", "sweep", "goodput", "data.make_tfrecords", "data.convert"}  # python -m mwloop.<command>
PUBLIC_MODULES = {"mwloop", "mwloop.testing", "mwloop.sweep"}
PYTHON = {"python", "py", "python3"}
# Dotted names in prose that are not Python: MLflow tags (docs/tracking.md) and config.task's default value.
NOT_PYTHON = {"mwloop.workdir", "mwloop.config", "mwloop.trial", "mwloop.config_changed_on_resume",
              "mwloop.tasks.classification:ImageClassification"}

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
COMMAND = re.compile(r"(?<![\w-])-m[\s,]+(mwloop\b[\w.]*)")
DOTTED = re.compile(r"(?<![\w/.-])mwloop((?:\.[A-Za-z_]\w*)+)(:[A-Za-z_]\w*)?")
IMPORT_LINE = re.compile(r"^\s*(?:from\s+(mwloop[\w.]*)\s+import\s+([\w\s,()]+)|import\s+(mwloop[\w.]*))")


@dataclass
class Block:
    line: int  # of the opening fence, 1-based
    info: str  # the language after the fence, lower case ("" for a plain block)
    code: str


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    blocks: int = 0
    python: int = 0
    parsed: int = 0
    skipped: int = 0


def split_blocks(text: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a markdown text (indented fences too, as in a list), and its other lines (a
    block's lines blanked, so the prose keeps its line numbers)."""
    blocks, prose = [], []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            prose.append(lines[i])
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        blocks.append(Block(i + 1, opening["info"].strip().split(" ")[0].lower(), "\n".join(body)))
        prose += [""] * (min(j, len(lines) - 1) - i + 1)
        i = j + 1
    return blocks, prose


def public_names() -> set[str]:
    return set(mwloop.__all__) | {"sweep"}  # `import mwloop.sweep` makes `mwloop.sweep` an attribute


def _dotted_problem(parts: list[str], allowed: set[str]) -> str | None:
    """Why `mwloop.<parts...>` is not public, or None. parts[0] is mwloop's attribute."""
    if parts[0] not in allowed:
        return f"mwloop.{parts[0]}"
    if parts[0] == "testing" and len(parts) > 1 and parts[1].startswith("_"):
        return "mwloop." + ".".join(parts[:2])
    if parts[0] == "sweep" and len(parts) > 1 and parts[1] not in mwloop.sweep.__all__:
        return "mwloop." + ".".join(parts[:2])
    return None


def _import_problems(module: str, names: list[str], allowed: set[str]) -> list[str]:
    if module not in PUBLIC_MODULES:
        return [module]
    if module == "mwloop":
        return [f"mwloop.{n}" for n in names if n != "*" and n not in allowed]
    if module == "mwloop.sweep":
        return [f"mwloop.sweep.{n}" for n in names if n not in mwloop.sweep.__all__]
    return [f"{module}.{n}" for n in names if n.startswith("_")]


def _attribute_chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), parts[::-1]


def python_problems(tree: ast.AST, allowed: set[str]) -> list[str]:
    bad, aliases = [], {"mwloop"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "mwloop" or alias.name.startswith("mwloop."):
                    bad += _import_problems(alias.name, [], allowed)
                    if alias.asname and alias.name == "mwloop":
                        aliases.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and (
                node.module == "mwloop" or node.module.startswith("mwloop.")):
            bad += _import_problems(node.module, [a.name for a in node.names], allowed)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):  # mwloop.a.b and its inner mwloop.a alike: one problem, deduplicated
            root, parts = _attribute_chain(node)
            if root in aliases:
                problem = _dotted_problem(parts, allowed)
                if problem:
                    bad.append(problem)
    return list(dict.fromkeys(bad))


def fragment_problems(code: str, allowed: set[str]) -> list[str]:
    """The same checks, line by line, for a block `ast` cannot parse."""
    bad = []
    for line in code.split("\n"):
        match = IMPORT_LINE.match(line)
        if match and match[1]:
            bad += _import_problems(match[1], [n.strip() for n in match[2].strip("() ").split(",") if n.strip()],
                                    allowed)
        elif match and match[3]:
            bad += _import_problems(match[3], [], allowed)
        for name in DOTTED.finditer("" if match else line):
            problem = _dotted_problem(name[1][1:].split("."), allowed)
            if problem:
                bad.append(problem)
    return list(dict.fromkeys(bad))


def command_problems(text: str) -> list[tuple[int, str]]:
    """(offset, name) of each `-m mwloop.X` whose X is not a command."""
    bad = []
    for match in COMMAND.finditer(text):
        name = match[1].rstrip(".")
        if name.removeprefix("mwloop.") not in COMMANDS:
            bad.append((match.start(1), name))
    return bad


def check(doc: str, text: str) -> Report:
    """Every problem of one markdown file `doc` (its path, for the messages) with `text`."""
    report, allowed = Report(), public_names()
    blocks, prose_lines = split_blocks(text)
    for block in blocks:
        report.blocks += 1
        where = f"{doc}:{block.line} ({block.info or 'plain'} block)"
        for _, name in command_problems(block.code):
            report.problems.append(f"{where}: `python -m {name}` is not a command; use one of "
                                   f"{sorted('mwloop.' + c for c in COMMANDS)}")
        if block.info in PYTHON:
            report.python += 1
            try:
                tree = ast.parse(textwrap.dedent(block.code))
            except SyntaxError:
                report.skipped += 1
                names = fragment_problems(block.code, allowed)
            else:
                report.parsed += 1
                names = python_problems(tree, allowed)
            report.problems += [f"{where}: {name} is not public mwloop API (mwloop.__all__, mwloop.testing, "
                                f"mwloop.sweep)" for name in names]
    prose = "\n".join(prose_lines)
    for offset, name in command_problems(prose):
        line = prose.count("\n", 0, offset) + 1
        report.problems.append(f"{doc}:{line}: `python -m {name}` is not a command")
    commands_by_module = {f"mwloop.{c}" for c in COMMANDS}
    for match in DOTTED.finditer(prose):
        full = match[0]
        if full in NOT_PYTHON or full in commands_by_module or prose[:match.start()].endswith(("-m ", "-m\n")):
            continue
        problem = _dotted_problem(match[1][1:].split("."), allowed)
        if problem:
            line = prose.count("\n", 0, match.start()) + 1
            report.problems.append(f"{doc}:{line}: `{full}` names {problem}, which is not public mwloop API")
    return report


def _read(doc: str) -> str:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("doc", DOCS)
def test_docs_name_public_things_only(doc):
    problems = check(doc, _read(doc)).problems
    assert not problems, "\n".join(problems)


def test_most_python_blocks_parse():
    reports = [check(doc, _read(doc)) for doc in DOCS]
    blocks, python, parsed, skipped = (sum(getattr(r, k) for r in reports)
                                       for k in ("blocks", "python", "parsed", "skipped"))
    print(f"{len(DOCS)} files, {blocks} blocks read, {python} python: {parsed} parsed, {skipped} skipped")
    assert python >= 5 and parsed + skipped == python
    assert skipped * 4 <= python, f"{skipped} of {python} python blocks do not parse: the check is mostly blind"


PLANTED = '''# A bad doc

Call `mwloop.run.train.train_and_evaluate` or `mwloop.Trainer`.

```python
import mwloop
from mwloop.run import trainer
from mwloop import Trainer, make_update
mwloop.launch.launch(["--config=c.py"], num_workers=2)
mwloop.testing.split_cpu(2)
```

- a list item:
  ```bash
  .venv/bin/python -m mwloop.run.sidecar --workdir=DIR
  python -m mwloop.main --config=configs/mlp.py
  ```

```python
    def train_step(self, model, optimizer, batch, global_batch_size):
from mwloop.step.steps import StepOptions
```

Sinks (`mwloop.artifacts.writers.Sink`); tags `mwloop.workdir`; run `python -m mwloop.launch`.
'''


def test_a_planted_bad_doc_is_caught():
    report = check("planted.md", PLANTED)
    text = "\n".join(report.problems)
    assert (report.blocks, report.python, report.parsed, report.skipped) == (3, 2, 1, 1)
    for expected in ["planted.md:3: `mwloop.run.train.train_and_evaluate` names mwloop.run",
                     "planted.md:5 (python block): mwloop.run is not public",
                     "planted.md:5 (python block): mwloop.make_update is not public",
                     "planted.md:5 (python block): mwloop.launch is not public",
                     "planted.md:14 (bash block): `python -m mwloop.run.sidecar` is not a command",
                     "planted.md:19 (python block): mwloop.step.steps is not public",
                     "planted.md:24: `mwloop.artifacts.writers.Sink` names mwloop.artifacts"]:
        assert expected in text, f"{expected!r} not in:\n{text}"
    assert len(report.problems) == 7, text  # Trainer, testing.split_cpu, -m mwloop.main/launch, the tag pass

