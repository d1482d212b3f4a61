"""Fault cases of issue 31: tasks that disagree on the run (mwloop.cluster.agreement). Joined to `fault_cases.CASES`.

A skewed deploy is a config file that reads the environment: `skew.py` is configs/mlp.py, with the dotted-key
overrides in $AGREE_WORKER1 applied on TF_CONFIG's task 1 only. Before issue 31 a batch of 48 against 64 trained
on with exit 0 (every update divided by the wrong count) and another model died in a collective `Shape mismatch`
traceback; now every task exits 2 with one line naming worker 1, the keys, both values and the fix, and the
workdir stays empty.

Issue 47: what a task takes from its machine rather than its config (`skew_env.py`): workers told of different
clusters aborted the first all-reduce with a CollectiveReduceV2 traceback on both (exit 1); another Keras trained
on (exit 0). Now compared before the first collective, one line on every task, exit 2.
"""

from __future__ import annotations

from tests.stress.fault_harness import Case, error, ok
from tests.stress.fault_steps import (
    LAUNCHED,
    TASK,
    all_of,
    files,
    in_output,
    main,
    no_new_eval,
    not_in_output,
    trained,
)

SKEW_CONFIG = '''"""configs/mlp.py, but TF_CONFIG's task 1 applies the overrides in $AGREE_WORKER1 (a skewed deploy)."""
import importlib.util
import json
import os

_spec = importlib.util.spec_from_file_location("mlp_config", os.path.join(os.getcwd(), "configs", "mlp.py"))
_mlp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mlp)


def get_config(arg=None):
    config = _mlp.get_config(arg)
    if json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {}).get("index") == 1:
        config.update_from_flattened_dict(json.loads(os.environ.get("AGREE_WORKER1") or "{}"))
    return config
'''


# Issue 47: what a task takes from its machine rather than its config. On TF_CONFIG's task 1, $SKEW_ENV1 changes
# it: "moved" (worker 1 told of itself at another address: {worker: [A, C]} against the chief's [A, B]), "extra"
# (told of a third worker), "task" (the task module found first in {dir}/alt: the same name, other code), "keras"
# (another Keras version reported, as another install would).
SKEW_ENV_CONFIG = '''"""configs/mlp.py with faulttasks.tiny:Tiny; TF_CONFIG's task 1 skews its environment."""
import importlib.util
import json
import os
import socket
import sys

_spec = importlib.util.spec_from_file_location("mlp_config", os.path.join(os.getcwd(), "configs", "mlp.py"))
_mlp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mlp)


def _free_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"localhost:{s.getsockname()[1]}"


def get_config(arg=None):
    tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    how = os.environ.get("SKEW_ENV1", "")
    if tf_config.get("task", {}).get("index") == 1 and how:
        if how == "moved":
            tf_config["cluster"]["worker"][1] = _free_address()
        elif how == "extra":
            tf_config["cluster"]["worker"].append(_free_address())
        elif how == "task":
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "alt"))
        elif how == "keras":
            import keras
            keras.__version__ = "3.0.0"
        os.environ["TF_CONFIG"] = json.dumps(tf_config)
    config = _mlp.get_config(arg)
    config.task = "faulttasks.tiny:Tiny"
    return config
'''


def env_skewed(name: str, how: str, expected: str, line: str, fix: str) -> Case:
    """Worker 1's environment skewed `how` (SKEW_ENV_CONFIG): every task prints `line` and `fix` (regexes), before
    any collective: no traceback, no CollectiveReduceV2, no step."""
    message = rf"worker 1 runs another run than the chief: {line}; {fix}"
    tiny = TASK + "\nLAYER = 1\n"
    setup = files({"skew_env.py": SKEW_ENV_CONFIG, "faulttasks/__init__.py": "", "faulttasks/tiny.py": TASK,
                   "alt/faulttasks/__init__.py": "", "alt/faulttasks/tiny.py": tiny})
    # The case's message is formatted with the case's values ({dir}, ...) before it is matched: braces doubled.
    return error(name, expected,
                 ["mwloop.launch", "--num_workers=2", "--grace_s=10", "--max_restarts=0", "--",
                  *main("--mode=train", config="{dir}/skew_env.py", base=LAUNCHED)[1:]],
                 message.replace("{", "{{").replace("}", "}}"),
                 env={"SKEW_ENV1": how},
                 check=all_of(in_output(rf"\[worker 0\] error: {message}"),
                              in_output(rf"\[worker 1\] error: {message}"),
                              not_in_output(r"Traceback|CollectiveReduceV2|\bstep \d+/")),
                 **dict(MULTI, setup=setup))


