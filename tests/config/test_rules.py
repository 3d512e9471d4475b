"""megatron_ext/config: every numeric flag has a domain, cross-field rules refuse by name before any
compute, megatron's own checks are reported as one line naming the flags, docs/flags.md is current."""
from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import io
import math
import os
import sys

import pytest

import arguments
from megatron_ext.config import domains, megatron_checks, rules
from megatron_ext import errors
from megatron_ext.errors import ConfigError
from megatron_ext.platform import target
from tests.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DENSE = os.path.join(ROOT, "recipes", "tiny_dense.yaml")
MOE = os.path.join(ROOT, "recipes", "tiny_moe.yaml")
CPU = ["--platform", "cpu"]  # a declared target: the platform rules do not depend on this machine
CUDA_NO_TE = ["--platform", "cuda", "--assume-no-te"]


def parse(*argv, recipe=DENSE, world_size=1, mock=True):
    with contextlib.redirect_stdout(io.StringIO()):
        return arguments.parse(["--recipe", recipe, *(["--mock-data"] if mock else []), "--world-size",
                                str(world_size), "--dry-run", *argv], exit_on_dry_run=False)


def refused(*argv, recipe=DENSE, world_size=1, mock=True, problems=1) -> str:
    """The refusal: one line per problem found (``problems`` of them)."""
    with pytest.raises(ConfigError) as e:
        parse(*argv, recipe=recipe, world_size=world_size, mock=mock)
    lines = str(e.value).splitlines()
    assert len(lines) == problems and all(line.strip() for line in lines), lines
    return str(e.value)


def megatron_parser():
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


# --- domains ------------------------------------------------------------------------------------


def test_every_numeric_flag_of_megatrons_parser_and_ours_has_a_domain():
    numeric = {a.dest for p in (megatron_parser(), arguments.build_parser()) for a in p._actions
               if domains.is_numeric(a) and getattr(a, "domain", None) is None}  # typed options carry their own
    assert len(numeric) > 300  # the walk sees megatron's flags, not an empty list
    typed = {a.dest for a in arguments.build_parser()._actions if getattr(a, "domain", None)}  # config/typed.py
    assert "moe_dropless_budget_factor" in typed and not typed & set(domains.DOMAINS)
    missing = sorted(numeric - set(domains.DOMAINS) - typed)
    assert not missing, f"numeric flags without a domain in megatron_ext.config.domains.FAMILIES: {missing}"


def test_every_domain_names_a_numeric_flag_exactly_once():
    actions = {a.dest: a for a in arguments.build_parser()._actions if a.option_strings}
    named = [f for fam in domains.FAMILIES for f in fam.flags]
    assert len(named) == len(set(named)), "a flag in two families"
    assert [f for f in named if f not in actions or not domains.is_numeric(actions[f])] == []


def test_every_default_is_inside_its_domain():
    actions = {a.dest: a for a in arguments.build_parser()._actions if a.option_strings}
    outside = [(d, actions[d].default) for d, fam in domains.DOMAINS.items()
               if actions[d].default is not None and fam.domain.refuses(actions[d].default)]
    outside += [(d, a.default) for d, a in actions.items()
                if getattr(a, "domain", None) and a.default is not None and a.domain.refuses(a.default)]
    assert outside == []


# one flag and one value outside the domain per family; a new family needs its case here
OUTSIDE = {
    "parallel size": ("--context-parallel-size", "0"),
    "model size": ("--num-layers", "0"),
    "batch size": ("--micro-batch-size", "0"),
    "interval": ("--log-interval", "0"),
    "count": ("--eval-iters", "-1"),
    "seed": ("--seed", "-1"),
    "off or count": ("--rl-default-top-k", "0"),
    "token id or none": ("--null-tokenizer-pad-id", "-2"),
    "port": ("--straggler-ctrlr-port", "70000"),
    "nice value": ("--async-ckpt-cpu-priority", "20"),
    "io class": ("--async-ckpt-io-priority", "4"),
    "logging level": ("--logging-level", "60"),
    "probability": ("--hidden-dropout", "1.0"),
    "fraction": ("--lr-warmup-fraction", "1.5"),
    "open fraction": ("--rotary-percent", "0"),
    "beta": ("--adam-beta2", "1.0"),
    "epsilon": ("--adam-eps", "0"),
    "positive": ("--initial-loss-scale", "0"),
    "non-negative": ("--clip-grad", "-1"),
    "signed": ("--glu-linear-offset", "nan"),
    "layer pattern": ("--moe-layer-freq", "[1,2,1,1]"),
    "window": ("--window-size=-2,4", None),
}


