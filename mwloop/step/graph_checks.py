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
import linecache
import os
import re
from collections.abc import Iterator

import tensorflow as tf

from mwloop.errors import DATA_CHECK_MARK, UserError, is_user_file

MARK = DATA_CHECK_MARK
_MESSAGE = re.compile(re.escape(MARK) + r"([^\]\n]*)")


class DataCheckError(UserError):
    """A value in the data that the model cannot take (named with its range)."""


class UserOpError(UserError):
    """An op of the task's own code failed when the step ran (named with the task method and the user's line)."""


# A frame of the "defined at (most recent call last):" trace TensorFlow puts in a graph execution error.
_DEFINED_AT = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def user_op_error(text: str) -> str | None:
    """One line for a graph execution error raised by an op the user's code defined: the task method, the
    user's file:line, the op's own complaint and what to check; None when no user frame defined the op."""
    _, found, trace = text.partition("defined at (most recent call last):")
    if not found:
        return None
    frames = [(path, int(line), name) for path, line, name in _DEFINED_AT.findall(trace)
              if is_user_file(path)]
    if not frames:
        return None
    path, line, method = frames[-1]
    code = linecache.getline(path, line).strip() or linecache.getline(os.path.abspath(path), line).strip()
    complaint = next((row.strip() for row in reversed(trace.splitlines())
                      if row.strip() and not row.strip().startswith(("File ", "[[", "Node:")) and
                      not row.startswith("    ")), "")
    # The complaint's first sentence, without the node: not every value the op printed.
    complaint = re.sub(r"\s*\[\[\{\{node.*", "", complaint).split(".  ")[0].rstrip(".")[:300]
    return (f"task method {method} failed when the step ran, at {path}:{line} ({code}): {complaint}; check the "
            f"values its inputs get (label ranges, shapes, indices) against what that op expects")


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
    # The first label out of range; only read when there is one.
    first_bad = tf.gather(flat, tf.argmax(tf.cast(bad, tf.int32)))
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
        # Undo a string tensor's escaped quotes.
        text = (getattr(e, "message", "") or str(e)).replace("\\'", "'")
        label = _LABEL.search(text)
        if label:
            value, classes = int(label[1]), int(label[2])
            raise DataCheckError(f"label {value} is outside the model's {classes} classes (0..{classes - 1}); check "
                                 f"the data or the model's number of classes (config.dataset.num_classes)") from None
        found = _MESSAGE.search(text)
        if not found:
            line = user_op_error(text)
            if line:
                raise UserOpError(line) from None
            raise
        raise DataCheckError(found[1].strip()) from None
