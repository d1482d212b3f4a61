"""Every config knob is declared once (mwloop.config.schema): read keys are declared, a declaration carries its
policies, and one new declaration reaches the defaults, the check, the resume check and the cluster agreement."""

from __future__ import annotations

import ast
import json
import os

import ml_collections
import pytest

import mwloop
from mwloop.artifacts import resume_check
from mwloop.cluster import agreement
from mwloop.config import check, knobs, schema
from tests.helpers import ROOT, load_config

PACKAGE = os.path.join(ROOT, "mwloop")
# Names that hold a whole run config, and the objects whose `.config` attribute is one.
CONFIG_NAMES = {"config"}
CONFIG_OWNERS = {"self", "run", "task", "trainer", "_trainer", "FLAGS", "probe"}
# Names that hold one section of it ("": the whole config), or no config at all (None), by file or folder.
SECTION_NAMES = {
    ("cfg", "mwloop/step/optim.py"): "optimizer",
    ("cfg", "mwloop/data/"): "dataset",
    ("cfg", "mwloop/models/"): "model",
    ("dist", "mwloop/cluster/distribute.py"): "distribution",
    ("base", "mwloop/sweep/plan.py"): "",
    ("config", "mwloop/cluster/peers.py"): None,  # TF_CONFIG's dict
}
METHODS = {name for name in dir(ml_collections.ConfigDict) if not name.startswith("_")}


def _section_of(name: str, path: str) -> str | None:
    """The key a name holds in a file: "" for a whole config, a section's key, or None (no config)."""
    for (alias, where), section in SECTION_NAMES.items():
        if alias == name and path.startswith(where):
            return section
    return "" if name in CONFIG_NAMES else None


class _Reads(ast.NodeVisitor):
    """The dotted config keys one file reads: `config.train.steps`, `cfg.get("kwargs")`, `config["x"]`,
    `self.config.optimizer.get("ema")`, and names bound to a section (`opt = config.optimizer`)."""

    def __init__(self, path: str):
        self.path = path
        self.aliases: dict[str, str] = {}  # names bound to a part of the config in this function
        self.found: list[tuple[int, str]] = []

    def key(self, node: ast.AST) -> str | None:
        """The key `node` denotes ("" for the whole config), or None when it is no config read."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, _section_of(node.id, self.path))
        if isinstance(node, ast.Attribute) and node.attr == "config" and isinstance(node.value, ast.Name) \
                and node.value.id in CONFIG_OWNERS:
            return ""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            inner = node.func.value
            part = node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str):
            inner, part = node.value, node.slice.value
        elif isinstance(node, ast.Attribute) and node.attr not in METHODS:
            inner, part = node.value, node.attr
        else:
            return None
        prefix = self.key(inner)
        if prefix is None:
            return None
        return f"{prefix}.{part}" if prefix else part

    def visit_Assign(self, node: ast.Assign) -> None:
        bound = self.key(node.value)
        if bound and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            self.aliases[node.targets[0].id] = bound
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        outer = dict(self.aliases)
        self.generic_visit(node)
        self.aliases = outer

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            key = self.key(node)
            if key:
                self.found.append((node.lineno, key))
        super().generic_visit(node)


def config_reads() -> list[tuple[str, str]]:
    """(file:line, dotted key) of every config key mwloop's code reads or sets."""
    reads = []
    for folder, _, names in os.walk(PACKAGE):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)
                visitor = _Reads(rel)
                with open(path) as f:
                    visitor.visit(ast.parse(f.read(), rel))
                reads += [(f"{rel}:{line}", key) for line, key in visitor.found]
    return reads


def undeclared(table: knobs.Table) -> list[str]:
    """'file:line key' of every read key the table does not declare."""
    return sorted({f"{where} {key}" for where, key in config_reads() if not table.declares(key)})


def test_every_config_key_mwloop_reads_is_declared():
    reads = config_reads()
    assert len(reads) > 100, "the scan finds mwloop's config reads"  # it must see something to mean anything
    assert {"train.steps", "optimizer.kwargs", "distribution.startup_timeout_s", "writers"} <= {k for _, k in reads}
    assert undeclared(schema.TABLE) == []


def test_the_scan_catches_a_key_read_but_not_declared():
    # The table before issue 43: optimizer.kwargs was read by step/optim.py (cfg.get("kwargs")) but not declared.
    old = knobs.Table([item for item in schema.TABLE.order if item.key not in ("optimizer.kwargs", "loss_weights")])
    missing = undeclared(old)
    assert any(line.startswith("mwloop/step/optim.py:") and line.endswith(" optimizer.kwargs") for line in missing)
    assert any(line.startswith("mwloop/task.py:") and line.endswith(" loss_weights") for line in missing)


