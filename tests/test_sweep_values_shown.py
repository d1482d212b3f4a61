"""Sweep values in the files a sweep writes for people (issue 47 item 4), in-process: results.md rendered by a
real Markdown parser, results.csv read back, results.png drawn, the HParams session read back, the reproduce
command through bash. (tests/stress/fault_cases_sweepvalues.py runs the same through a real sweep.)"""

from __future__ import annotations

import csv
import glob
import subprocess

import pytest

from mwloop.sweep import agent, hparams, plots, report
from tests.stress.fault_cases_sweepvalues import _records, parse, table_rows

# Each breaks something unescaped: a cell, a row, a code span, emphasis, math, a link, HTML, an entity.
NASTY = ["a|b", "c\nd", "c d", "c\r\nd\u2028e", "x `y` z", "*bold* _it_ ~s~", "$x^$ \\alpha", "[l](http://x)",
         "<b>html</b>", "&lt;", "back\\", "\\|", "learning_rate", "_lead"]


def _rows(values: list) -> list[report.PointResult]:
    return [report.PointResult(f"t{i}", "", {"name": v}, "complete",
                               events=[{"step": 1, "split": "eval", "accuracy": 0.5}]) for i, v in enumerate(values)]


def _table(markdown: str) -> list[list[str]]:
    return table_rows(parse(markdown))


def test_every_value_renders_as_itself_in_its_own_cell():
    table = _table(report.markdown_table(_rows(NASTY), ["name"], {"name": "na|me"}, "eval/accuracy"))
    header, *rows = table
    assert header[1] == "na|me" and header.count("<strong_open>eval/accuracy<strong_close>") == 1  # bold: ranked by
    assert all(len(row) == len(header) for row in rows)
    # A line break shows as one: \r\n, \u2028 included.
    expected = [v.replace("\r\n", "\n").replace("\u2028", "\n") for v in NASTY]
    assert [row[1] for row in rows] == expected


def test_the_reproduce_command_block_holds_a_command_with_a_fence_in_it(tmp_path):
    command = agent.reproduce_command("configs/mlp.py", "/w", ["--config.name=a\n```\nb ``` `"], 1)
    result = _rows(["x"])[0]
    result.command, result.number = command, 0
    report.write_markdown(str(tmp_path / "results.md"), [result], ["name"], {"name": "name"},
                          metric="eval/accuracy", mode="max", title="Sweep s|1.py\non x")
    tokens = parse((tmp_path / "results.md").read_text())
    assert [t.content for t in tokens if t.type == "fence"] == [command + "\n"]
    assert tokens[0].type == "heading_open" and tokens[1].content == "Sweep s\\|1.py on x"


def test_the_reproduce_command_pastes_into_bash_as_the_trials_own_arguments(tmp_path):
    value = "it's $(touch pwned) `touch pwned` \"q\" \\ \n!x"
    command = agent.reproduce_command("configs/mlp.py", "/w d", [f"--config.name={value}"], 1)
    out = tmp_path / "argv"
    subprocess.run(["bash", "-c", f'python() {{ printf "%s\\0" "$@" > {out}; }}\n{command}\n'], check=True,
                   cwd=tmp_path, timeout=30)
    assert out.read_bytes().decode().split("\0")[:-1] == ["-m", "mwloop.main", "--config=configs/mlp.py",
                                                          "--workdir=/w d", f"--config.name={value}"]
    assert not (tmp_path / "pwned").exists()


def test_csv_names_a_swept_key_apart_from_its_own_columns_and_holds_values_exactly(tmp_path):
    path = str(tmp_path / "results.csv")
    report.write_csv(path, _rows(NASTY), ["name"])
    with open(path, newline="") as f:
        header = next(csv.reader(f))
        f.seek(0)
        rows = list(csv.DictReader(f))
    assert len(set(header)) == len(header) and "config.name" in header
    assert [r["config.name"] for r in rows] == NASTY and [r["name"] for r in rows] == [f"t{i}" for i in range(14)]


@pytest.mark.parametrize("search", [False, True])
def test_the_plot_draws_values_that_are_bad_mathtext(tmp_path, search):
    rows = _rows(["$x^$", "a\nb", "$\\alpha$"])
    plots.write_plot(str(tmp_path / "results.png"), rows, ["name"], {"name": "name"}, metric="eval/accuracy",
                     search=search)
    assert (tmp_path / "results.png").stat().st_size > 0


def test_hparams_sessions_hold_values_exactly(tmp_path):
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    rows = _rows(["a|b\nc", "$x^$"])
    for i, row in enumerate(rows):
        row.workdir = str(tmp_path / f"t{i}")
        (tmp_path / f"t{i}").mkdir()
    hparams.write_hparams(str(tmp_path), rows, ["name"])
    for row in rows:
        (session,) = glob.glob(f"{row.workdir}/events.out.tfevents.*")
        datas = [plugin_data_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content)
                 for r in _records(session) for v in event_pb2.Event.FromString(r).summary.value]
        assert [d.session_start_info.hparams["name"].string_value for d in datas] == [row.values["name"]]
