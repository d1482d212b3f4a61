"""Fault cases of issue 31: user code that misbehaves outside the step, a reader that goes away, settings that
cannot work together. Joined to `fault_cases.CASES`."""

from __future__ import annotations

from tests import silent_server
from tests.stress.fault_harness import Case, Ctx, error, ok
from tests.stress.fault_steps import all_of, checkpoints_are, files, in_output, main, not_in_output, task_module

MISBEHAVING = "tests/misbehaving_task.py"
# A launched run that logs every step: far more than a pipe's 64 KiB once `head` has gone.
CHATTY = {"train.steps": 600, "train.steps_per_loop": 1, "train.log_every_steps": 1,
          "train.checkpoint_every_steps": 600, "train.eval_every_steps": 600}
CLI = ("\nimport argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--lr', type=float)\n"
       "args = parser.parse_args()\n")
CLI_CONFIG = "import argparse\nargparse.ArgumentParser().parse_args()\n\n\ndef get_config(arg=None):\n    return None\n"
NO_RETURN = "from mwloop.config import base\n\n\ndef get_config(arg=None):\n    config = base.base_config()\n"


def silent_tracking_server(ctx: Ctx) -> None:
    """MLFLOW_TRACKING_URI at a server that accepts connections and never answers."""
    port, _ = silent_server.start_in_thread()
    ctx.env["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{port}"


WITH_MLFLOW = "--config.writers=('tensorboard', 'mlflow')"

CASES: list[Case] = [
    # ------------------------------------------------------------------ user code outside the step
    error("config_without_return", "get_config returned None, not '--config has no value'",
          ["mwloop.main", "--config={dir}/noreturn.py", "--workdir={workdir}"], r"get_config returned None",
          setup=files({"noreturn.py": NO_RETURN})),
    error("config_calls_exit", "a config file's sys.exit(0): exit 2, naming its line",
          ["mwloop.main", "--config={dir}/exits.py", "--workdir={workdir}"],
          r"user code called sys\.exit\(0\) at .*exits\.py:2", setup=files({"exits.py": "import sys\nsys.exit(0)\n"})),
    error("task_module_exits_at_import", "a task module's sys.exit(0) at import: exit 2, not a run that looks done",
          main("--config.task=faulttasks.exits:Tiny"), r"user code called sys\.exit\(0\) at .*exits\.py",
          setup=task_module("exits", "\nimport sys\nsys.exit(0)\n")),
    # Issue 47: user code that ends the process at import, named as that module's doing with its line, exit 2.
    # The reported case: argparse at module level read mwloop's flags and printed its usage for main.py.
    error("task_module_parses_argv", "a task module's parse_args() at import: exit 2 naming its module and line, not "
          "argparse's usage of main.py", main("--config.task=faulttasks.cli:Tiny"),
          r"config\.task='faulttasks\.cli:Tiny': importing faulttasks\.cli ended the process: user code called "
          r"sys\.exit\(2\) at \S+cli\.py:\d+ \(args = parser\.parse_args\(\)\), inside argparse",
          setup=task_module("cli", CLI)),
    error("task_module_os_exit", "a task module's os._exit(3) at import (no unwinding): exit 2 naming its line",
          main("--config.task=faulttasks.hard:Tiny"),
          r"importing faulttasks\.hard ended the process: user code called os\._exit\(3\) at \S+hard\.py:\d+",
          setup=task_module("hard", "\nimport os\nos._exit(3)\n")),
    error("task_module_library_exits", "a task module calling unittest.main() at import (a library's SystemExit): "
          "exit 2 naming the module's line and the library", main("--config.task=faulttasks.tests:Tiny"),
          r"importing faulttasks\.tests ended the process: user code called sys\.exit\(2\) at \S+tests\.py:\d+ "
          r"\(unittest\.main\(\)\), inside (unittest|argparse)",
          setup=task_module("tests", "\nimport unittest\nunittest.main()\n")),
    error("config_parses_argv", "a config file's parse_args() at import: exit 2 naming its line, not argparse's usage",
          ["mwloop.main", "--config={dir}/cli_config.py", "--workdir={workdir}"],
          r"user code called sys\.exit\(2\) at \S+cli_config\.py:2 .*inside argparse",
          setup=files({"cli_config.py": CLI_CONFIG})),
    error("action_module_exits", "a config.actions module's sys.exit(1) at import: exit 2 naming it",
          main("--config.actions=('faulttasks.act:Act',)"),
          r"config\.actions='faulttasks\.act:Act': importing faulttasks\.act ended the process: user code called "
          r"sys\.exit\(1\) at \S+act\.py", setup=task_module("act", "\nimport sys\nsys.exit(1)\n")),
    error("dataset_exits", "train_arrays calls sys.exit(0): exit 2 naming its line",
          main(config=f"{MISBEHAVING}:exit_in_dataset"), r"user code called sys\.exit\(0\) at .*misbehaving_task\.py"),
    error("build_model_exits", "build_model calls sys.exit(0): exit 2 naming its line",
          main(config=f"{MISBEHAVING}:exit_in_build"), r"user code called sys\.exit\(0\) at .*misbehaving_task\.py"),
    error("own_loss_fails_in_graph", "labels out of range in the task's own cross-entropy: the method, its line, the "
          "op's complaint", main(config=f"{MISBEHAVING}:graph_loss"),
          r"task method loss failed when the step ran, at .*misbehaving_task\.py:\d+ .*label value of 2",
          fresh_stays_empty=False, check=not_in_output("Graph execution error")),
    error("nan_in_one_loss_part", "names the part (loss/aux) and its data as well as the rate",
          main(config=f"{MISBEHAVING}:nan_part"), r"non-finite loss at step 1 in loss part loss/aux.*data",
          fresh_stays_empty=False),
    # ------------------------------------------------------------------ a reader that goes away
    ok("launch_piped_to_head", "launch 2>&1 | head -1: the job trains to its end and saves ckpt-600, exit 0",
       ["tests.stress.head_one", "mwloop.launch", "--num_workers=2", "--grace_s=10", "--",
        *main("--mode=train", base=CHATTY)[1:]],
       check=all_of(checkpoints_are(600), in_output(r"exited 0 after its reader went away")), multi=True,
       timeout=300),
    # ------------------------------------------------------------------ settings that cannot work together
    error("ps_with_deterministic", "parameter servers with config.deterministic=True: refused before anything starts",
          ["mwloop.launch", "--num_workers=1", "--num_ps=1", "--", *main("--mode=train",
                                                                          "--config.deterministic=True")[1:]],
          r"deterministic=True does not work with parameter servers", multi=True, check=not_in_output(r"restart 1/")),
    error("allow_changed_unknown_key", "an unknown key in train.allow_changed is an error naming the nearest key",
          main("--config.train.allow_changed=train.stepz"), r"allow_changed names 'train\.stepz'.*nearest valid key: "
          r"train\.steps"),
    error("mlflow_scheme_misspelt", "MLFLOW_TRACKING_URI=htp://...: an error at start",
          main(WITH_MLFLOW), r"unknown scheme 'htp'", env={"MLFLOW_TRACKING_URI": "htp://127.0.0.1:5000"},
          fresh_stays_empty=False),
    ok("mlflow_server_never_answers", "a tracking server that never answers: 5 s, a warning naming its /health, "
       "training goes on", main(WITH_MLFLOW), setup=silent_tracking_server,
       check=all_of(checkpoints_are(20, 40), in_output(r"no answer from the MLflow tracking server at "
                                                       r"http://127\.0\.0\.1:\d+/health within 5 s"))),
]
