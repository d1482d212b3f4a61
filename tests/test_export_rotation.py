"""Export rotation (issue 31, item 2): by write order, never the export just made, never a directory mwloop did
not make, `latest` -> the one just written, whatever is odd in the base named in one warning line."""

from __future__ import annotations

import json
import os

import pytest
from absl import logging

from mwloop.artifacts import export, export_rotation


class FakeArchive:
    """Writes what a SavedModel export leaves (saved_model.pb, variables/): enough for the rotation."""

    def write_out(self, directory: str, verbose: bool = False) -> None:
        os.makedirs(os.path.join(directory, "variables"))
        with open(os.path.join(directory, "saved_model.pb"), "w") as f:
            f.write("pb")


@pytest.fixture
def fake_export(monkeypatch):
    monkeypatch.setattr(export, "_archive", lambda model, task: (FakeArchive(), {}))
    return lambda base, step, keep=3: export.export(None, None, str(base), step, keep=keep)


@pytest.fixture
def warnings(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(logging, "warning", lambda fmt, *args: lines.append(fmt % args))
    return lines


def listing(base) -> list[str]:
    return sorted(n for n in os.listdir(base) if not n.startswith("."))


def test_a_retrained_run_keeps_the_export_it_just_wrote_and_points_latest_at_it(tmp_path, fake_export, warnings):
    base = tmp_path / "export"
    fake_export(base, 200, keep=1)  # the old run
    fake_export(base, 40, keep=1)  # retrained from scratch: a lower number, but the newest written
    assert listing(base) == ["40", "latest"]
    assert os.readlink(base / "latest") == "40"
    assert [e.version for e in export_rotation.read_manifest(str(base))] == [40]


def test_keep_goes_by_write_order_not_by_number(tmp_path, fake_export, warnings):
    base = tmp_path / "export"
    for step in (200, 20, 40, 60):
        fake_export(base, step, keep=3)
    assert listing(base) == ["20", "40", "60", "latest"]
    assert os.readlink(base / "latest") == "60"


def test_what_mwloop_did_not_make_is_never_deleted_and_is_named_in_one_line(tmp_path, fake_export, warnings):
    base = tmp_path / "export"
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "saved_model.pb").write_text("theirs")
    os.makedirs(base / "300")
    (base / "300" / "saved_model.pb").write_text("copied in by hand")
    os.symlink(outside, base / "10")
    (base / "notes.txt").write_text("mine")
    for step in (20, 40, 60):
        fake_export(base, step, keep=1)
    assert listing(base) == ["10", "300", "60", "latest", "notes.txt"]
    assert (outside / "saved_model.pb").read_text() == "theirs"
    assert os.readlink(base / "latest") == "60"
    last = warnings[-1]
    assert "10, 300, notes.txt not written by this mwloop" in last
    assert "TF Serving serves the highest version, 300" in last
    assert all("\n" not in line for line in warnings)


def test_a_planted_manifest_deletes_nothing_without_the_directorys_mark(tmp_path, fake_export, warnings):
    base = tmp_path / "export"
    os.makedirs(base / "5")
    (base / "5" / "saved_model.pb").write_text("theirs")
    base.joinpath(export_rotation.MANIFEST).write_text(json.dumps({"exports": [{"version": 5, "mark": "guess"}]}))
    fake_export(base, 20, keep=1)
    assert listing(base) == ["20", "5", "latest"]


def test_a_reexport_of_a_step_mwloop_did_not_write_keeps_the_old_directory_aside(tmp_path, fake_export, warnings):
    base = tmp_path / "export"
    os.makedirs(base / "40")
    (base / "40" / "saved_model.pb").write_text("theirs")
    fake_export(base, 40)
    aside = [n for n in listing(base) if n.startswith("40.set-aside-")]
    assert aside and (base / aside[0] / "saved_model.pb").read_text() == "theirs"
    assert (base / "40" / "saved_model.pb").read_text() == "pb"
    assert "was not written by mwloop" in warnings[-1]


def test_a_reexport_of_its_own_step_replaces_it(tmp_path, fake_export, warnings):
    base = tmp_path / "export"
    fake_export(base, 40)
    fake_export(base, 40)
    assert listing(base) == ["40", "latest"] and not warnings


def test_a_torn_manifest_deletes_nothing(tmp_path, fake_export, warnings):
    base = tmp_path / "export"
    fake_export(base, 20, keep=1)
    base.joinpath(export_rotation.MANIFEST).write_text('{"exports": [{"vers')
    fake_export(base, 40, keep=1)
    assert listing(base) == ["20", "40", "latest"]  # 20 is no longer known to be ours: left, and named
    assert "20 not written by this mwloop" in warnings[-1]


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_a_latest_that_is_not_mwloops_link_is_left_alone_in_one_line_and_the_export_stays(
        tmp_path, fake_export, warnings, kind):
    base = tmp_path / "export"
    base.mkdir()
    if kind == "directory":
        (base / "latest").mkdir()
        (base / "latest" / "mine.txt").write_text("a user's own")
    else:
        (base / "latest").write_text("a user's own")
    fake_export(base, 40)
    assert (base / "40" / "saved_model.pb").exists() and not os.path.islink(base / "latest")
    assert (base / "latest" / "mine.txt").exists() if kind == "directory" else (base / "latest").read_text()
    assert any(f"latest is not mwloop's link (a {kind}): left alone" in line for line in warnings), warnings
