"""Gradient accumulation: one optimizer update per k micro-batches, on every strategy.

Keras' own `gradient_accumulation_steps` accumulates inside a `tf.cond` of the optimizer, which cannot hold
the cross-replica sum of the gradients under tf.distribute. Here the train loop does it
(`mwloop.loop.update.Accumulated`, built by the one step builder): each replica sums its gradients over k micro-
batches locally (a `tf.while_loop` of `strategy.run`, no cross-replica traffic), then one
`optimizer.apply_gradients` sums them across replicas and applies one update. The accumulators are loop-local
tensors, never variables: a loop call ends on an update boundary, so a checkpoint never holds a half-filled
accumulator and resume needs nothing new.

`config.train.global_batch_size` (B) stays the effective global batch of one update; a replica's micro-batch
holds B / (replicas x k) examples. The update equals one step on the whole effective batch:

- losses without weights (or with `loss_normalization="batch"`): each micro-batch's loss is divided by the
  effective global count, so the summed gradients are those of the global mean loss as they are;
- `loss_normalization="weights"` (or a loss part with normalizer "weights"): the normaliser is the global
  weight sum over all k micro-batches, known only after the last one. Each micro-batch's weighted loss is
  divided by the constant global count instead, and at the update the summed gradients are multiplied by
  global count / (all-reduced weight sum): one all-reduce per update, of every such part's weight sum. Each
  such part, and the rest (other parts, the model's regularization losses), which must not be rescaled by
  it, then get gradients of their own (a persistent tape; only when there are several: `steps.Retrace`).

Regularization losses are added divided by k (and by the replicas, `tf.nn.scale_regularization_loss`): the
k micro-batches of every replica add up to one penalty. The step counter, the learning-rate schedule and
every interval count optimizer updates.
"""
