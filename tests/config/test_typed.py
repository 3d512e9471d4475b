"""A typed options class is one declaration: its argparse group, its defaults, its ranges, its slice."""
import argparse
import dataclasses

import pytest

from megatron_ext.config import domains
from megatron_ext.config.domains import Domain
from megatron_ext.config.typed import Options, add_group, add_group_without_torch, option
from megatron_ext.config.command_line import flag_actions
from megatron_ext.errors import ConfigError


@dataclasses.dataclass
class ExampleOptions(Options):
    PREFIX = "example_"

    pool_mb: float = option(1024.0, Domain(float, 0, lo_open=True), "a size in MiB")
    """Size of the pool."""

    modules: list[str] | None = option(None, metavar="MODULE")
    """What to act on."""

    mode: str = option("fast", choices=("fast", "slow"))
    """How to act."""

    debug: bool = False
    """Poison what is released."""


def _parser():
    parser = argparse.ArgumentParser()
    add_group(parser, ExampleOptions, "megatron_ext: example")
    return parser


def test_the_group_is_the_dataclass():
    parser = _parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert sorted(actions) == ["example_debug", "example_mode", "example_modules", "example_pool_mb"]
    assert actions["example_pool_mb"].option_strings == ["--example-pool-mb"]
    assert actions["example_pool_mb"].help == "Size of the pool."
    assert actions["example_modules"].nargs == "+" and actions["example_modules"].metavar == "MODULE"
    args = parser.parse_args(["--example-pool-mb", "8", "--example-modules", "a", "b", "--example-debug"])
    opts = ExampleOptions.from_args(args)
    assert opts == ExampleOptions(pool_mb=8.0, modules=["a", "b"], mode="fast", debug=True)
    assert ExampleOptions.from_args(parser.parse_args([])) == ExampleOptions()


def test_a_value_out_of_range_is_refused_by_one_check_naming_the_flag():
    parser = _parser()
    refused = domains.check_domains(parser.parse_args(["--example-pool-mb", "0"]), flag_actions(parser))
    line = "--example-pool-mb=0.0: must be a number > 0 (a size in MiB)"
    assert refused == {"example_pool_mb": line}
    with pytest.raises(ConfigError) as built_in_code:
        ExampleOptions(pool_mb=0.0)
    assert str(built_in_code.value) == line
    with pytest.raises(SystemExit):
        parser.parse_args(["--example-mode", "medium"])


@pytest.mark.parametrize("argv,module,cls,values", [
    (["--moe-dropless-budget-factor", "0"], "megatron_ext.moe", "MoEOptions", dict(dropless_budget_factor=0.0)),
    (["--lora-rank", "0"], "megatron_ext.lora", "LoRAOptions", dict(rank=0)),
    (["--lora-dropout", "1"], "megatron_ext.lora", "LoRAOptions", dict(dropout=1.0)),
    (["--save-keep-last", "-1"], "megatron_ext.checkpoint", "CheckpointOptions", dict(save_keep_last=-1)),
    (["--plan-top", "0"], "megatron_ext.planner", "PlanOptions", dict(top=0)),
    (["--plan-memory-gb", "0"], "megatron_ext.planner", "PlanOptions", dict(memory_gb=0.0)),
])
def test_a_capabilitys_options_built_in_code_are_refused_as_its_flag_is(argv, module, cls, values):
    """The capabilities' options: the parse's domain check and a construction in code refuse the same
    value with the same line, naming the flag."""
    import importlib

    import arguments

    parser = arguments.build_parser()
    refused = domains.check_domains(parser.parse_args(argv), flag_actions(parser))
    assert len(refused) == 1 and next(iter(refused.values())).startswith(argv[0] + "=")
    with pytest.raises(ConfigError) as built_in_code:
        getattr(importlib.import_module(module), cls)(**values)
    assert str(built_in_code.value) == next(iter(refused.values()))


def test_a_flag_prefix_respells_the_flags_not_the_dests():
    """scripts/plan.py's --top is train.py's --plan-top: another spelling, the same dest and domain."""
    parser = argparse.ArgumentParser()
    add_group(parser, ExampleOptions, "megatron_ext: example", flag_prefix="--")
    actions = flag_actions(parser)
    assert actions["example_pool_mb"].option_strings == ["--pool-mb"]
    args = parser.parse_args(["--pool-mb", "8", "--modules", "a", "--debug"])
    assert ExampleOptions.from_args(args) == ExampleOptions(pool_mb=8.0, modules=["a"], debug=True)
    refused = domains.check_domains(parser.parse_args(["--pool-mb", "0"]), actions)
    assert refused == {"example_pool_mb": "--pool-mb=0.0: must be a number > 0 (a size in MiB)"}


def _described(group) -> list:
    keys = ("option_strings", "dest", "default", "type", "nargs", "const", "choices", "help", "metavar", "required")
    return [(type(a).__name__, *(getattr(a, k) for k in keys), getattr(a, "domain", None), getattr(a, "meaning", None))
            for a in group._group_actions]


@pytest.mark.parametrize("module,cls,flag_prefix", [
    ("tests.config.test_typed", "ExampleOptions", None), ("tests.config.test_typed", "ExampleOptions", "--"),
    ("megatron_ext.planner", "PlanOptions", None), ("megatron_ext.planner", "PlanOptions", "--"),
    ("megatron_ext.offload", "OffloadOptions", None),
    ("megatron_ext.moe", "MoEOptions", None), ("megatron_ext.lora", "LoRAOptions", None),
    ("megatron_ext.checkpoint", "CheckpointOptions", None), ("megatron_ext.schedules.options", "OverlapOptions", None),
])
def test_the_group_built_without_torch_is_megatrons_factorys(module, cls, flag_prefix):
    """A --help that imports no torch (scripts/plan.py's) lists the same actions as megatron's
    ArgumentGroupFactory builds, for every options class."""
    import importlib

    options_cls = getattr(importlib.import_module(module), cls)
    built = [f(argparse.ArgumentParser(), options_cls, "t", flag_prefix=flag_prefix)
             for f in (add_group, add_group_without_torch)]
    assert _described(built[0]) == _described(built[1]) and built[0].description == built[1].description
