"""Hooks: the policies around a run's loop calls, saves and sections that are not actions.

An action runs *between* loop calls, when it is due. A hook is told of what happens anyway, at every such
moment: a loop call starting and ending, a save about to be written, a timed section (a save, an eval, an
export), the start of training and the end of the run. `build_run` registers them (the goodput clock, the
non-finite guard); the controller and the Trainer call `Hooks`, never a policy by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, ContextManager, Iterator, Sequence


@dataclasses.dataclass(frozen=True)
class LoopCall:
    """One loop call, as it ended.

    Attributes:
      first_step, end_step: it trained steps [first_step, end_step).
      started, seconds: when it began (time.perf_counter) and how long it took.
      sums: the steps' sums, reduced over every replica (Python floats).
      status: the loop's non-finite status (`loops.make_train_loop` documents its keys).
    """
    first_step: int
    end_step: int
    started: float
    seconds: float
    sums: dict[str, float]
    status: dict[str, float]


class Hook:
    """A policy told of the run's moments; define only the methods it needs (the others cost nothing)."""

    def loop_built(self, train_loop: Callable) -> None:
        """The train loop exists (built once, at the first `train` with steps to run)."""

    def train_started(self, step: int, dropped_events: list[dict]) -> None:
        """Training starts at `step`; `dropped_events`: metrics.jsonl's events past the restored checkpoint
        (work of an earlier attempt that was never saved)."""

    def before_call(self, step: int, started: float) -> None:
        """A loop call starts at `step` (at `started`, time.perf_counter); it may never return."""

    def after_call(self, call: LoopCall) -> None:
        """A loop call returned (raise to end training: e.g. a non-finite loss)."""

    def before_save(self, step: int) -> None:
        """The rotating checkpoint of `step` is about to be written (raise to refuse it)."""

    def before_best_save(self, step: int) -> None:
        """The best checkpoint of `step` is about to be written (raise to refuse it)."""

    def section(self, cause: str) -> ContextManager[None]:
        """A context around work between loop calls: "checkpoint", "eval", "export"."""
        return contextlib.nullcontext()

    def closing(self, step: int) -> None:
        """The run ends at `step` (on errors too): the last moment its writer is open. Never raises."""


class Hooks:
    """The run's hooks, called in registration order; each moment only reaches the hooks that define it."""

    def __init__(self, hooks: Sequence[Hook]):
        self.hooks = list(hooks)
        self._defining = {name: [getattr(h, name) for h in self.hooks if getattr(type(h), name) is not
                                 getattr(Hook, name)] for name in vars(Hook) if not name.startswith("_")}

    def loop_built(self, train_loop: Callable) -> None:
        for method in self._defining["loop_built"]:
            method(train_loop)

    def train_started(self, step: int, dropped_events: list[dict]) -> None:
        for method in self._defining["train_started"]:
            method(step, dropped_events)

    def before_call(self, step: int, started: float) -> None:
        for method in self._defining["before_call"]:
            method(step, started)

    def after_call(self, call: LoopCall) -> None:
        for method in self._defining["after_call"]:
            method(call)

    def before_save(self, step: int, *, best: bool = False) -> None:
        for method in self._defining["before_best_save" if best else "before_save"]:
            method(step)

    @contextlib.contextmanager
    def section(self, cause: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for method in self._defining["section"]:
                stack.enter_context(method(cause))
            yield

    def closing(self, step: int) -> None:
        for method in self._defining["closing"]:
            method(step)
