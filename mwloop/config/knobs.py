"""What a config knob is: its default, its doc, its validator and its policies, declared once (`schema.TABLE`).

The defaults (`base_config`), the check (`check.check`), the cluster agreement (`cluster.agreement`) and the
resume check (`artifacts.resume_check`) are all read from the table, so a new knob is one `knob(...)` call in
`schema.py`. A knob cannot be declared without its policies: `policy` is a required argument, and the table
refuses a declaration whose policy is not a `Policy`.

No TensorFlow here: sweep planning imports the check before anything runs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ml_collections
from ml_collections import config_dict

from mwloop.errors import UserError


class ConfigError(UserError):
    """A setting that cannot work: one line naming the key, its value and the fix."""


def fail(key: str, value: Any, fix: str) -> ConfigError:
    """The one line of a refused setting: `config.KEY=VALUE; FIX`."""
    return ConfigError(f"config.{key}={value!r}; {fix}")


def matches(key: str, patterns: Iterable[str]) -> bool:
    """Whether a dotted key is one of `patterns` or lies under one of them (`optimizer` covers `optimizer.lr`)."""
    return any(key == p or key.startswith(p + ".") for p in patterns)


@dataclasses.dataclass(frozen=True)
class Resume:
    """Whether a resume may change a knob: `passes(old, new)` gets both runs' flattened configs.

    Attributes:
      why: said after the refusal's list when this knob is refused.
    """
    passes: Callable[[dict[str, Any], dict[str, Any]], bool]
    why: str = ""


PASS = Resume(lambda old, new: True)
REFUSE = Resume(lambda old, new: False)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Where a knob may differ.

    per_task: may it differ between the tasks of one cluster (it only changes how one process runs).
    evaluator: may the side-car evaluator's differ from the trainer's record: True, False, or a rule
      `(evaluator's value, trainer's value) -> passes`.
    resume: may a resume change it (`PASS`, `REFUSE`, or a `Resume` rule).
    """
    per_task: bool
    evaluator: bool | Callable[[Any, Any], bool]
    resume: Resume


# The policies most knobs share.
# What an update computes: the same run everywhere.
RUN = Policy(per_task=False, evaluator=False, resume=REFUSE)
# Every task alike; a resume may change it.
SAME_RUN_OPTION = Policy(per_task=False, evaluator=False, resume=PASS)
# When the trainer's tasks meet; the side-car's own.
TRAINER = Policy(per_task=False, evaluator=True, resume=PASS)
# How this one process runs.
PROCESS = Policy(per_task=True, evaluator=True, resume=PASS)


@dataclasses.dataclass(frozen=True)
class Unset:
    """A default that stays unset: a typed placeholder, so `--config.KEY=VALUE` can still set it."""
    type: type


@dataclasses.dataclass(frozen=True)
class Knob:
    """One config key. Build it with `knob(...)` (the policy is a required argument).

    Attributes:
      range: (is the value allowed, the fix's text).
      validate: a rule of its own: raises ConfigError.
      task: a key of the built-in classification task, which other tasks may replace.
    """
    key: str
    default: Any
    doc: str
    policy: Policy
    choices: tuple[Any, ...] | None = None
    range: tuple[Callable[[Any], bool], str] | None = None
    integer: bool = False
    validate: Callable[[str, Any], None] | None = None
    task: bool = False

    def check(self, value: Any) -> None:
        """This knob's rule on `value`.

        Raises:
          ConfigError: the value is not allowed, in one line.
        """
        if self.choices is not None and value not in self.choices:
            raise fail(self.key, value, f"use one of {', '.join(self.choices)}")
        if self.range is not None:
            allowed, fix = self.range
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or (
                    self.integer and not float(value).is_integer()):
                raise fail(self.key, value, f"use a number ({fix.removeprefix('use ')})")
            if not allowed(value):
                raise fail(self.key, value, fix)
        if self.validate is not None:
            self.validate(self.key, value)


def knob(key: str, default: Any, doc: str = "", *, policy: Policy, **validator: Any) -> Knob:
    """One declaration: the key, its default (`Unset(type)` for a typed placeholder), what it does, its
    policies (required) and its validator (`choices=`, `range=(allowed, fix)`, `integer=`, `validate=`)."""
    return Knob(key, default, doc, policy, **validator)


@dataclasses.dataclass(frozen=True)
class Section:
    """A group of keys (`optimizer`). Its `policy`, if any, is that of the keys under it no knob declares;
    an `open` section (model, dataset) holds keys a task adds, which code may read undeclared."""
    key: str
    doc: str = ""
    open: bool = False
    policy: Policy | None = None