def test_every_family_has_a_refusal_case():
    assert set(OUTSIDE) == {fam.name for fam in domains.FAMILIES}


@pytest.mark.parametrize("family", [fam.name for fam in domains.FAMILIES])
def test_a_value_outside_each_family_is_refused_by_name(family):
    flag, value = OUTSIDE[family]
    fam = next(f for f in domains.FAMILIES if f.name == family)
    line = refused(*([flag] if value is None else [flag, value]))
    assert line.startswith(flag.split("=")[0] + "=") and str(fam.domain) in line and family in line


@pytest.mark.parametrize("argv,match", [
    # accepted before, and would fail later or train nonsense
    (["--num-layers", "0"], r"^--num-layers=0: must be an integer >= 1"),
    (["--seq-length", "0"], r"^--seq-length=0: must be an integer >= 1"),
    (["--vocab-size", "0"], r"^--vocab-size=0: must be an integer >= 1"),
    (["--ffn-hidden-size", "0"], r"^--ffn-hidden-size=0: must be an integer >= 1"),
    (["--attention-dropout", "1.5"], r"^--attention-dropout=1.5: must be a number in \[0, 1\)"),
    (["--adam-beta1", "1.5"], r"^--adam-beta1=1.5: must be a number in \[0, 1\)"),
    (["--weight-decay", "-1"], r"^--weight-decay=-1.0: must be a number >= 0"),
    (["--moe-router-topk", "0"], r"^--moe-router-topk=0: must be an integer >= 1"),
    (["--num-experts", "3", "--moe-router-topk", "4"], r"^--moe-router-topk=4, --num-experts=3: top-k cannot exceed"),
    (["--log-interval", "0"], r"^--log-interval=0: must be an integer >= 1"),
    (["--seed", "-1"], r"^--seed=-1: must be an integer in \[0, 2\^32 - 1\]"),
    # refused before with an empty reason
    (["--hidden-size", "65", "--num-attention-heads", "4"], r"^--hidden-size=65, --num-attention-heads=4: the number of heads must divide"),
    (["--lr", "-1"], r"^--lr=-1.0: must be a number >= 0"),
    (["--micro-batch-size", "0"], r"^--micro-batch-size=0: must be an integer >= 1"),
    (["--bf16", "--fp16"], r"^--fp16=True, --bf16=True: choose one"),
    (["--save-interval", "0"], r"^--save-interval=0: must be an integer >= 1"),
])
def test_values_a_new_user_tried_are_refused_with_a_reason(argv, match):
    import re

    assert re.search(match, refused(*argv))


def test_data_path_pointing_at_nothing_is_refused(tmp_path):
    (tmp_path / "half.bin").write_bytes(b"")  # .idx missing
    line = refused("--data-path", str(tmp_path / "half"), str(tmp_path / "nothing"), mock=False)
    assert line.startswith(f"--data-path={tmp_path / 'half'} {tmp_path / 'nothing'}: each dataset prefix needs "
                           "PREFIX.bin and PREFIX.idx") and line.endswith(f"not found: {tmp_path / 'half'}, "
                                                                          f"{tmp_path / 'nothing'})")
    assert parse("--data-path", "data/pystdlib_text_document", mock=False).data_path


# --- cross-field rules, one case per family ---------------------------------------------------

