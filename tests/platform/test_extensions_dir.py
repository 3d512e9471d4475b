"""megatron_ext/platform extensions_dir: each Python environment builds megatron-core's C++ extension
in its own folder, so one checkout's build never replaces another's; a folder the user named is kept."""
from __future__ import annotations

import os
import sys

from megatron_ext import platform


def test_each_environment_has_its_own_folder_under_torchs_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "a" / ".venv"))
    first = platform.extensions_dir()
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "b" / ".venv"))
    second = platform.extensions_dir()
    assert first != second
    assert {os.path.dirname(first), os.path.dirname(second)} == {str(tmp_path / "torch_extensions")}
    assert os.path.basename(first).startswith(f"py{sys.version_info.major}{sys.version_info.minor}_")


def test_the_suite_builds_in_its_environments_folder_and_a_named_one_is_kept(monkeypatch):
    assert os.environ["TORCH_EXTENSIONS_DIR"] == platform.extensions_dir()  # set up by tests/conftest.py
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere")
    platform.use_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/elsewhere"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    platform.use_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == platform.extensions_dir()
