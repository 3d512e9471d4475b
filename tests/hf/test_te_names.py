"""An import (the local spec's names) loads into the transformer-engine spec and back
(megatron_ext/checkpoint/te_names.py), for every family of docs/hf.md: the transformer-engine model is built
on this CPU machine with megatron_ext/seams/te_spec.py's stand-ins (megatron-core's own sharded_state_dict
methods), under --moe-grouped-gemm for the MoE families (TEGroupedMLP), loads the import through the
project's checkpointer and saves a checkpoint with transformer-engine's names; the local spec loads that
one and saves again. And `--dry-run --platform cuda --assume-te --load C --finetune` places every key of C,
or refuses by name the one it cannot place."""
from __future__ import annotations

import numpy as np
import pytest

from tests.dist import run_distributed
from tests.hf import models, te_jobs

# the same tensor's name in a local-spec checkpoint -> in a transformer-engine one, where they differ (read
# from megatron-core 0.19.2's layer specs: the local spec maps every layer's pre-MLP norm into linear_fc1,
# a MoE layer on transformer-engine has its own norm; multi-latent attention fuses its q / kv norms into
# the up projections and, in dense layers, the pre-MLP norm into linear_fc1)
RENAMED = {
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}
MLA = ("deepseek_v3", "deepseek_v2", "deepseek_v2_lite", "kimi_k2")


def _bitwise(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _in_te(key: str, te: dict) -> str:
    """The transformer-engine checkpoint's name of a local checkpoint's key."""
    if key in te:
        return key
    found = [key[: -len(tail)] + other for tail, other in RENAMED.items() if key.endswith("." + tail)]
    assert len(found) == 1 and found[0] in te, (key, found)
    return found[0]


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    root = tmp_path_factory.mktemp("te_names")
    hf_dirs = {family: models.make(root, family) for family in models.FAMILIES}
    return run_distributed(1, "tests.hf.te_jobs:round_trip", hf_dirs=hf_dirs, root=str(root))[0]


@pytest.mark.parametrize("family", list(models.FAMILIES))
def test_local_to_transformer_engine_to_local_is_bitwise(round_trips, family):
    r = round_trips[family]
    imported, te, back = r["imported"], r["te"], r["back"]
    # local -> TE -> local: the same keys, every tensor bit for bit
    assert back.keys() == imported.keys()
    assert [k for k in imported if not _bitwise(imported[k], back[k])] == []
    # the TE checkpoint: every tensor of the import, under TE's name where the specs differ, and nothing else
    names = {k: _in_te(k, te) for k in imported}
    assert sorted(names.values()) == sorted(te)
    assert [k for k in imported if not _bitwise(imported[k], te[names[k]])] == []
    renamed = {k: v for k, v in names.items() if k != v}
    if family in MLA:  # q (with query LoRA) and kv norms fused, the dense first layer's pre-MLP norm into fc1
        assert {k.rsplit(".", 2)[-2] for k in renamed} >= {"kv_layernorm", "pre_mlp_layernorm"}, renamed
    elif family in te_jobs.MOE:  # every MoE layer's pre-MLP norm is its own
        assert renamed and all(v.endswith("pre_mlp_layernorm.weight") for v in renamed.values()), renamed
    else:  # dense: the local spec writes the fused names already
        assert renamed == {}
    # built as a cluster builds it: transformer-engine's spec, grouped-GEMM experts for MoE (TEGroupedLinear)
    assert r["te_spec"] == "transformer_engine"
    assert any(n.endswith("experts.linear_fc1.weight0") for n in r["te_model_names"]) == (family in te_jobs.MOE)
    # what the dry-run said before each load
    for report, spec in ((r["te_report"], "transformer_engine"), (r["back_report"], "local")):
        assert report.startswith(f"iter_0000000: every weight placed in the {spec} spec: {len(imported)}"), report


def test_dry_run_refuses_a_key_it_cannot_place(tmp_path):
    """One line naming the key: a checkpoint weight the model has no place for (the import has
    query/key norms, the recipe's model not), a model weight the checkpoint lacks; the first loads
    with megatron's --dist-ckpt-strictness log_all, and a real load refuses the second as the dry-run does."""
    hf_dirs = {family: models.make(tmp_path, family) for family in ("qwen3", "llama")}
    out = run_distributed(1, "tests.hf.te_jobs:refusals", hf_dirs=hf_dirs, root=str(tmp_path))[0]
    assert out["unplaced"] == (
        f"--load={out['qwen3']}: the checkpoint's decoder.layers.self_attention.k_layernorm.weight (and 1 more) "
        "has no place in this run's model (transformer_engine spec); --dist-ckpt-strictness log_all loads "
        "without it"), out
    assert out["log_all"].startswith("iter_0000000: every weight placed in the transformer_engine spec: 9"), out
    missing = (f"--load={out['llama']}: the checkpoint has no decoder.layers.self_attention.k_layernorm.weight "
               "(and 1 more), which this run's model ({spec} spec) loads, under its own name or the other spec's")
    assert out["missing"] == missing.format(spec="transformer_engine"), out
    assert out["missing_at_load"] == missing.format(spec="local"), out


def test_strictness_as_megatron_reads_it():
    """--dist-ckpt-strictness: megatron's "unexpected" keys are the model's that the checkpoint lacks,
    its "missing" ones the checkpoint's that the model lacks; only the default (which checks nothing
    and would drop a weight without a word) and the raising values refuse the latter. An optimizer's
    state does not load across specs."""
    from megatron_ext.checkpoint import te_names

    unplaced, missing = te_names.Placement(unplaced=["x.weight"]), te_names.Placement(missing=["y.weight"])
    refused = {value: tuple(p.refusal("C", "local", value) is not None for p in (unplaced, missing))
               for value in ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                             "return_unexpected", "return_all", "ignore_all")}
    assert refused == {"assume_ok_unexpected": (True, True), "log_unexpected": (False, False),
                       "log_all": (False, False), "raise_unexpected": (False, True), "raise_all": (True, True),
                       "return_unexpected": (False, False), "return_all": (False, False),
                       "ignore_all": (False, False)}
    renamed = te_names.Placement(renamed={"a.pre_mlp_layernorm.weight": "a.mlp.linear_fc1.layer_norm_weight"})
    assert renamed.refusal("C", "local") is None  # weights only: placed by the other spec's name
    assert "load its weights with --finetune or --no-load-optim" in renamed.refusal("C", "local", with_optimizer=True)
    assert te_names.counterparts("decoder.layers.3.pre_mlp_layernorm.weight") == [
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"]
    assert te_names.counterparts("decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight") == [
        "decoder.layers.self_attention.kv_layernorm.weight"]
    assert te_names.counterparts("decoder.layers.self_attention.linear_qkv.weight") == []