RULE_CASES = {
    "parallel layout": (["--num-experts", "8", "--expert-model-parallel-size", "3", "--global-batch-size", "6"], MOE, 3,
                        r"^--num-experts=8, --expert-model-parallel-size=3: EP must divide the number of experts"),
    "model shape": (["--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "3"], DENSE, 1,
                    r"^--num-attention-heads=8, --num-query-groups=3: the number of query groups must divide"),
    "pipeline split": (["--num-layers", "6", "--pipeline-model-parallel-size", "3",
                        "--decoder-first-pipeline-num-layers", "1"], DENSE, 3,
                       r"^--num-layers=6, --pipeline-model-parallel-size=3, --decoder-first-pipeline-num-layers=1: "
                       r"the layers left"),
    "batch": (["--global-batch-size", "6"], DENSE, 4,
              r"^--global-batch-size=6, --micro-batch-size=2, --world-size=4: the global batch must be a multiple "
              r"of micro batch x data-parallel size \(2 x 4 = 8\)"),
    "schedule": (["--lr", "1e-4", "--min-lr", "1e-3"], DENSE, 1, r"^--min-lr=0.001, --lr=0.0001: --min-lr cannot exceed"),
    "precision": (["--fp16", "--bf16"], DENSE, 1, r"^--fp16=True, --bf16=True"),
    "platform": (["--moe-permute-fusion"], MOE, 1,
                 r"^--moe-permute-fusion=True, --transformer-impl=local: the fused permutation is a transformer-engine"),
    "not here": (["--rerun-mode", "report_stats"], DENSE, 1, r"^--rerun-mode=report_stats: megatron's rerun state"),
    "files": (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "README.md"], DENSE, 1,
              r"^--tokenizer-type=GPT2BPETokenizer, --vocab-file=README.md, --merge-file=None: "
              r"this tokenizer reads --vocab-file and --merge-file"),
}


def test_every_rule_family_has_a_case():
    assert set(RULE_CASES) == {r.family for r in rules.RULES}


@pytest.mark.parametrize("family", sorted(RULE_CASES))
def test_each_rule_family_refuses_by_name(family):
    import re

    argv, recipe, world, match = RULE_CASES[family]
    assert re.search(match, refused(*argv, *CPU, recipe=recipe, world_size=world))


def test_rules_name_real_flags():
    dests = {a.dest for a in arguments.build_parser()._actions}
    assert [d for r in rules.RULES for d in (*r.flags, *r.context) if d not in dests] == []


def test_the_misleading_eval_batch_message_is_replaced():
    """8 experts on EP=3 at world size 3: megatron blamed the eval batch size the user never set."""
    line = refused("--num-experts", "8", "--expert-model-parallel-size", "3", "--global-batch-size", "6",
                   recipe=MOE, world_size=3)
    assert "eval" not in line and "--expert-model-parallel-size=3" in line


def test_pipeline_split_counts_the_uneven_flags():
    assert parse("--num-layers", "5", "--pipeline-model-parallel-size", "2",
                 "--decoder-first-pipeline-num-layers", "1", world_size=2).num_layers == 5
    assert "PP must divide the layers" in refused("--num-layers", "5", "--pipeline-model-parallel-size", "2",
                                                 world_size=2)


def test_load_and_save_directories(tmp_path):
    assert parse("--save", str(tmp_path / "new" / "run"), "--load", str(tmp_path / "new" / "run"),
                 "--save-interval", "5").save
    line = refused("--load", str(tmp_path / "missing"), "--save", str(tmp_path / "run"), "--save-interval", "5")
    assert line.startswith(f"--load={tmp_path / 'missing'}")
    (tmp_path / "file").write_text("")
    assert refused("--save", str(tmp_path / "file" / "run"), "--save-interval", "5").startswith("--save=")


# --- the platform: TE / CUDA / apex as target() says -------------------------------------------


def test_platform_rules_ask_the_target():
    layernorm_1p = ("--apply-layernorm-1p", "--normalization", "LayerNorm")
    assert refused("--moe-grouped-gemm", *CPU, recipe=MOE).startswith("--moe-grouped-gemm=True: the grouped GEMM")
    # the local spec has the zero-centred norm and multi-latent attention (seams.architectures), as
    # apex's FusedLayerNorm and transformer-engine's layers do
    assert parse(*layernorm_1p, *CUDA_NO_TE).layernorm_zero_centered_gamma
    assert parse(*layernorm_1p, *CPU).layernorm_zero_centered_gamma
    assert parse(*layernorm_1p, *CUDA_NO_TE, "--assume-apex").layernorm_zero_centered_gamma
    assert parse("--multi-latent-attention", *CUDA_NO_TE).transformer_impl == "local"
    assert parse("--multi-latent-attention", *CPU).multi_latent_attention
    mla = parse("--multi-latent-attention", "--transformer-impl", "transformer_engine", "--platform", "cuda",
                "--assume-te")
    # megatron's TransformerConfig checks probe the transformer-engine installed here: built only if there is one
    assert ("MLATransformerConfig" in mla.megatron_configs_checked) == target.te_importable()


