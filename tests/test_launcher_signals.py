"""The launcher's signal handler (mwloop.launcher.attempt.on_signal): a SIGTERM, SIGHUP or Ctrl-C ends the job
even when Python drops the exception the handler raised. CPython runs a handler wherever the main thread is; one
that raises inside a __del__, a weakref callback or a fork hook (a subprocess started with preexec_fn runs
os.register_at_fork's, logging's among them) is printed as "ignored" and lost. Found in a loaded suite run: a
SIGTERM that landed while the launcher started a round's workers was lost, and the job trained on."""

from __future__ import annotations

import contextlib
import signal

import pytest

from mwloop.launcher import attempt
from mwloop.launcher.attempt import Terminated


@contextlib.contextmanager
def launcher_handlers():
    """The launcher's own handlers (mwloop.launch installs them) for SIGTERM and SIGINT, restored after."""
    previous = {s: signal.signal(s, attempt.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    attempt.forget_signals()
    try:
        yield
    finally:
        attempt.forget_signals()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class SignalledWhileCollected:
    """Sends `signum` to this process from its __del__: the handler's exception is raised inside it, and dropped."""

    def __init__(self, signum: int):
        self.signum = signum

    def __del__(self):
        signal.raise_signal(self.signum)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("signum,raised", [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_whose_exception_python_dropped_is_raised_at_the_launchers_next_wait(signum, raised):
    with launcher_handlers():
        SignalledWhileCollected(signum)  # collected at once: the signal came and its exception was dropped
        with pytest.raises(raised):
            attempt.pause(0)
        with pytest.raises(raised):  # until an `except` acts on it
            attempt.pause(0)
        attempt.forget_signals()
        attempt.pause(0)


def test_a_signal_raised_where_it_lands_is_not_an_error_to_log_and_carry_on_from():
    """`except Exception` (ours, a library's, logging's handleError) must not take the launcher's end."""
    with launcher_handlers():
        with pytest.raises(Terminated):
            try:
                signal.raise_signal(signal.SIGTERM)
            except Exception:  # the kind of handler a library has
                pytest.fail("an `except Exception` took SIGTERM's Terminated")


def test_the_launcher_leaves_a_hangup_or_ctrl_c_ignored_from_the_start_ignored():
    """`nohup python -m mwloop.launch ...` must outlive its terminal, as Python leaves a background job's
    SIGINT ignored; SIGTERM is always the launcher's."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        replaced = attempt.handle_signals()
        assert set(replaced) == {signal.SIGTERM}
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN == signal.getsignal(signal.SIGINT)
        assert signal.getsignal(signal.SIGTERM) is attempt.on_signal
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        assert set(attempt.handle_signals()) == {signal.SIGTERM, signal.SIGHUP, signal.SIGINT}
        assert all(signal.getsignal(s) is attempt.on_signal for s in before)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_dropped_signal_is_raised_again_in_the_main_thread_only():
    """A sweep's agents wait in threads of their own: the Ctrl-C is the main thread's to act on."""
    import threading
    with launcher_handlers():
        SignalledWhileCollected(signal.SIGINT)
        raised_in_thread: list[BaseException] = []

        def wait() -> None:
            try:
                attempt.pause(0)
            except BaseException as e:  # what the thread saw is the test's subject
                raised_in_thread.append(e)
        thread = threading.Thread(target=wait)
        thread.start()
        thread.join()
        assert raised_in_thread == []
        with pytest.raises(KeyboardInterrupt):
            attempt.pause(0)
