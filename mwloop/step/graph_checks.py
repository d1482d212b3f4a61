"""Data checks inside the graph whose failure is one line, not a graph-execution traceback.

A value that only the data reveals (a label outside the model's classes, in a
stream of TFRecords) can only be checked where it is computed: in the step.
`assert_labels_in_range` adds that check (a tf.debugging.Assert with a message
that names the first bad value and the range); `one_line_errors` turns the
InvalidArgumentError it raises, wherever in the loop it surfaces, into a
UserError carrying that message (exit 2: the data would fail the same way on
a restart). A task's own checks can use `check(condition, message_tensor)` the same way.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import tensorflow as tf

from mwloop.errors import UserError

MARK = "mwloop data check: "
_MESSAGE = re.compile(re.escape(MARK) + r"([^\]\n]*)")


class DataCheckError(UserError):
    """A value in the data that the model cannot take (named with its range)."""


def check(condition: tf.Tensor, message: tf.Tensor | str) -> tf.Operation:
    """Fails the step with `message` (a string tensor may name values) when `condition` is False."""
    return tf.debugging.Assert(condition, [tf.strings.join([MARK, message])], summarize=1)


LABEL_RANGE = "label outside the model's classes; value, classes:"
# What a failed Assert prints: "[<MARK><LABEL_RANGE>] [value] [classes]".
_LABEL = re.compile(re.escape(MARK + LABEL_RANGE) + r"\] \[(-?\d+)\] \[(\d+)\]")


def assert_labels_in_range(labels: tf.Tensor, num_classes: tf.Tensor) -> tf.Tensor:
    """`labels` (int) once every one is in [0, num_classes); else the step fails naming the first bad one.

    The Assert carries a constant message and the numbers as tensors (no string formatting in the graph),
    so the step still compiles with XLA, which drops the check.
    """
    flat = tf.reshape(labels, [-1])
    num_classes = tf.cast(num_classes, flat.dtype)
    bad = tf.logical_or(flat < 0, flat >= num_classes)
    first_bad = tf.gather(flat, tf.argmax(tf.cast(bad, tf.int32)))  # only read when there is one
    assertion = tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad)), [MARK + LABEL_RANGE, first_bad, num_classes],
                                    summarize=1)
    with tf.control_dependencies([assertion]):
        return tf.identity(labels)


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """A failed data check inside the block (an InvalidArgumentError carrying MARK) becomes a DataCheckError."""
    try:
        yield
    except tf.errors.InvalidArgumentError as e:
        text = (getattr(e, "message", "") or str(e)).replace("\\'", "'")  # a string tensor's escaped quotes
        label = _LABEL.search(text)
        if label:
            value, classes = int(label[1]), int(label[2])
            raise DataCheckError(f"label {value} is outside the model's {classes} classes (0..{classes - 1}); check "
                                 f"the data or the model's number of classes (config.dataset.num_classes)") from None
        found = _MESSAGE.search(text)
        if not found:
            raise
        raise DataCheckError(found[1].strip()) from None
