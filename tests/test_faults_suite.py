"""A fast subset of the fault suite (`python -m tests.stress.faults`): real `python -m mwloop...`
processes with bad input or an injected fault, each classified by the suite's own runner and
expected to pass. Single-process cases only; the whole suite (multi-worker, signals) is run by hand."""

import pytest

from tests.stress import fault_cases, faults

pytestmark = pytest.mark.slow  # real `python -m mwloop...` processes, each case (the fault suite)

FAST = (
    "unknown_override_key",  # a typo in an override: one line with the suggestion
    "train_steps_0",  # a value that cannot work: one line, nothing written
    "tf_config_garbage",  # a malformed cluster description
    "task_import_unresolved",  # a task import string that does not resolve
    "export_empty_workdir",  # --mode=export of a workdir that never trained
    "checkpoints_is_a_file",  # a file in the way of the checkpoint directory
    "workdir_is_a_file",  # a file in the way of the workdir itself (a traceback once the Trainer came)
    "task_empty_train_arrays",  # a task error before anything is written (config.json was, once)
    "truncated_latest_checkpoint",  # falls back to the previous checkpoint and resumes
    "sweep_unknown_key",  # a sweep point's typo stops the sweep before it runs
    # issue 23 (no root needed): changed settings on resume, planted files, remote schemes, eval data, side-car
    "resume_other_batch",  # another global batch on resume: refused naming 64 -> 128 and allow_changed
    "resume_past_train_steps",  # a checkpoint past train.steps: an error, nothing exported
    "lock_symlink_to_victim",  # a planted .lock link: refused, its target untouched
    "metrics_dangling_symlink",  # a planted metrics.jsonl link: refused, nothing created through it
    "name_escapes_runs",  # config.name cannot take the default workdir out of runs/
    "s3_unsupported",  # an unknown scheme: one line, no local s3: directory
    "eval_nan_input",  # NaN eval loss: strict JSON null + flag, warned once
    "fsize_limit_final_export",  # an export over the file-size limit: one line; the last good export serves
)
CASES = {case.name: case for case in fault_cases.CASES}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict:
    """The suite runner's cache across cases, as `python -m tests.stress.faults` keeps it: a setup's trained
    workdir (`fault_steps.trained`) is trained once per test process and copied into each case that starts
    from it, instead of one training process per case. Here `mwloop.main` runs are forked from a warm server
    (none of these cases is about TensorFlow's start-up); the whole suite by hand starts them fresh."""
    return {"base": str(tmp_path_factory.mktemp("fault_cases_shared")), "warm_forks": True}


def test_the_fast_cases_exist_and_are_single_process():
    assert all(name in CASES and not CASES[name].multi for name in FAST)


@pytest.mark.parametrize("name", FAST)
def test_fault_case_passes(name, tmp_path, shared):
    outcome = faults.run_case(CASES[name], str(tmp_path), shared, timeout=120)
    assert outcome.passed, faults.failures([outcome])
