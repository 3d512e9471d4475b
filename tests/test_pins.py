"""constraints.txt pins every package requirements.txt, torch and megatron-core need (scripts/pins.py),
and the suite runs on exactly those versions: `make install` installs with them as constraints and
stops on any difference; these tests fail in an environment that differs, or when a requirement is
added without its pins."""
from __future__ import annotations

import os

from tests.scripts import ROOT, load_script

pins = load_script("pins")
PINS = os.path.join(ROOT, "constraints.txt")
REQUIREMENTS = os.path.join(ROOT, "requirements.txt")


def test_this_environment_has_the_pinned_versions():
    assert pins.mismatches(pins.read_pins(PINS)) == []


def test_every_needed_package_is_pinned_and_nothing_else():
    """The file is what `scripts/pins.py --write` writes here: every distribution requirements.txt,
    torch and megatron-core need (dependencies followed), none that nothing needs."""
    needed = pins.closure(pins.requirement_names(REQUIREMENTS) + pins.ROOTS)
    assert {"transformers", "tokenizers", "safetensors", "numpy", "pyyaml", "matplotlib", "tensorboard", "pytest",
            "pytest-xdist", "pytest-timeout", "einops", "psutil", "sentencepiece", "peft", "torch",
            "megatron-core"} <= set(needed)
    with open(PINS) as f:
        assert f.read() == pins.HEADER + "\n".join(pins.pinned_lines(needed)) + "\n", \
            "requirements changed: make constraints, then make clean test"


def test_a_package_at_another_version_or_missing_is_named(tmp_path, capsys):
    other = tmp_path / "constraints.txt"
    numpy = pins.read_pins(PINS)["numpy"]
    other.write_text(f"# a comment\nnumpy=={numpy}\npyyaml==0.0.1\nno-such-distribution==1.0\n")
    assert pins.main(["--check", str(other)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"pins: no-such-distribution: not installed, pinned 1.0 ({other})",
        f"pins: pyyaml: {pins.read_pins(PINS)['pyyaml']} installed, pinned 0.0.1 ({other})",
    ]
