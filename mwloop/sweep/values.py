"""What both sides of a sweep share: its error, its override dicts and their text.

The input side (space, plan, study, runner, agent) checks and runs trials; the output side (report, plots,
hparams) shows them. Both raise SweepError and write values with `format_value` (a grid point's directory
name and its row in results.md spell a value the same way), so these live here, in a leaf that imports
nothing of the sweep, and the input side never imports the output side.
"""

from __future__ import annotations

import re
from typing import Any

from mwloop import errors

# One trial's overrides: config path ("optimizer.learning_rate") -> value.
Overrides = dict[str, Any]


class SweepError(errors.UserError):
    """A sweep that cannot run as written; the message is one actionable line (exit 2)."""


def format_value(value: Any) -> str:
    """A short, exact text for a config value: 0.0005, 5e-05, 16x32, true."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    if isinstance(value, (tuple, list)):
        return "x".join(format_value(v) for v in value)
    return str(value)


def redact(url: str) -> str:
    """A storage URL without its password, for messages."""
    return re.sub(r"//([^:/@]+):[^@/]*@", r"//\1:***@", url)
