"""Fault cases of issue 47 item 4: sweep values that break the files a sweep writes for people. A string value
(config.name here) holding `|` and a newline (reported), shell syntax and a code fence (the reproduce command),
and mathtext (the plot) plus a column name results.csv uses itself. Each case is one sweep of one short trial;
the checks read every file back: results.md with a real Markdown parser (markdown-it, which keras brings),
results.csv with the csv module, the reproduce command through bash, the HParams session from its event file.
Joined to `fault_cases.CASES`."""

from __future__ import annotations

import csv
import glob
import os
import re
import struct
import subprocess

from tests.stress.fault_harness import Case, Ctx, Run, ok
from tests.stress.fault_steps import all_of, not_in_output

SWEEP = ["mwloop.sweep", "--sweep={dir}/s.py", "--workdir={dir}/sweep"]
SHORT = ('{"train.steps": 10, "train.steps_per_loop": 10, "train.log_every_steps": 10, "train.eval_every_steps": 10, '
         '"train.checkpoint_every_steps": 10, "export": False}')
PIPE_NEWLINE = "a|b\nc | d"
SHELL = "it's $(touch {dir}/pwned) `touch {dir}/pwned` \"q\" \\ \n```\nend"
MATH = "$x^$ \\alpha"


def _grid(value: str):
    """A sweep file of one point: config.name = `value` (formatted with the case's {dir})."""
    def setup(ctx: Ctx) -> None:
        ctx.vars["value"] = value.format(dir=ctx.dir)
        ctx.write("s.py", f'CONFIG = "configs/mlp.py"\ndef get_sweep():\n'
                          f'    return [dict({SHORT}, name={ctx.vars["value"]!r})]\n')
    return setup


def parse(markdown: str) -> list:
    """Markdown's tokens, as GitHub renders it (CommonMark and tables)."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table").parse(markdown)


def _markdown(ctx: Ctx) -> list:
    with open(ctx.path("sweep", "results.md")) as f:
        return parse(f.read())


def _cell_text(inline) -> str:
    """A cell as a reader sees it: its text, a <br> as a line break, code as its text."""
    parts = []
    for child in inline.children:
        if child.type == "html_inline" and child.content.lower().startswith("<br"):
            parts.append("\n")
        elif child.type in ("text", "code_inline"):
            parts.append(child.content)
        elif child.type in ("softbreak", "hardbreak"):
            parts.append("\n")
        else:
            parts.append(f"<{child.type}>")
    return "".join(parts)


def table_rows(tokens: list) -> list[list[str]]:
    """The rows of a parsed Markdown table, each cell as a reader sees it (`_cell_text`)."""
    rows, row = [], None
    for token in tokens:
        if token.type == "tr_open":
            row = []
        elif token.type == "inline" and row is not None:
            row.append(_cell_text(token))
        elif token.type == "tr_close":
            rows.append(row)
            row = None
    return rows


def table_shows_value(ctx: Ctx, runs: list[Run]) -> str | None:
    """results.md's table: every row has the header's cells, and the name column renders as the exact value."""
    rows = table_rows(_markdown(ctx))
    if len(rows) != 2:
        return f"results.md's table has {len(rows)} rows, expected a header and one trial"
    header, trial = rows
    if len(trial) != len(header) or "name" not in header:
        return f"results.md: header {header}, row {trial}"
    shown = trial[header.index("name")]
    return None if shown == ctx.vars["value"] else f"results.md shows name {shown!r}, not {ctx.vars['value']!r}"


def csv_holds_value(ctx: Ctx, runs: list[Run]) -> str | None:
    """results.csv: column names unique, the swept name exact under config.name, the trial's name its directory."""
    with open(ctx.path("sweep", "results.csv"), newline="") as f:
        header = next(csv.reader(f))
        f.seek(0)
        rows = list(csv.DictReader(f))
    if len(set(header)) != len(header):
        return f"results.csv repeats a column: {sorted(h for h in header if header.count(h) > 1)}"
    if len(rows) != 1 or rows[0].get("config.name") != ctx.vars["value"]:
        return f"results.csv: {rows}"
    return None if os.path.isdir(ctx.path("sweep", rows[0]["name"])) else f"no directory {rows[0]['name']!r}"


