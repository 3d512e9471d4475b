"""The command line's refusals (megatron_ext/config/command_line.py): a flag the parser does not
know is named with the closest flag there is, one line per flag, as a recipe's unknown key is."""
from __future__ import annotations

import os

import pytest

import arguments
from megatron_ext.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "recipes", "tiny_dense.yaml")


def refusal(*argv) -> list[str]:
    with pytest.raises(ConfigError) as e:
        arguments.parse(["--recipe", TINY, "--mock-data", *argv, "--dry-run"], exit_on_dry_run=False)
    return str(e.value).splitlines()


def test_a_mistyped_flag_gets_the_closest_flag():
    assert refusal("--lora-rnak", "8") == ["--lora-rnak=8: no such flag; did you mean --lora-rank?"]
    assert refusal("--hiden-size=96") == ["--hiden-size=96: no such flag; did you mean --hidden-size?"]


def test_every_unknown_flag_at_once_each_with_its_values():
    assert refusal("--seqlength", "64", "--lr", "1e-3", "--zzzzzz", "--lora-rnak", "-3") == [
        "--seqlength=64: no such flag; did you mean --seq-length?",
        "--zzzzzz: no such flag; --help lists every flag",
        "--lora-rnak=-3: no such flag; did you mean --lora-rank?",  # a negative number is a value
    ]
    assert refusal("stray") == ["stray: not a flag (every value follows its flag: --name value)"]
