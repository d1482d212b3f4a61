"""Helpers for unit tests of a user's task and step functions.

Typical use (pytest):

    # conftest.py, before anything starts TensorFlow's runtime
    import mwloop.testing
    mwloop.testing.split_cpu(2)

    # test_my_task.py
    def test_two_replicas_equal_one():
        task = MyTask(my_config.get_config())
        figures = mwloop.testing.assert_replicas_agree(task, global_batch, num_replicas=2)
        mwloop.testing.assert_loss_scaled_by_global_batch(task, global_batch, num_replicas=2)

The checks run the task's real per-replica train step (mwloop's, or the task's
own `train_step`) as the loop runs it: on 1 replica with the whole global batch
and on N replicas (logical CPU devices) with consecutive slices of it, from the
same initial weights. Randomness inside the step (dropout) and per-replica
statistics (BatchNormalization, unless synchronized) legitimately differ
between the two; test with them off.

What N replicas must agree on with 1, whatever the optimizer: the gradient the optimizer is given (the
cross-replica sum, measured as one update of plain SGD, which is the gradient), the loss and every reported
metric. The weights after the steps are compared too when the optimizer is SGD (linear in the gradient, so
float noise stays float noise); an adaptive optimizer (Adam, Lion, ...) turns float noise in a gradient that
is zero in theory into full-size steps (Adam's first step is ~lr x sign(g)), so its weights are reported,
not compared.

The step on 1 and N replicas is replica_steps.py's, the likely causes of a difference diagnosis.py's; their
public names are importable from here, where users import them.
"""

from __future__ import annotations

from typing import Any

from mwloop.task import Task
from mwloop.testing.diagnosis import GATHER as GATHER
from mwloop.testing.diagnosis import _diagnose
from mwloop.testing.diagnosis import diagnose as diagnose
from mwloop.testing.replica_steps import SUM as SUM
from mwloop.testing.replica_steps import StepResult as StepResult
from mwloop.testing.replica_steps import _sgd_probe, _updates, relative_difference, train_steps
from mwloop.testing.replica_steps import distribute_batch as distribute_batch
from mwloop.testing.replica_steps import replica_strategy as replica_strategy
from mwloop.testing.replica_steps import split_cpu as split_cpu


def assert_replicas_agree(task: Task, global_batch: Any, *, num_replicas: int = 2, num_steps: int = 1,
                          rtol: float = 1e-5, seed: int = 0) -> dict[str, float]:
    """Asserts that the task's real step (mwloop's, through `compute_loss`, or its own `train_step`) on
    `num_replicas` x B/N trains like 1 replica x B, from the same initial weights, on what N replicas must agree
    on whatever the optimizer, each to `rtol`:

    - the gradients: the gradient the optimizer is given (the replicas' gradients summed across replicas)
      against the 1-replica gradient of the whole batch, from one update of the real step with plain SGD (an
      update is then -lr x that gradient), before an adaptive optimizer could turn float noise into full-size
      steps; the figure `assert_loss_scaled_by_global_batch` returns (g_N = r x g_1 + a residual:
      max(|r - 1|, |residual| / |g_1|));
    - the loss and every reported metric of the last of `num_steps` steps with the task's own optimizer
      (relative to the 1-replica value);
    - `weights` after those steps (the largest difference relative to the largest weight), when the optimizer
      is SGD. Any other (Adam, Lion, ...) divides each gradient by its own scale: float noise of 1e-9 in a
      gradient that is zero in theory becomes a full-size step (Adam's first is ~lr x sign(g)), so with them
      the figure is returned but not compared.

    Fails too if the step did not move the weights. On failure the message names the likely cause (`diagnose`).

    Returns:
      The figures: `weights` and one per reported metric (the gradients' is
      `assert_loss_scaled_by_global_batch`'s; a failure's message shows it as `gradients`).
    """
    initial = train_steps(task, global_batch, num_replicas=1, num_steps=0, seed=seed).weights
    single = train_steps(task, global_batch, num_replicas=1, num_steps=num_steps, seed=seed)
    multi = train_steps(task, global_batch, num_replicas=num_replicas, num_steps=num_steps, seed=seed)
    assert relative_difference(single.weights, initial) > rtol, \
        "the step did not move the weights: nothing would be compared"
    updates = _updates(_sgd_probe(task), global_batch, num_replicas, seed, initial)
    figures = {"weights": relative_difference(multi.weights, single.weights)}
    assert multi.metrics.keys() == single.metrics.keys(), (multi.metrics.keys(), single.metrics.keys())
    for key, value in single.metrics.items():
        figures[key] = abs(multi.metrics[key] - value) / max(abs(value), 1e-12)
    compared = {"gradients": updates.difference, **figures}
    bad = {k: v for k, v in compared.items() if v > rtol and (k != "weights" or single.linear)}
    if bad:
        causes, _ = _diagnose(task, global_batch, num_replicas, seed, 1e-4, updates)
        raise AssertionError(f"{num_replicas} replicas differ from 1 by more than {rtol} (relative): {bad}; "
                             f"likely cause: {'; '.join(causes) or 'unknown (no single-step symptom)'}")
    return figures


def assert_loss_scaled_by_global_batch(task: Task, global_batch: Any, *, num_replicas: int = 2,
                                       rtol: float = 1e-6, seed: int = 0) -> float:
    """Asserts that one update of the task's real step (mwloop's, through `compute_loss`, or its own
    `train_step`) on N replicas equals the 1-replica update of the whole batch: that the replicas' gradients
    add up to the gradient of the global mean loss. Runs the step with plain SGD (one update = the gradient).

    A loss divided by the per-replica batch gives an update N times too large; one divided by each replica's
    own token count (or one part divided by the local batch) an update that is no multiple of it, and so does
    a loss whose examples see only their own replica's (in-batch negatives without a gather), which the
    per-example losses tell apart; the failure names the likely cause (and the part, for mwloop's step with
    loss parts).

    Returns:
      The largest difference of the N-replica update (the gradient) from the 1-replica one, relative to its
      norm: max(|r - 1|, |residual| / |g_1|) for g_N = r x g_1 + a residual.
    """
    updates = _updates(_sgd_probe(task), global_batch, num_replicas, seed)
    difference = updates.difference
    if difference > rtol:
        causes, local = _diagnose(task, global_batch, num_replicas, seed, rtol, updates)
        causes = [c for c in causes if "sum" not in c.split(":")[0]] or [
            f"the update is {updates.ratio:.6f}x (residual {updates.residual:.3g})"]
        what = ("the loss is not that of the global batch" if local else
                "the loss is not scaled by the global count")
        raise AssertionError(f"the {num_replicas} replicas' update differs from the 1-replica update of the global "
                             f"batch by {difference:.3g}: {what}; likely cause: {'; '.join(causes)}")
    return difference