def _bash_argv(ctx: Ctx, command: str) -> list[str]:
    """The argv `command` gives python when pasted into bash (python: a function that writes its arguments)."""
    out = ctx.path("argv")
    script = f'python() {{ printf "%s\\0" "$@" > {out}; }}\n{command}\n'
    subprocess.run(["bash", "-c", script], check=True, cwd=ctx.dir, timeout=30)
    with open(out, "rb") as f:
        return f.read().decode().split("\0")[:-1]


def reproduce_pastes(ctx: Ctx, runs: list[Run]) -> str | None:
    """The reproduce command, as printed and as results.md's code block holds it, runs in bash as the trial's
    own command did: the same arguments, the value exact, nothing in it executed."""
    fences = [t for t in _markdown(ctx) if t.type == "fence"]
    if len(fences) != 1:
        return f"results.md has {len(fences)} code blocks, expected the reproduce command's one"
    printed = re.search(r"reproduce it with: (python .*)", runs[-1].output, re.S)
    if not printed:
        return "no reproduce command in the output"
    commands = {"results.md": fences[0].content.rstrip("\n"), "the output": printed[1].rstrip("\n")}
    for where, command in commands.items():
        argv = _bash_argv(ctx, command)
        if f"--config.name={ctx.vars['value']}" not in argv or "--config=configs/mlp.py" not in argv:
            return f"{where}'s command gives python {argv}"
    return "the value's $(...) or backticks ran" if os.path.exists(ctx.path("pwned")) else None


def _records(path: str) -> list[bytes]:
    """The records of a TFRecord file (length, its CRC, data, its CRC), without TensorFlow."""
    records = []
    with open(path, "rb") as f:
        while header := f.read(12):
            (length,) = struct.unpack("<Q", header[:8])
            records.append(f.read(length))
            f.read(4)
    return records


def plot_and_hparams(ctx: Ctx, runs: list[Run]) -> str | None:
    """results.png written; the trial's HParams session holds the exact value."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    if not os.path.getsize(ctx.path("sweep", "results.png")):
        return "results.png is empty"
    sessions = glob.glob(ctx.path("sweep", "*", "events.out.tfevents.*.sweep_hparams"))
    if len(sessions) != 1:
        return f"{len(sessions)} HParams sessions"
    for record in _records(sessions[0]):
        event = event_pb2.Event.FromString(record)
        for value in event.summary.value:
            data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
            if data.HasField("session_start_info"):
                held = data.session_start_info.hparams["name"].string_value
                return None if held == ctx.vars["value"] else f"HParams holds name {held!r}"
    return "no HParams session_start_info"


def _png(ctx: Ctx, runs: list[Run]) -> str | None:
    return None if os.path.exists(ctx.path("sweep", "results.png")) else "no results.png"


CASES: list[Case] = [
    ok("sweep_value_pipe_newline", "a value with | and a newline: results.md's table keeps its columns and shows "
       "the value exactly (<br> for the newline); results.csv holds it", SWEEP, setup=_grid(PIPE_NEWLINE),
       check=all_of(table_shows_value, csv_holds_value)),
    ok("sweep_value_shell_and_fence", "a value with quotes, $(...), backticks and a ``` line: the reproduce command "
       "(printed and in results.md) pastes into bash and gives the trial's exact arguments, runs nothing",
       SWEEP, setup=_grid(SHELL), check=all_of(reproduce_pastes, table_shows_value)),
    ok("sweep_value_mathtext_and_column", "a value that is bad mathtext, in a column named like one of results.csv's "
       "own: results.png drawn, the csv's columns unique, HParams exact", SWEEP, setup=_grid(MATH),
       check=all_of(not_in_output("Traceback"), _png, plot_and_hparams, csv_holds_value, table_shows_value)),
]
