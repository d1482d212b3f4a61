"""The interface of a place the chief's metrics go besides metrics.jsonl, as CLU's MetricWriter; one sink per
file (tensorboard_sink.py, mlflow_sink.py), chosen by `config.writers` (writers.make_sinks)."""

from __future__ import annotations


class Sink:
    """One more place the chief's metrics go besides metrics.jsonl (the record every reader uses).

    A sink that `fallible` (a remote service) may fail: the writer warns once, stops using it for the run,
    and training goes on; metrics.jsonl still gets everything. Every hook but `write_scalars` is optional.
    `catch_up` says how a fallible sink gets what it missed, for the warning when it fails.
    """
    name = "sink"
    fallible = False
    catch_up = ""

    def start(self, events: list[dict]) -> None:
        """Before the first write: `events` are metrics.jsonl's events so far (a resumed run's history)."""

    def write_scalars(self, step: int, split: str, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def truncate_after(self, step: int) -> None:
        """The events past `step` are void (written by a process that died before its next checkpoint)."""

    def checkpointed(self, step: int) -> None:
        """A checkpoint of `step` is saved: no rerun will write the points up to `step` again."""

    def write_export(self, directory: str, step: int) -> None:
        """A SavedModel of `step` was exported to `directory`."""

    def flush(self) -> None:
        """Sends or writes what is buffered."""

    def close(self, status: str) -> None:
        """The run's process ends: "FINISHED", "FAILED" (an error) or "KILLED" (preempted, interrupted)."""
