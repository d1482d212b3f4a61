"""The whole global batch inside a replica step, for losses and metrics that compare examples with each other.

A contrastive loss (InfoNCE, CLIP, SimCLR, a dual encoder's in-batch negatives, a softmax sampled from the
batch) scores each example against the *other* examples of its batch. On N replicas each replica holds
B / N of them: scored against those alone, N replicas train another model than 1 replica does (fewer
negatives), silently. `gather_global_batch` gives every replica all B rows, in replica order, and the row
where its own start, so the loss can find its positives:

    documents, offset = mwloop.gather_global_batch(outputs["document"])  # [B, d], int32 scalar
    logits = tf.matmul(outputs["query"], documents, transpose_b=True)  # [b, B]
    labels = offset + tf.range(tf.shape(logits)[0])  # query i's document is row offset + i
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)  # per example: mwloop divides by B

Why the gradient is right: the gradient of `ctx.all_gather` (TensorFlow's) sends each replica the gradient of
its own rows summed over every replica's loss. Each replica's loss is its examples' sum divided by the
*global* batch size (mwloop's scaling), so that sum is the gradient of the global mean loss with respect to
those rows, and the replicas' gradients add up (`apply_gradients`) to what 1 replica computes on the whole
batch (tests/test_gather.py measures it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

from mwloop.task import TaskError


class GlobalBatch(NamedTuple):
    """What `gather_global_batch` returns (a pair: `rows, offset = ...`).

    Attributes:
      rows: the values' structure, each tensor with the rows of every replica concatenated in replica order
        (replica 0's first): [B, ...] for a per-replica [b, ...].
      offset: int32 scalar, the index in `rows` of this replica's first row (replica r's rows are
        rows[offset:offset + b]); 0 on one replica.
    """
    rows: Any
    offset: tf.Tensor


def gather_global_batch(values: Any) -> GlobalBatch:
    """Every replica's rows of `values` (a tensor, or a dict/list/tuple of tensors with the same first
    dimension), and where this replica's rows start among them.

    Call it in replica context: in a task's `loss`, `compute_loss`, `metric_sums`, `train_step` or
    `eval_step`. Every replica must call it, the same number of times in the same order (it is a collective).
    Gradients flow through it (see the module docstring).

    - One replica (the default and one_device strategies, one worker of parameter servers without GPUs):
      returns `values` itself and offset 0, with no collective.
    - MirroredStrategy, MultiWorkerMirroredStrategy: one `all_gather` per dtype of the values (a call
      mixing float embeddings and int ids fails in its backward pass under MultiWorkerMirroredStrategy),
      plus one of the row counts (replicas may hold different numbers of rows: a partial last eval batch of
      a task's own `eval_dataset`). A tensor straight from the input has no device under
      MultiWorkerMirroredStrategy, which makes TensorFlow's `all_gather` fail with "destinations can not be
      empty": each value is placed on this replica's device first (an identity).
    - ParameterServerStrategy: each scheduled step is one whole update of one worker (its batch is the global
      batch), and workers never share a step, so there is nothing to gather across workers: the rows are
      that step's batch (gathered over the worker's local replicas if it has several GPUs).

    Args:
      values: this replica's rows: a tensor of rank >= 1, or a nest of them (`tf.nest`).
    Returns:
      `GlobalBatch(rows, offset)`: `rows` has the structure of `values`.
    Raises:
      TaskError: called in cross-replica context, or inside a nested tf.function (an XLA-compiled step:
        `config.jit_compile`) on several replicas (TensorFlow's tracing then wraps it: a traceback ending in
        this error); a value of rank 0; values with different static numbers of rows.
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        raise TaskError("mwloop.gather_global_batch was called in cross-replica context; call it in replica "
                        "context: a task's loss, compute_loss, metric_sums, train_step or eval_step")
    flat = [tf.convert_to_tensor(value) for value in tf.nest.flatten(values)]
    _check_rows(flat)
    if context.num_replicas_in_sync == 1:
        return GlobalBatch(tf.nest.pack_sequence_as(values, flat), tf.constant(0, tf.int32))
    placed = [_on_replica_device(value) for value in flat]
    try:
        gathered = _all_gather_by_dtype(context, placed)
        counts = context.all_gather(_on_replica_device(tf.shape(placed[0], out_type=tf.int32)[:1]), axis=0)
    except RuntimeError as error:
        if "merge_call" not in str(error):
            raise
        raise TaskError("mwloop.gather_global_batch ran inside a nested tf.function on several replicas, where "
                        "TensorFlow cannot run collectives (config.jit_compile=True compiles the forward pass in "
                        "one); set jit_compile=False, and call it from the task's methods, not a tf.function of "
                        "your own") from None
    offset = tf.reduce_sum(counts[:context.replica_id_in_sync_group])
    return GlobalBatch(tf.nest.pack_sequence_as(values, gathered), offset)


def _check_rows(flat: list[tf.Tensor]) -> None:
    if not flat:
        raise TaskError("mwloop.gather_global_batch got no tensors; pass a tensor or a nest of tensors")
    for value in flat:
        if value.shape.rank == 0:
            raise TaskError(f"mwloop.gather_global_batch got a scalar ({value.dtype.name}); it gathers rows: pass "
                            f"values of shape [batch, ...] (tf.reshape(x, [1]) for one number per replica)")
    rows = {int(v.shape[0]) for v in flat if v.shape.rank is not None and v.shape[0] is not None}
    if len(rows) > 1:
        raise TaskError(f"mwloop.gather_global_batch got values with {sorted(rows)} rows; gather values of one "
                        f"batch together (one row per example), others in a call of their own")


def _all_gather_by_dtype(context: tf.distribute.ReplicaContext, values: list[tf.Tensor]) -> list[tf.Tensor]:
    """`context.all_gather(values, axis=0)` with one call per dtype. The gradient of one call all-reduces its
    values' gradients packed into one tensor: under MultiWorkerMirroredStrategy a call of float embeddings and
    int ids fails in the backward pass (TypeError: ConcatV2 ... [float32, int32])."""
    by_dtype: dict[tf.DType, list[int]] = {}
    for index, value in enumerate(values):
        by_dtype.setdefault(value.dtype, []).append(index)
    gathered: list[tf.Tensor] = [None] * len(values)  # type: ignore[list-item]
    for indices in by_dtype.values():
        for index, rows in zip(indices, context.all_gather([values[i] for i in indices], axis=0)):
            gathered[index] = rows
    return gathered


def _on_replica_device(value: tf.Tensor) -> tf.Tensor:
    """`value` with a device: an identity in this replica's device scope (strategy.run sets it). A tensor
    with no device (one straight from a MultiWorkerMirroredStrategy input) cannot be all-gathered."""
    return tf.identity(value)
