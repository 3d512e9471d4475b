"""--moe-sync-free-dispatcher: declared once, no clash with megatron's flags, validated early."""
import argparse

import pytest

from megatron_ext import moe
from megatron_ext.errors import ConfigError
from tests.parsed import parsed_args


def test_flag_added_to_megatron_parser_without_clash():
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    megatron_options = {o for a in parser._actions for o in a.option_strings}
    assert moe.FLAG not in megatron_options
    moe.add_arguments(parser)  # argparse raises on a conflicting option string
    assert parser.parse_args([moe.FLAG]).moe_sync_free_dispatcher is True
    assert parser.parse_args([]).moe_sync_free_dispatcher is False


def ns(**kw):
    base = dict(moe_sync_free_dispatcher=True, num_experts=8, moe_token_dispatcher_type="alltoall",
                moe_permute_fusion=False, moe_shared_expert_overlap=False,
                moe_router_padding_for_quantization=False, moe_pad_expert_input_to_capacity=False,
                moe_expert_capacity_factor=None)
    base.update(kw)
    return parsed_args(**base)


def test_validate_accepts_supported():
    moe.validate(ns())
    moe.validate(ns(moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=1.0,
                    moe_pad_expert_input_to_capacity=True))
    moe.validate(ns(moe_sync_free_dispatcher=False, moe_token_dispatcher_type="flex"))  # flag off: no opinion


@pytest.mark.parametrize("kw,expect", [
    (dict(moe_token_dispatcher_type="flex"), "--moe-token-dispatcher-type=flex"),
    (dict(num_experts=None), "--num-experts"),
    (dict(moe_permute_fusion=True), "--moe-permute-fusion"),
    (dict(moe_router_padding_for_quantization=True), "--moe-router-padding-for-quantization"),
    (dict(moe_pad_expert_input_to_capacity=True), "--moe-expert-capacity-factor"),
])
def test_validate_rejects_with_flag_and_value(kw, expect):
    with pytest.raises(ConfigError) as e:
        moe.validate(ns(**kw))
    assert "--moe-sync-free-dispatcher=True" in str(e.value) and expect in str(e.value)


def test_shared_expert_overlap_is_accepted():
    moe.validate(ns(moe_shared_expert_overlap=True))  # the shared experts run at megatron's hook points


def test_full_argument_path_with_recipe(capsys):
    """arguments.parse (megatron validate_args + features.validate) accepts the flag on the MoE
    recipe, and the recipe key form works too."""
    import arguments

    args = arguments.parse(["--recipe", "recipes/tiny_moe.yaml", moe.FLAG, "--dry-run"], exit_on_dry_run=False)
    assert args.moe_sync_free_dispatcher is True
    assert args.config_sources["moe_sync_free_dispatcher"] == "cli"
    capsys.readouterr()


@pytest.mark.parametrize("kw,expect", [
    (dict(moe_zero_sync_dropless=False, moe_dropless_budget_factor=1.0), "--moe-dropless-budget-factor=1.0: needs"),
    (dict(moe_sync_free_dispatcher=False), "--moe-zero-sync-dropless=True: needs --moe-sync-free-dispatcher"),
    (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor=1.0"),
    # built in code, refused by the flag's own domain check, in its words
    (dict(moe_dropless_budget_factor=0.0), "--moe-dropless-budget-factor=0.0: must be a number > 0 (positive)"),
    (dict(moe_grouped_gemm=True), "--moe-grouped-gemm"),
    (dict(hidden_size=36, bf16=True), "--hidden-size=36"),
])
def test_zero_sync_dropless_refusals(kw, expect):
    base = dict(moe_zero_sync_dropless=True, moe_dropless_budget_factor=None, hidden_size=64, ffn_hidden_size=128,
                moe_ffn_hidden_size=32, bf16=False)
    base.update(kw)
    with pytest.raises(ConfigError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        moe.validate(ns(**base))
    moe.validate(ns(**{**base, **{k: v for k, v in dict(moe_zero_sync_dropless=True, moe_sync_free_dispatcher=True,
                                                          moe_expert_capacity_factor=None, moe_grouped_gemm=False,
                                                          moe_dropless_budget_factor=None, hidden_size=64).items()}}))