def skewed(overrides: str = "{}") -> list[str]:
    """2 workers under the launcher (no restart) on skew.py; the keys worker 1 skews are left to the config file
    (a command-line override would win over the environment's on every task)."""
    base = {k: v for k, v in LAUNCHED.items() if f'"{k}"' not in overrides}
    return ["mwloop.launch", "--num_workers=2", "--grace_s=10", "--max_restarts=0", "--",
            *main("--mode=train", config="{dir}/skew.py", base=base)[1:]]


MULTI = {"multi": True, "timeout": 180.0, "setup": files({"skew.py": SKEW_CONFIG})}
FIX = "start every task with the same config and overrides"
CLUSTER_FIX = r"give every task the same cluster in TF_CONFIG \(only its task differs\)"
INSTALL_FIX = "install the same TensorFlow, Keras, Python and mwloop on every machine"


def refused(name: str, expected: str, overrides: str, line: str) -> Case:
    """Worker 1 runs `overrides` (JSON): every task prints `line` (a regex after 'error: '), nobody trains."""
    message = rf"worker 1 runs another run than the chief: {line}; {FIX}"
    return error(name, expected, skewed(overrides), message, env={"AGREE_WORKER1": overrides},
                 check=all_of(in_output(rf"\[worker 0\] error: {message}"),
                              in_output(rf"\[worker 1\] error: {message}"),
                              not_in_output(r"Traceback|Shape mismatch|\bstep \d+/")), **MULTI)


CASES: list[Case] = [
    refused("agree_batch_mismatch", "worker 1 with global_batch_size 48, the chief 64: every task names it, exit 2",
            '{"train.global_batch_size": 48}', r"train\.global_batch_size=48 here, 64 on the chief"),
    refused("agree_model_mismatch", "worker 1 with a wider MLP: one line, not a collective Shape mismatch",
            '{"model.hidden": [64]}', r"model\.hidden=\[64\] here, \[32\] on the chief"),
    # Neighbours nobody reported: a shorter run, an eval the chief never joins, another seed, two keys at once.
    refused("agree_steps_mismatch", "worker 1 told 100 steps, the chief 200: one line before any step",
            '{"train.steps": 100}', r"train\.steps=100 here, 200 on the chief"),
    refused("agree_eval_interval_mismatch", "worker 1 evaluates every 50 steps, the chief every 100: one line "
            "before any step",
            '{"train.eval_every_steps": 50}', r"train\.eval_every_steps=50 here, 100 on the chief"),
    refused("agree_two_keys", "worker 1 with another seed and learning rate: both keys in the one line",
            '{"seed": 7, "optimizer.learning_rate": 0.5}',
            r"optimizer\.learning_rate=0\.5 here, 0\.1 on the chief; seed=7 here, 0 on the chief"),
    ok("agree_same_settings_train", "the same skew config with nothing skewed: the check passes, both train",
       skewed(), env={"AGREE_WORKER1": "{}"},
       check=all_of(in_output(r"\[worker 1\] .*every task runs the chief's settings \(\d+ keys, checked in [\d.]+ ms"),
                    in_output(r"done: steps 0 -> 6000")), **MULTI),
    # Issue 47: worker 1 told of another cluster (the reported case: an aborted CollectiveReduceV2 traceback on
    # both, exit 1), and neighbours from the environment rather than the config.
    env_skewed("agree_cluster_other_address", "moved",
               "worker 1 told of itself at another address ({worker: [A, C]} against [A, B]): one line on both "
               "before the first collective, exit 2",
               r"cluster=\{worker: \[localhost:\d+, localhost:\d+\]\} here, "
               r"\{worker: \[localhost:\d+, localhost:\d+\]\} on the chief", CLUSTER_FIX),
    env_skewed("agree_cluster_extra_worker", "extra",
               "worker 1 told of a third worker: one line naming both clusters' sizes, exit 2",
               r"cluster=\{worker: 3\} here, \{worker: 2\} on the chief", CLUSTER_FIX),
    env_skewed("agree_task_source_differs", "task",
               "worker 1 imports another faulttasks/tiny.py (same name, other code): one line naming its hash",
               r"task\.source_sha256='?[0-9a-f]{12}'? here, '?[0-9a-f]{12}'? on the chief",
               "deploy the same code of the task's module on every machine"),
    env_skewed("agree_keras_version_differs", "keras", "worker 1 runs another Keras: one line naming both versions",
               r"versions\.keras=3\.0\.0 here, \S+ on the chief", INSTALL_FIX),
    # The side-car is outside the coordination service: it compares with the run's config.json.
    error("agree_sidecar_other_eval_data", "a side-car holding out another eval fraction (silently evaluated other "
          "examples before): one line naming it; nothing appended",
          main("--mode=continuous_eval", "--config.dataset.eval_fraction=0.3", "--config.eval.continuous_timeout_s=5"),
          r"the evaluator runs another run than the chief: dataset\.eval_fraction=0\.3 here, 0\.2 in \S+config\.json",
          setup=trained(), check=no_new_eval),
]
