"""The progress line of a run in a terminal: step, loss, examples/s and ETA, redrawn in place below the log.

Keras, Lightning and big_vision show one; a person watching a run sees it move at every loop call, not only at
the log steps. It is drawn only once a command turned it on (`enable`, called by `mwloop.launcher.console` when
stderr is a terminal): piped output, files and the launcher's workers (their output is a pipe) get the log
lines alone, one line per event, and the Python API draws nothing.

Log lines and prints still go out while the line is drawn: `enable` puts sys.stdout and sys.stderr behind
`_AboveTheLine`, which clears the line, writes whole lines, and redraws it below them (tqdm's
`external_write_mode`). The line is `LogTrain`'s (run/actions.py): made when training starts, fed by every loop
call, cleared when training ends or raises.
"""

from __future__ import annotations

import datetime
import io
import os
import sys
import threading
from typing import Any, TextIO

# Where the line is drawn, once enabled.
_terminal: TextIO | None = None
# The tqdm bar while a line is shown (one at a time).
_drawn: list[Any] = []
_lock = threading.Lock()


def enable() -> bool:
    """Turns the progress line on when stderr is a terminal (not TERM=dumb): sys.stdout and sys.stderr then
    write above it (callers repoint handlers that hold the old sys.stderr).

    Returns:
        Whether it is on.
    """
    global _terminal
    if _terminal is not None:
        return True
    if not _isatty(sys.stderr) or os.environ.get("TERM") == "dumb":
        return False
    _terminal = sys.stderr
    sys.stderr = _AboveTheLine(sys.stderr)
    # The same screen: a print would overwrite the line.
    if _isatty(sys.stdout):
        sys.stdout = _AboveTheLine(sys.stdout)
    return True


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class ProgressLine:
    """One run's line: `step 300/600 ███████████          50%, loss 0.0008, 4453 examples/s, ETA 0:00:12`."""

    def __init__(self, step: int, total: int):
        from tqdm import tqdm
        self._total = total
        # The terminal's own encoding: the wrapped streams (closed_output's, ours) do not say theirs to tqdm.
        unicode = (getattr(sys.__stderr__, "encoding", None) or "").lower().replace("-", "") == "utf8"
        self._bar = tqdm(total=total, initial=step, file=_terminal, leave=False, ncols=_columns(), ascii=not unicode,
                         desc=f"step {step}/{total}", bar_format="{desc} {bar} {percentage:3.0f}%{postfix}")
        _drawn[:] = [self._bar]

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Redraws the line at `step` with the window's `loss`, `examples_per_sec` and `eta_s`."""
        eta = datetime.timedelta(seconds=round(metrics["eta_s"]))
        self._bar.n, self._bar.ncols = step, _columns()
        self._bar.set_description_str(f"step {step}/{self._total}", refresh=False)
        # Formatted as the log line formats it.
        loss = f"{metrics['loss']:.4g}" if abs(metrics["loss"]) >= 1e4 else f"{metrics['loss']:.4f}"
        self._bar.set_postfix_str(f"loss {loss}, {metrics['examples_per_sec']:.0f} examples/s, ETA {eta}",
                                  refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        """Clears the line; text held back while it was drawn (a line without its newline yet) goes out."""
        with _lock:
            _drawn.clear()
            self._bar.close()
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, _AboveTheLine):
                stream.release()


def _columns() -> int:
    """The line's width: the terminal's (it may change) less two columns, which an echoed ^C fills without
    wrapping the line (a wrapped line is no longer redrawn in place)."""
    try:
        return max(os.get_terminal_size(_terminal.fileno()).columns - 2, 20)
    except (AttributeError, OSError, ValueError):
        return 78


def line(step: int, total: int) -> ProgressLine | None:
    """A progress line from `step` of `total`, or None where none is drawn (not enabled, or no steps left).

    Args:
        step: the step training starts at (a resumed run starts past 0).
        total: config.train.steps.
    Returns:
        The line, drawn at once; close it when training ends.
    """
    if _terminal is None or step >= total:
        return None
    return ProgressLine(step, total)


class _AboveTheLine(io.TextIOBase):
    """sys.stdout or sys.stderr with a progress line drawn on the terminal: whole lines go out above it.

    A write without its newline yet (print writes the text, then "\\n") is held until the newline comes, or
    the line is closed, so the redrawn line never lands in the middle of it. With no line drawn, writes go
    straight through.
    """

    def __init__(self, inner: TextIO):
        super().__init__()
        self._inner, self._held = inner, ""

    def write(self, text: str) -> int:
        if not _drawn:
            return self._inner.write(text)
        from tqdm import tqdm
        with _lock:
            self._held += text
            whole, newline, self._held = self._held.rpartition("\n")
            if newline:
                with tqdm.external_write_mode(file=_terminal):
                    self._inner.write(whole + newline)
                    self._inner.flush()
        return len(text)

    def release(self) -> None:
        """Writes what was held back."""
        with _lock:
            held, self._held = self._held, ""
        if held:
            self._inner.write(held)
            self._inner.flush()

    def flush(self) -> None:
        self._inner.flush()

    def fileno(self) -> int:
        return self._inner.fileno()

    def isatty(self) -> bool:
        return self._inner.isatty()

    # The inner stream's, where io.TextIOBase would say None.
    @property
    def encoding(self) -> str:
        return getattr(self._inner, "encoding", None) or getattr(sys.__stderr__, "encoding", None) or "utf-8"

    # The inner stream's other attributes: errors, buffer, line_buffering...
    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