def test_every_function_handed_a_config_names_it_so_the_scan_sees_it():
    """A parameter annotated ConfigDict must be `config` or a known section alias: a new name would hide its
    reads from the scan above."""
    unknown = []
    for folder, _, names in os.walk(PACKAGE):
        for name in (n for n in names if n.endswith(".py")):
            rel = os.path.relpath(os.path.join(folder, name), ROOT)
            with open(os.path.join(ROOT, rel)) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for arg in [*node.args.args, *node.args.kwonlyargs]:
                        if arg.annotation is not None and "ConfigDict" in ast.unparse(arg.annotation) \
                                and _section_of(arg.arg, rel) is None:
                            unknown.append(f"{rel}:{node.lineno} {node.name}({arg.arg})")
    assert unknown == [], "add these names to CONFIG_NAMES or SECTION_NAMES"


def test_a_knob_cannot_be_declared_without_its_policy():
    with pytest.raises(TypeError, match="policy"):
        knobs.knob("train.new_knob", 1, "doc")  # the missing policy is the point
    with pytest.raises(ValueError, match=r"'train.new_knob' is declared without a Policy"):
        schema.TABLE.extended(knobs.Knob("train.new_knob", 1, "doc", policy=None))
    with pytest.raises(ValueError, match="declared twice"):
        schema.TABLE.extended(knobs.knob("train.steps", 1, policy=knobs.RUN))
    with pytest.raises(ValueError, match="before its section"):
        schema.TABLE.extended(knobs.knob("nowhere.knob", 1, policy=knobs.RUN))
    with pytest.raises(check.ConfigError, match=r"^config.train.new_knob=0; use 1 or more$"):
        schema.TABLE.extended(knobs.knob("train.new_knob", 0, policy=knobs.RUN, range=(lambda v: v >= 1,
                                                                                       "use 1 or more")))


def test_every_leaf_of_every_shipped_config_resolves_to_one_policy():
    for name in ("mlp", "resnet", "detection", "regression", "sequence", "recommend", "retrieval"):
        for key in resume_check.flatten(json.loads(load_config(name).to_json_best_effort())):
            assert isinstance(schema.TABLE.policy(key), knobs.Policy), key
    assert schema.TABLE.policy("dataset.threads").per_task and not schema.TABLE.policy("dataset.num_classes").per_task
    assert schema.TABLE.policy("loss_weights.box") is schema.TABLE.policy("loss_weights")  # under a dict knob
    assert schema.TABLE.policy("a_task_key.x") is knobs.RUN  # undeclared: a change to the run, the safe side


def test_the_views_other_modules_read_are_derived_from_the_table():
    assert check.CHOICES["optimizer.schedule"] == ("constant", "cosine", "linear", "step")
    assert check.RANGES["train.steps"][1] == "train for at least 1 step"
    assert "train.global_batch_size" in check.INTEGERS and "optimizer.learning_rate" not in check.INTEGERS
    per_task = schema.TABLE.keys(lambda p: p.per_task)
    assert set(per_task) == {"name", "writers", "dataset.threads", "dataset.parallel_calls", "dataset.prefetch",
                             "distribution.startup_timeout_s", "distribution.collective_timeout_s",
                             "distribution.peer_timeout_s", "eval.continuous_timeout_s", "eval.trainer_gone_s"}


# ---------------------------------------------------------------------------- one new knob, end to end

NEW = knobs.knob("train.warmup_bias", 0.5, "a new knob of a test: changes every update", policy=knobs.RUN,
                 range=(lambda v: 0 <= v <= 1, "use a value in [0, 1]"))
NEW_PER_PROCESS = knobs.knob("dataset.read_ahead", 2, "a new knob of a test: one process's buffering",
                             policy=knobs.PROCESS, range=(lambda v: v >= 0, "use 0 or more"), integer=True)


@pytest.fixture
def with_new_knobs(monkeypatch):
    monkeypatch.setattr(schema, "TABLE", schema.TABLE.extended(NEW, NEW_PER_PROCESS))


def _recorded(tmp_path, config) -> str:
    (tmp_path / "config.json").write_text(config.to_json_best_effort())
    return str(tmp_path)


