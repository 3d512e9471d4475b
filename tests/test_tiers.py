"""The suite's two tiers and its order (tests/tiers.py): the mark, the order, the guard against a stale
entry, and docs/tests.md's table."""
from __future__ import annotations

import os

import pytest

from tests import tiers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "tests.md")
BEGIN, END = "<!-- make test-matrix: begin -->", "<!-- make test-matrix: end -->"


class _Item:
    def __init__(self, nodeid):
        self.nodeid, self.marks = nodeid, []

    def add_marker(self, mark):
        self.marks.append(mark.name)


def test_matrix_tests_are_marked_and_the_heavy_modules_go_first(monkeypatch):
    monkeypatch.setattr(tiers, "MATRIX", {"tests/b.py::t[x]": "tests/b.py::t[y]"})
    monkeypatch.setattr(tiers, "HEAVY_FIRST", ["tests/c.py", "tests/b.py"])
    ids = ("tests/a.py::t", "tests/b.py::t[x]", "tests/b.py::t[y]", "tests/c.py::t", "tests/d.py::t")
    items = [_Item(i) for i in ids]
    tiers.apply(items, whole_suite=True)
    assert [i.nodeid for i in items] == ["tests/c.py::t", "tests/b.py::t[x]", "tests/b.py::t[y]", "tests/a.py::t",
                                         "tests/d.py::t"]
    assert [i.nodeid for i in items if i.marks == ["matrix"]] == ["tests/b.py::t[x]"]


def test_an_entry_naming_no_test_stops_the_whole_suite_run(monkeypatch):
    """A renamed test would otherwise move back into `make test` unseen; a run of some files only names less."""
    monkeypatch.setattr(tiers, "MATRIX", {"tests/b.py::gone": "?"})
    monkeypatch.setattr(tiers, "HEAVY_FIRST", ["tests/moved.py"])
    with pytest.raises(pytest.UsageError, match=r"tests/b\.py::gone, tests/moved\.py"):
        tiers.apply([_Item("tests/b.py::t")], whole_suite=True)
    tiers.apply([_Item("tests/b.py::t")], whole_suite=False)


def test_the_docs_list_the_matrix_tests_with_what_covers_each():
    page = open(PAGE).read()
    listed = page.split(BEGIN, 1)[1].split(END, 1)[0].strip() if BEGIN in page else ""
    assert listed == tiers.matrix_table(), "docs/tests.md: paste tests.tiers.matrix_table() between the markers"