class Table:
    """Every knob, in the order base_config builds them; checked when built."""

    def __init__(self, declarations: Iterable[Knob | Section], undeclared: Policy = RUN):
        """Args:
          declarations: the knobs and sections.
          undeclared: the policy of a key no declaration covers (a task's own top-level key): by default it
            changes the run, the safe side.
        Raises:
          ValueError: a knob without a Policy, a key declared twice, a knob under another knob, an open
            section without a policy, or a default its own validator refuses.
        """
        self.knobs: dict[str, Knob] = {}
        self.sections: dict[str, Section] = {}
        self.order: list[Knob | Section] = []
        self.undeclared = undeclared
        for item in declarations:
            if item.key in self.knobs or item.key in self.sections:
                raise ValueError(f"config key {item.key!r} is declared twice")
            parent = item.key.rpartition(".")[0]
            if parent and parent not in self.sections:
                raise ValueError(f"config key {item.key!r} comes before its section {parent!r} is declared")
            self.order.append(item)
            if isinstance(item, Section):
                if item.open and not isinstance(item.policy, Policy):
                    raise ValueError(f"open section {item.key!r} needs a policy for the keys a task adds")
                self.sections[item.key] = item
                continue
            if not isinstance(item, Knob) or not isinstance(item.policy, Policy):
                raise ValueError(f"config key {getattr(item, 'key', item)!r} is declared without a Policy; "
                                 f"say whether it may differ per task, for the evaluator and on resume")
            if matches(item.key, self.knobs) or any(matches(k, [item.key]) for k in self.knobs):
                raise ValueError(f"config key {item.key!r} overlaps another knob")
            if not isinstance(item.default, Unset):
                item.check(item.default)
            self.knobs[item.key] = item

    def __iter__(self) -> Iterator[Knob]:
        return iter(self.knobs.values())

    def extended(self, *declarations: Knob | Section) -> Table:
        """This table with more declarations (a test's new knob, a project's own)."""
        return Table([*self.order, *declarations], self.undeclared)

    def policy(self, key: str) -> Policy:
        """The policy of a dotted key: its knob's (a key under a dict-valued knob: that knob's), else its nearest
        section's that has one, else `undeclared`."""
        parts = key.split(".")
        for n in range(len(parts), 0, -1):
            prefix = ".".join(parts[:n])
            if prefix in self.knobs:
                return self.knobs[prefix].policy
            section = self.sections.get(prefix)
            if section is not None and section.policy is not None:
                return section.policy
        return self.undeclared

    def declares(self, key: str) -> bool:
        """Whether code may read `key`: a knob, a section, or a key under a dict-valued knob or an open section."""
        if key in self.sections:
            return True
        parts = key.split(".")
        for n in range(len(parts), 0, -1):
            prefix = ".".join(parts[:n])
            if prefix in self.knobs or (prefix in self.sections and self.sections[prefix].open):
                return True
        return False

    def keys(self, where: Callable[[Policy], Any]) -> tuple[str, ...]:
        """The knobs whose policy satisfies `where` (e.g. `lambda p: p.per_task`)."""
        return tuple(k.key for k in self if where(k.policy))

    def defaults(self, **values: Any) -> ml_collections.ConfigDict:
        """A config of every knob's default; `values` replace some ({"task": MyTask}) before the field is typed."""
        config = ml_collections.ConfigDict()
        for item in self.order:
            *parents, name = item.key.split(".")
            node = config
            for parent in parents:
                node = node[parent]
            if isinstance(item, Section):
                node[name] = ml_collections.ConfigDict()
            else:
                node[name] = values[item.key] if item.key in values else _value(item)
        return config

    def complete(self, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """A copy of `config` with every knob it lacks at its default, for the edge (build_run) to call once so
        that inner code reads `config.KEY` and never repeats a default with `.get(KEY, default)`. The built-in
        task's keys (`task=True`) are left out: a task that replaced `dataset` or `model` keeps its own.

        Args:
          config: a run's config, perhaps built by hand rather than from base_config.
        Returns:
          The completed copy (the config itself is not changed).
        """
        completed = copy.deepcopy(config)
        with completed.unlocked():
            for item in self.order:
                if isinstance(item, Knob) and not item.task:
                    *parents, name = item.key.split(".")
                    node = completed
                    for parent in parents:
                        if parent not in node:
                            node[parent] = ml_collections.ConfigDict()
                        node = node[parent]
                    if name not in node:
                        node[name] = _value(item)
        return completed


def _value(item: Knob) -> Any:
    """A knob's default as a config field: a typed placeholder for `Unset`, a ConfigDict for a dict."""
    if isinstance(item.default, Unset):
        return config_dict.placeholder(item.default.type)
    if isinstance(item.default, dict):
        return ml_collections.ConfigDict(item.default)
    return item.default