@pytest.mark.parametrize("argv,recipe,world,flags", [  # on a CUDA cluster without transformer-engine
    (["--tensor-model-parallel-size", "2"], MOE, 2, "--num-experts=8, --tensor-model-parallel-size=2, --sequence-parallel=False"),
    # FP8 on the local spec is torchao's (megatron_ext/fp8): megatron's default recipe is refused by name
    (["--fp8-format", "hybrid", "--bf16"], MOE, 1, "--fp8-recipe=delayed, --transformer-impl=local"),
    (["--fp8-format", "hybrid", "--bf16"], DENSE, 1, "--fp8-recipe=delayed, --transformer-impl=local"),
    (["--moe-permute-fusion"], MOE, 1, "--moe-permute-fusion=True, --transformer-impl=local"),
    (["--recompute-granularity", "selective", "--recompute-modules", "layernorm"], DENSE, 1,
     "--recompute-modules=layernorm, --transformer-impl=local"),
])
def test_configurations_that_failed_at_build_are_refused_at_dry_run(argv, recipe, world, flags):
    assert refused(*argv, *CUDA_NO_TE, recipe=recipe, world_size=world).startswith(flags + ": ")


def test_grouped_gemm_without_cuda_is_refused_by_name():
    assert refused("--moe-grouped-gemm", *CPU, recipe=MOE) == (
        "--moe-grouped-gemm=True: the grouped GEMM kernels need a CUDA GPU (compute capability >= 8.0)")


# --- megatron's own checks ------------------------------------------------------------------------


def _check_sites():
    from megatron.core import model_parallel_config as mpc
    from megatron.core.distributed import distributed_data_parallel_config as ddpc
    from megatron.core.optimizer import optimizer_config as oc
    from megatron.core.transformer import transformer_config as tc
    from megatron.training import arguments as margs

    for fn in (margs.validate_args, tc.TransformerConfig.__post_init__, tc.MLATransformerConfig.__post_init__,
               mpc.ModelParallelConfig.__post_init__, ddpc.DistributedDataParallelConfig.__post_init__,
               oc.OptimizerConfig.__post_init__):
        filename = inspect.getsourcefile(fn)
        lines = [line for _, _, line in fn.__code__.co_lines() if line]
        for node in ast.walk(megatron_checks._tree(filename)):
            if isinstance(node, (ast.Assert, ast.Raise)) and min(lines) <= node.lineno <= max(lines):
                yield filename, node


def test_every_megatron_check_maps_to_flags():
    dests = {a.dest for a in arguments.build_parser()._actions if a.option_strings}
    sites = list(_check_sites())
    assert len(sites) > 300
    unmapped = [f"{os.path.basename(f)}:{n.lineno} {ast.unparse(n)[:80]}" for f, n in sites
                if not megatron_checks.site_flags(*megatron_checks.site(f, n.lineno), dests)]
    assert unmapped == [], "add these to megatron_ext.config.megatron_checks.SITES or FIELD_FLAGS"


@pytest.mark.parametrize("argv,line", [
    (["--encoder-seq-length", "64"],
     "--encoder-seq-length=64, --seq-length=64: megatron requires --encoder-seq-length is None "
     "(megatron/training/arguments.py:"),
    (["--lr-warmup-fraction", "0.1"],
     "--lr-warmup-iters=2, --lr-warmup-fraction=0.1, --train-iters=100, --skip-train=False: can only specify one "
     "of lr-warmup-fraction and lr-warmup-iters"),
    (["--data-args-path", os.path.join(ROOT, "recipes", "tiny_dense.yaml"), "--data-path", "data/pystdlib_text_document"],
     "--data-path=data/pystdlib_text_document, --data-args-path="),
])
def test_megatron_bare_asserts_become_a_line_naming_the_flags(argv, line):
    got = refused(*argv)
    assert got.startswith(line.split(" (megatron")[0]), got


def test_dry_run_builds_megatrons_transformer_config():
    """Only TransformerConfig.__post_init__ checks this one: caught at --dry-run, named by flag."""
    assert parse().megatron_configs_checked == ["TransformerConfig", "DistributedDataParallelConfig", "OptimizerConfig"]
    line = refused("--moe-ffn-hidden-size", "64")
    assert line.startswith("--num-experts=None, --moe-ffn-hidden-size=64: --moe-ffn-hidden-size is set but "
                           "--num-experts is None") and "megatron/core/transformer/transformer_config.py:" in line