def test_a_new_knob_declared_in_one_place_reaches_defaults_check_resume_and_agreement(with_new_knobs, tmp_path):
    # The default, in base_config and every config file built on it.
    assert mwloop.base_config().train.warmup_bias == 0.5
    config = load_config("mlp")
    assert config.train.warmup_bias == 0.5 and config.dataset.read_ahead == 2
    # The check: one line naming the key, the value and the fix.
    config.train.warmup_bias = 1.5
    with pytest.raises(check.ConfigError) as error:
        check.check(config)
    assert str(error.value) == "config.train.warmup_bias=1.5; use a value in [0, 1]"
    with pytest.raises(check.ConfigError, match=r"^config.dataset.read_ahead=2.5; use a number \(0 or more\)$"):
        check.check_value("dataset.read_ahead", 2.5)
    # The resume policy: a change of the RUN knob is refused, the PROCESS knob's passes.
    workdir = _recorded(tmp_path, load_config("mlp"))
    with pytest.raises(mwloop.UserError, match=r"train.warmup_bias: 0.5 -> 0.25.*allow_changed=train.warmup_bias"):
        resume_check.check(load_config("mlp", **{"train.warmup_bias": 0.25}), workdir, 100)
    resume_check.check(load_config("mlp", **{"dataset.read_ahead": 8}), workdir, 100)
    # The per-task policy: the cluster compares the RUN knob and leaves the per-process one out.
    mine = agreement.settings(load_config("mlp"))
    assert "train.warmup_bias" in mine and "dataset.read_ahead" not in mine
    assert agreement.differences(agreement.settings(load_config("mlp", **{"train.warmup_bias": 0.25})), mine) == {
        "train.warmup_bias": (0.25, 0.5)}
    # The side-car evaluator follows the same declaration.
    with pytest.raises(mwloop.UserError, match=r"train.warmup_bias=0.25 here, 0.5 in "):
        agreement.check_recorded(load_config("mlp", **{"train.warmup_bias": 0.25}), workdir)
    assert agreement.check_recorded(load_config("mlp", **{"dataset.read_ahead": 8}), workdir)


# ---------------------------------------------------------------------------- asynchronous checkpoints on resume

def test_switching_async_checkpoints_on_at_a_resume_passes_the_resume_check(tmp_path):
    workdir = _recorded(tmp_path, load_config("mlp"))
    resume_check.check(load_config("mlp", **{"train.async_checkpoint": True}), workdir, 100)
    assert resume_check.changes(load_config("mlp", **{"train.async_checkpoint": True}),
                                json.loads(load_config("mlp").to_json_best_effort()), 100) == {}


def _checkpoint_weights(workdir: str, step: int) -> dict:
    import tensorflow as tf
    reader = tf.train.load_checkpoint(os.path.join(workdir, "checkpoints", f"ckpt-{step}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith(("model/", "optimizer/", "step/"))}


@pytest.mark.slow  # ~7 s: two short runs, mostly tracing
def test_a_synchronous_run_resumed_with_async_checkpoints_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path,
                                                                                                      caplog):
    import logging

    import numpy as np
    config = load_config("mlp", **{"distribution.strategy": "default", "deterministic": True, "train.steps": 120,
                                   "train.eval_every_steps": 0, "train.checkpoint_every_steps": 60,
                                   "train.max_to_keep": 5, "export": False, "writers": ()})
    full = str(tmp_path / "full")
    mwloop.train_and_evaluate(config, full, mode="train")
    # The interrupted run: what the synchronous run had saved at step 100 (with the config it was trained with).
    stopped = tmp_path / "stopped"
    (stopped / "checkpoints").mkdir(parents=True)
    for name in os.listdir(os.path.join(full, "checkpoints")):
        if name.startswith("ckpt-60."):
            (stopped / "checkpoints" / name).write_bytes((tmp_path / "full" / "checkpoints" / name).read_bytes())
    (stopped / "checkpoints" / "checkpoint").write_text('model_checkpoint_path: "ckpt-60"\n'
                                                         'all_model_checkpoint_paths: "ckpt-60"\n')
    recorded = json.loads((stopped / "checkpoints" / "ckpt-60.config.json").read_text())
    assert recorded["train"]["async_checkpoint"] is False  # the resume check compares with this record
    config.train.async_checkpoint = True
    with caplog.at_level(logging.INFO, logger="absl"):
        mwloop.train_and_evaluate(config, str(stopped), mode="train")
    assert "resumed from step 60" in caplog.text
    assert json.loads((stopped / "config.json").read_text())["train"]["async_checkpoint"] is True
    want, got = _checkpoint_weights(full, 120), _checkpoint_weights(str(stopped), 120)
    assert want.keys() == got.keys() and len(want) >= 9  # kernels, biases, momenta, iterations, step
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_complete_fills_the_knobs_a_hand_built_config_lacks_and_leaves_the_tasks_own_keys():
    """What the edge (build_run) can call once so inner code never repeats a default with `.get(KEY, default)`."""
    hand_built = ml_collections.ConfigDict({"train": {"steps": 10}, "dataset": {"rows": 5}})
    completed = schema.TABLE.complete(hand_built)
    assert "allow_changed" not in hand_built.train  # a copy: the user's config is untouched
    assert completed.train.steps == 10 and completed.train.allow_changed == ""
    assert completed.distribution.startup_timeout_s == 300.0 and completed.dataset.threads == 0
    assert dict(completed.optimizer.kwargs) == {} and completed.dataset.rows == 5
    assert "name" not in completed.dataset and "label_smoothing" not in completed.train  # the built-in task's keys
    check.check(completed)
    full = load_config("mlp")
    assert schema.TABLE.complete(full).to_json_best_effort() == full.to_json_best_effort()
