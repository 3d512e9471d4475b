"""The flag ledger (megatron_ext/config/ledger.py): every flag of megatron's parser is honoured (by
code that reads it), refused by name, or without effect here for a stated reason; and the flags it
calls honoured do what they do in megatron."""
from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import importlib
import inspect
import io
import os
import textwrap

import pytest

import arguments
from megatron_ext.config import ledger, rules
from megatron_ext.config import command_line
from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DENSE = os.path.join(ROOT, "recipes", "tiny_dense.yaml")
MOE = os.path.join(ROOT, "recipes", "tiny_moe.yaml")


def megatron_actions() -> dict:
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def _obj(where: str):
    module, _, name = where.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def reads(where: str) -> set:
    """What `where` reads: a config dataclass's fields (its from-args builder copies each flag of that
    name), else every attribute and string constant in the function's source (``args.X``,
    ``getattr(args, "X")``, a table of dest names)."""
    obj = _obj(where)
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        return {f.name for f in dataclasses.fields(obj)}
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
           {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)} | \
           {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def test_every_flag_of_megatrons_parser_is_classified():
    """A megatron-core upgrade that adds a flag fails here until the ledger says what it does."""
    dests = set(megatron_actions())
    assert len(dests) > 700  # the walk sees megatron's parser, not an empty one
    assert sorted(dests - set(ledger.LEDGER)) == [], "classify these in megatron_ext/config/ledger.py"
    assert sorted(set(ledger.LEDGER) - dests - ledger.OPTIONAL) == [], "no longer megatron flags"
    kinds = {type(e) for e in ledger.LEDGER.values()}
    assert kinds == {ledger.Honoured, ledger.Refused, ledger.NoEffect}


def test_every_honoured_flag_is_read_where_the_ledger_says():
    by_where: dict = {}
    for dest, entry in ledger.LEDGER.items():
        if isinstance(entry, ledger.Honoured):
            by_where.setdefault(entry.where, []).append(dest)
    unread = [f"{dest} not read by {where}" for where, dests in by_where.items()
              for dest in sorted(set(dests) - reads(where))]
    assert unread == [], "\n".join(unread)
    uncalled = [f"{caller} does not call {name}" for reader, (caller, name) in ledger.READERS.items()
                if reader in by_where and name not in reads(caller)]
    assert uncalled == []
    assert set(by_where) - set(ledger.READERS) <= {w for w in by_where if w.startswith(("megatron_ext.", "train:"))}
    assert "lr" not in reads("megatron_ext.training.model:_gpt_model")  # the check can fail


def _sample(action):
    """A value other than the flag's default, of the type the flag takes."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return not action.default
    if action.choices is not None:
        return next(c for c in action.choices if c != action.default)
    if action.type in (int, float):
        value = (action.default if isinstance(action.default, (int, float)) else 0) + 1
    else:
        value = "x" if action.type in (None, str) else action.type("1")
    return [value] if action.nargs in ("+", "*") else value


def test_every_refused_flag_is_refused_by_name():
    """Whenever set, a NOT_HERE flag is refused in one line naming it, before any compute; one left at
    its default is not. The others are refused by a rule naming them, or by the function the ledger
    names (it reads the flag and raises the refusal)."""
    actions = command_line.flag_actions(arguments.build_parser())
    with contextlib.redirect_stdout(io.StringIO()):
        args = arguments.parse(["--recipe", DENSE, "--mock-data", "--dry-run"], exit_on_dry_run=False)
    refused = {d: e for d, e in ledger.LEDGER.items() if isinstance(e, ledger.Refused) and d in actions}
    for dest in set(ledger.not_here()) & set(actions):  # as given, before megatron's validate_args derives some of them
        setattr(args, dest, actions[dest].default)
    assert rules.check_not_here(args, actions) == []
    assert len(refused) > 80
    for dest, entry in refused.items():
        if entry.where == ledger.NOT_HERE:
            changed = copy.copy(args)
            setattr(changed, dest, _sample(actions[dest]))
            lines = rules.check_not_here(changed, actions)
            name = rules.name_of(actions, dest)
            assert len(lines) == 1 and lines[0].startswith(f"{name}=") and "not in this loop" in lines[0], (dest, lines)
        elif entry.where == ledger.RULES:
            assert any(dest in rule.flags for rule in rules.RULES), dest
        else:
            source = reads(entry.where)
            assert dest in source and "ConfigError" in source, (dest, entry.where)


@pytest.mark.parametrize("argv,line", [
    (["--distributed-backend", "nccl"], "--distributed-backend=nccl: the backend follows the device here"),
    (["--rerun-mode", "report_stats"], "--rerun-mode=report_stats: megatron's rerun state machine"),
    (["--transformer-impl", "inference_optimized"], "--transformer-impl=inference_optimized: the inference"),
])
def test_the_ledgers_conditional_refusals(argv, line):
    with pytest.raises(Exception) as e, contextlib.redirect_stdout(io.StringIO()):
        arguments.parse(["--recipe", DENSE, "--mock-data", "--dry-run", "--platform", "cpu", *argv],
                        exit_on_dry_run=False)
    assert str(e.value).startswith(line), str(e.value)


def test_no_effect_says_why():
    assert all(e.why.strip() for e in ledger.LEDGER.values() if isinstance(e, ledger.NoEffect))


def test_freeze_all_layers_as_megatron():
    """megatron's get_model: no parameter trains and no router's expert bias moves; the logged LR is 0.
    The frozen run's losses are those of a run that changes nothing (LR 0, bias update rate 0), and
    differ from an ordinary run's from the second iteration on (the weights it would have moved)."""
    base = ["--recipe", MOE, "--train-iters", "3", "--lr-warmup-iters", "0", "--moe-router-score-function",
            "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.5", "--world-size", "1"]
    job = "tests.config.jobs:train_records"
    frozen = run_distributed(1, job, argv=base + ["--freeze-all-layers"])[0]
    still = run_distributed(1, job, argv=base + ["--lr", "0", "--min-lr", "0", "--moe-router-bias-update-rate", "0"])[0]
    trained = run_distributed(1, job, argv=base)[0]
    assert [r["lm loss"] for r in frozen] == [r["lm loss"] for r in still]
    assert [r["learning rate"] for r in frozen] == [0.0] * 3 and [r["grad norm"] for r in frozen] == [0.0] * 3
    assert frozen[0]["lm loss"] == trained[0]["lm loss"]
    assert all(f["lm loss"] != t["lm loss"] for f, t in zip(frozen[1:], trained[1:]))
