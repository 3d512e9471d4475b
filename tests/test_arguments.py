"""arguments.py: Megatron's flags, recipes (defaults < recipe < cli), errors before compute, --dry-run."""
from __future__ import annotations

import os
import textwrap

import pytest

from megatron_ext import arguments
from megatron_ext.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes", "tiny_dense.yaml")


def parse(*argv, world_size=None):
    extra = ["--world-size", str(world_size), "--dry-run"] if world_size else []
    return arguments.parse(["--recipe", TINY, "--mock-data", *argv, *extra], exit_on_dry_run=False)


def recipe(tmp_path, text: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_precedence_and_sources():
    args = parse("--hidden-size", "128", "--num-attention-heads", "8")
    assert args.hidden_size == 128 and args.config_sources["hidden_size"] == "cli"
    assert args.num_layers == 4 and args.config_sources["num_layers"] == "recipe"
    assert args.adam_beta1 == 0.9 and args.config_sources["adam_beta1"] == "default"


def test_megatron_flags_keep_their_meaning():
    args = parse("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", world_size=4)
    assert args.data_parallel_size == 1  # computed by megatron's own validate_args
    assert args.ffn_hidden_size == 256 and args.swiglu is True


def test_flag_spelling_keys_in_recipes(tmp_path):
    base = open(TINY).read()
    args = arguments.parse(["--recipe", recipe(tmp_path, base), "--mock-data"], exit_on_dry_run=False)
    assert args.add_bias_linear is False  # `disable_bias_linear: true` sets the store_false dest


def test_unknown_key_suggests_the_closest(tmp_path):
    path = recipe(tmp_path, "num_layer: 2\n")
    with pytest.raises(ConfigError, match=r"unknown key 'num_layer'.*did you mean 'num_layers'"):
        arguments.parse(["--recipe", path, "--mock-data"], exit_on_dry_run=False)


@pytest.mark.parametrize(
    "text,match",
    [
        ("num_layers: two\n", r"'num_layers' \(--num-layers\) expects int"),
        ("num_layers: 2.5\n", r"'num_layers' \(--num-layers\) expects int"),
        ("swiglu: 1\n", r"'swiglu' \(--swiglu\) expects true or false"),
        ("lr: [1, 2]\n", r"'lr' \(--lr\) expects a single value"),
        ("moe_token_dispatcher_type: teleport\n", r"expects one of"),
    ],
)
def test_wrong_types_name_key_and_flag(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        arguments.parse(["--recipe", recipe(tmp_path, text), "--mock-data"], exit_on_dry_run=False)


def test_yaml_scientific_notation_is_a_float(tmp_path):
    path = recipe(tmp_path, open(TINY).read() + "min_lr: 1e-5\n")
    assert arguments.parse(["--recipe", path, "--mock-data"], exit_on_dry_run=False).min_lr == 1e-5


@pytest.mark.parametrize(
    "argv,world,match",
    [
        (["--tensor-model-parallel-size", "3"], 4, r"world size \(4\) is not divisible"),
        (["--lr-warmup-iters", "500"], None, r"--lr-warmup-iters=500"),
        (["--transformer-impl", "transformer_engine"], None, r"--transformer-impl=transformer_engine"),
        (["--recipe", "nope.yaml"], None, r"--recipe=nope.yaml: no such file"),
    ],
)
def test_bad_flags_fail_before_compute(argv, world, match):
    with pytest.raises(ConfigError, match=match):
        parse(*argv, world_size=world)


def test_no_data_source_is_an_error(tmp_path):
    text = "\n".join(l for l in open(TINY).read().splitlines() if not l.startswith(("data_path", "split")))
    with pytest.raises(ConfigError, match="no training data"):
        arguments.parse(["--recipe", recipe(tmp_path, text)], exit_on_dry_run=False)


def test_mock_data_on_the_cli_replaces_the_recipe_data_path():
    args = parse()
    assert args.mock_data and args.data_path is None
    assert args.config_sources["data_path"] == "cleared by --mock-data"


def test_real_run_refuses_a_world_size_the_launcher_did_not_start(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="--world-size=2: the launcher started 1"):
        arguments.parse(["--recipe", TINY, "--mock-data", "--world-size", "2"], exit_on_dry_run=False)


def test_dry_run_prints_sources_and_exits(capsys):
    with pytest.raises(SystemExit) as exit_info:
        arguments.parse(["--recipe", TINY, "--mock-data", "--dry-run", "--all", "--hidden-size", "96",
                         "--num-attention-heads", "4"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "resolved configuration" in out
    lines = {l.split()[0]: l for l in out.splitlines()[1:] if l.strip()}
    assert lines["hidden_size"].endswith("[cli]") and "96" in lines["hidden_size"]
    assert lines["num_layers"].endswith("[recipe]")
    assert lines["adam_beta1"].endswith("[default]")
    assert "default (off: CPU)" in lines["bias_swiglu_fusion"]


def test_cpu_fusion_defaults_are_switched_off_but_explicit_requests_are_kept(tmp_path):
    args = parse()
    assert args.bias_swiglu_fusion is False and args.apply_rope_fusion is False
    path = recipe(tmp_path, open(TINY).read() + "apply_rope_fusion: true\n")
    with pytest.raises(Exception, match="apply_rope_fusion"):  # explicit: megatron refuses it without TE
        arguments.parse(["--recipe", path, "--mock-data"], exit_on_dry_run=False)


@pytest.mark.parametrize("name", ["tiny_dense.yaml", "tiny_moe.yaml"])
def test_tiny_recipes_dry_run(name):
    args = arguments.parse(["--recipe", os.path.join(ROOT, "recipes", name), "--dry-run", "--mock-data"],
                           exit_on_dry_run=False)
    assert args.train_iters > 0


def test_dry_run_shows_what_was_set_and_labels_megatrons_changes(capsys):
    """Without --all: only values the recipe, the command line, the platform or megatron set; a value
    megatron's validate_args changed is labelled megatron, with what it was and who set it."""
    args = arguments.parse(["--recipe", TINY, "--mock-data", "--dry-run", "--sequence-parallel"], exit_on_dry_run=False)
    out = capsys.readouterr().out
    lines = {l.split()[0]: l for l in out.splitlines()[1:] if l.strip() and not l.strip().startswith("...")}
    assert args.sequence_parallel is False  # TP=1: megatron turns it off
    assert lines["sequence_parallel"].endswith("[megatron (was True, cli)]")
    assert lines["num_layers"].endswith("[recipe]") and lines["dry_run"].endswith("[cli]")
    assert lines["data_parallel_size"].endswith("[megatron]")
    assert "default (off: CPU)" in lines["bias_swiglu_fusion"]
    assert "adam_beta1" not in lines and len(lines) < 80
    hidden = len(vars(args)) - 1 - len(lines)
    assert f"... {hidden} more at their defaults or derived by megatron: --dry-run --all lists every value" in out


def test_a_load_without_checkpoint_is_refused_unless_asked_for(tmp_path):
    """A mistyped --load would train from fresh weights: refused in one line, before any compute,
    unless --allow-missing-checkpoint, or --load is --save (a job's first run; not with --finetune).
    megatron's --exit-on-missing-checkpoint refuses even that."""
    empty, missing, run = tmp_path / "empty", tmp_path / "missing", str(tmp_path / "run")
    empty.mkdir()
    lines = {}
    for name, argv in {
        "empty": ["--load", str(empty)],
        "finetune": ["--finetune", "--load", str(empty)],
        "missing": ["--load", str(missing), "--save", run, "--save-interval", "5"],
        "finetune into save": ["--finetune", "--load", run, "--save", run, "--save-interval", "5"],
        "exit": ["--load", run, "--save", run, "--save-interval", "5", "--exit-on-missing-checkpoint"],
    }.items():
        with pytest.raises(ConfigError) as e:
            parse(*argv)
        lines[name] = str(e.value)
    assert lines["empty"] == (f"--load={empty}: no checkpoint there (no iter_N directory); name a checkpoint "
                              "directory, or pass --allow-missing-checkpoint to start from fresh weights")
    assert lines["finetune"].startswith(f"--finetune --load={empty}: no checkpoint there")
    assert lines["missing"].startswith(f"--load={missing}: no such directory;")
    assert lines["finetune into save"].startswith(f"--finetune --load={run}: no such directory;")
    assert lines["exit"] == f"--load={run}: no checkpoint there (--exit-on-missing-checkpoint)"
    assert parse("--load", str(empty), "--allow-missing-checkpoint").allow_missing_checkpoint
    assert parse("--finetune", "--load", str(empty), "--allow-missing-checkpoint").finetune
    assert parse("--load", run, "--save", run, "--save-interval", "5").load == run
