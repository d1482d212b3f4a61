"""A resume is the same run, or it says why not.

A run that resumes from its own checkpoint continues the run recorded beside
that checkpoint (`ckpt-N.config.json`, the config it was trained with; for a
checkpoint of an older mwloop, `workdir/config.json`, written when that run
started training), so deleting config.json alone hides no change. Settings that
change what the resumed steps compute — the global batch (and with it the
stream positions the data is read from), the length of the learning-rate
schedule, the data, the model, the seed, the optimizer — are compared with
that record before anything is written, and a difference is refused in one
line naming the old and new values and the way out:

- `--config.train.allow_changed=KEY[,KEY...]` continues on purpose with the new
  values (a key or a prefix: `optimizer` allows every optimizer.* key); the
  change is recorded in metrics.jsonl (`{"split": "resume", "changed": ...}`)
  before config.json is rewritten, so the workdir keeps the run's history;
- or a new `--workdir` (with `--config.init_checkpoint=OLD_WORKDIR` to start
  from the old weights with a schedule of its own).

Which settings a resume may change is each knob's `resume` policy, declared
with the knob in `mwloop.config.schema` (a key a task adds follows its open
section's policy, else it counts as a change). Settings that do not change the
math pass: how many steps a loop call runs, gradient accumulation k (one update
either way), logging, eval, checkpoint and export intervals, asynchronous
checkpoints, the strategy. `train.steps` passes too when the schedule does not
depend on it (constant, warmup done); otherwise (cosine, linear, step) a new
length re-stretches the schedule: the learning rate at the resume step jumps,
so it needs `allow_changed=train.steps`. A checkpoint past `train.steps` is an
error (never exported as the shorter run's result).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import ml_collections
from absl import logging

from mwloop.artifacts import files, jsonl
from mwloop.config import schema
from mwloop.config.knobs import matches
from mwloop.errors import UserError

CONFIG_FILE = files.CONFIG


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict (a config's JSON) as {"dotted.key": leaf}."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def same(old: Any, new: Any) -> bool:
    """Equal values; a class (a task defined in its config file) by its name: the module a config file is
    loaded as may be named differently in another process."""
    if isinstance(old, str) and isinstance(new, str):
        old, new = (re.sub(r"<class '(?:[\w.]*\.)?(\w+)'>", r"<class \1>", v) for v in (old, new))
    return old == new


def allowed_keys(config: ml_collections.ConfigDict) -> list[str]:
    """config.train.allow_changed as a list of keys or prefixes."""
    text = config.train.get("allow_changed", "") or ""
    return [k.strip() for k in str(text).split(",") if k.strip()]


def recorded_config(workdir: str, checkpoint: str | None = None) -> dict[str, Any] | None:
    """The config `checkpoint` was trained with (its `ckpt-N.config.json`), else the config.json of the run that
    wrote the workdir's checkpoints, or None when there is none to compare."""
    if checkpoint is not None and "://" not in checkpoint:
        if (beside := files.checkpoint_config(checkpoint)) is not None:
            return beside
        if os.path.lexists(checkpoint + files.CHECKPOINT_CONFIG):
            logging.warning("%s is unreadable; comparing with %s instead", checkpoint + files.CHECKPOINT_CONFIG,
                            CONFIG_FILE)
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.lexists(path):
        return None
    try:
        return jsonl.read_json(path, nofollow=True)
    except (OSError, jsonl.CorruptFileError) as e:
        logging.warning("cannot compare this run's settings with the checkpointed run's: %s", e)
        return None


def changes(config: ml_collections.ConfigDict, recorded: dict[str, Any], step: int) -> dict[str, tuple[Any, Any]]:
    """{key: (old, new)} of the settings that change what a resumed run computes."""
    old = flatten(recorded)
    new = flatten(json.loads(config.to_json_best_effort()))
    found = {}
    for key, value in new.items():
        if key not in old or same(old[key], value):
            continue  # a key unknown to the recorded run (an older mwloop) has nothing to compare
        if not schema.TABLE.policy(key).resume.passes(old, new):
            found[key] = (old[key], value)
    return found


def check(config: ml_collections.ConfigDict, workdir: str, step: int, writer=None,
          checkpoint: str | None = None) -> None:
    """Refuses (UserError) a resume at `step` that would silently compute another run; records allowed changes.

    Args:
      config: this run's config.
      workdir: the run's directory (its config.json is the checkpointed run's record: read before it is rewritten).
      step: the restored checkpoint's step.
      writer: the chief's MetricWriter (an allowed change is recorded as a `resume` event), or None.
      checkpoint: the restored checkpoint's prefix (the config beside it is the record), or None.
    """
    total = config.train.steps
    if step > total:
        raise UserError(f"the checkpoint in {os.path.join(workdir, 'checkpoints')} is at step {step}, past "
                        f"config.train.steps={total}; set --config.train.steps={step} or more to continue it, or use "
                        f"a new --workdir (with --config.init_checkpoint={workdir} to start from its weights)")
    recorded = recorded_config(workdir, checkpoint)
    if recorded is None:
        return
    found = changes(config, recorded, step)
    if not found:
        return
    allowed = allowed_keys(config)
    refused = {k: v for k, v in found.items() if not matches(k, allowed)}
    if refused:
        listed = "; ".join(f"{k}: {show(old)} -> {show(new)}" for k, (old, new) in refused.items())
        keys = ",".join(refused)
        whys = dict.fromkeys(w for k in refused if (w := schema.TABLE.policy(k).resume.why))
        why = f" ({'; '.join(whys)})" if whys else ""
        raise UserError(f"resuming at step {step} with settings that change the run: {listed}{why}; to continue on "
                        f"purpose set --config.train.allow_changed={keys}, or use a new --workdir (with "
                        f"--config.init_checkpoint={workdir} to start from its weights)")
    logging.warning("resuming at step %d with changed settings (train.allow_changed): %s", step,
                    "; ".join(f"{k}: {show(old)} -> {show(new)}" for k, (old, new) in found.items()))
    if writer is not None:
        writer.write_event(step, "resume", {"changed": {k: {"old": old, "new": new}
                                                        for k, (old, new) in found.items()}})


def show(value: Any) -> str:
    """A setting's value as a user writes it: strings bare, the rest as JSON."""
    return json.dumps(value) if not isinstance(value, str) else value