def test_changed_schedule_on_resume_names_the_flags():
    """A resumed run whose --train-iters differs from the checkpoint's: megatron's scheduler assert."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    args = parse("--train-iters", "50")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    def scheduler(decay_steps):
        return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=0.1, min_lr=0.0, lr_warmup_steps=0,
                                       lr_decay_steps=decay_steps, lr_decay_style="linear", start_wd=0.0,
                                       end_wd=0.0, wd_incr_steps=10, wd_incr_style="constant",
                                       use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
                                       override_opt_param_scheduler=args.override_opt_param_scheduler)

    saved = scheduler(100 * 8).state_dict()
    with pytest.raises(AssertionError) as e:
        scheduler(args.train_iters * 8).load_state_dict(saved)
    line = arguments.explain(e.value)
    assert line.startswith("--train-iters=50: the checkpoint under --load was saved with total number of "
                           "iterations 800, these flags give 400") and "--override-opt_param-scheduler" in line


# --- the entry point: one line, once, non-zero exit ------------------------------------------------


def test_refusal_is_one_line_printed_by_rank_0_only(capsys, monkeypatch):
    def main():
        raise ConfigError("--num-layers=0: must be an integer >= 1 (model size)")

    for rank, printed in (("0", "error: --num-layers=0: must be an integer >= 1 (model size)\n"), ("1", "")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            errors.run(main, explain=arguments.explain)
        assert e.value.code == 1 and capsys.readouterr().err == printed


def test_an_error_not_about_a_flag_keeps_its_traceback():
    def main():
        assert 1 + 1 == 3, "a bug, not a flag"

    with pytest.raises(AssertionError, match="a bug"):
        errors.run(main, explain=arguments.explain)


# --- docs/flags.md ------------------------------------------------------------------------------


def test_docs_page_is_generated_from_the_table():
    committed = open(os.path.join(ROOT, "docs", "flags.md")).read()
    assert committed == load_script("flags_doc").markdown(arguments.build_parser()), "run: python scripts/flags_doc.py > docs/flags.md"


def test_domain_text():
    assert str(domains.Domain(int, 1)) == "an integer >= 1"
    assert str(domains.Domain(float, 0, 1, hi_open=True)) == "a number in [0, 1)"
    assert str(domains.Domain(int, 1, also=(-1,))) == "-1 or an integer >= 1"
    assert math.nan not in domains.Domain(float) and math.inf not in domains.Domain(float, 0)


# --- required values and files read before the first step -----------------------------------------

def _recipe_without(tmp_path, key: str) -> str:
    import yaml

    recipe = yaml.safe_load(open(DENSE))
    recipe.pop(key)
    path = tmp_path / f"without_{key}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_lr_is_required(tmp_path):
    assert refused(recipe=_recipe_without(tmp_path, "lr")) == (
        "--lr=None: --lr is required: megatron's learning-rate schedule starts from it (there is no default)")


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "max_position_embeddings"])
def test_values_megatron_requires_are_named(tmp_path, key):
    line = refused(recipe=_recipe_without(tmp_path, key))
    flag = "--" + key.replace("_", "-")
    assert line.startswith(f"{flag}: required, megatron has no default for it (megatron/training/arguments.py:")


def test_a_recipe_that_is_not_yaml_is_named_with_line_and_column(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("num_layers: 4\nhidden_size: [64\nlr: 1.0\n")
    line = refused(recipe=str(path))
    assert line.startswith(f"--recipe={path}: not valid YAML at line 3, column 3:"), line


@pytest.mark.parametrize("flag", ["--tensorboard-dir", "--data-cache-path"])
def test_directories_written_before_the_first_step_must_be_writable(tmp_path, flag):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert refused(flag, str(blocker / "below")) == (
        f"{flag}={blocker / 'below'}: must be a directory this user can create or write "
        "(it is written before the first step)")


@pytest.mark.parametrize("argv, flag", [(["--yaml-cfg", "c.yaml"], "--yaml-cfg"),
                                        (["--spec", "my.module", "layer_spec"], "--spec")])
def test_flags_this_loop_does_not_read_are_refused(argv, flag):
    assert refused(*argv).startswith(f"{flag}=")
