"""LoRA checkpoints hold the adapters and their optimizer state only, with the base they apply to
recorded; a resume from one is exact (bitwise losses against an uninterrupted run); megatron's
--pretrained-checkpoint names the base; --finetune from an adapter checkpoint loads its adapters;
what cannot load is refused in one line. TP2 + sequence parallelism with the distributed optimizer
(sharded adapter factors and optimizer state) and dropout on (the RNG state matters)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.dist import run_distributed

BASE = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data", "--num-layers", "2", "--log-interval", "1",
        "--lr-warmup-iters", "0", "--hidden-dropout", "0.1", "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--use-distributed-optimizer", "--save-interval", "1000", "--world-size", "2"]
LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0.1"]


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora_ckpt"))
    return run_distributed(2, "tests.lora.jobs:checkpoint_story", base_argv=BASE, lora_argv=LORA, root=root)


def _losses(result):
    return [(h["iteration"], h["lm loss"], h["grad norm"]) for h in result["history"]]


def test_resume_from_the_adapter_checkpoint_is_exact(story):
    last = story[-1]
    for step in ("base", "full_pretrained", "first", "resumed", "pretrained", "finetuned"):
        assert "error" not in last[step], (step, last[step].get("error"))
    # uninterrupted: --pretrained-checkpoint, which is --finetune --load of the base (the first 2)
    straight = _losses(last["pretrained"])
    assert len(straight) == 4
    assert _losses(last["first"]) + _losses(last["resumed"]) == straight


def test_pretrained_checkpoint_without_lora_fine_tunes_from_it(story):
    """megatron's --pretrained-checkpoint: --load holds nothing yet, so the run fine-tunes from it."""
    last = story[-1]
    assert len(_losses(last["full_finetune"])) == 1
    assert _losses(last["full_pretrained"]) == _losses(last["full_finetune"])


def test_the_checkpoint_holds_adapters_only_and_names_its_base(story):
    r = story[0]
    keys = r["keys"]
    assert keys and all(".lora." in k for k in keys if k.startswith("model0.") or k.startswith("decoder")), keys
    assert any(k.endswith("lora_A.weight") for k in keys) and any(k.endswith("lora_B.weight") for k in keys)
    assert not any(k.endswith(("linear_qkv.weight", "word_embeddings.weight", "layer_norm_weight")) for k in keys)
    assert any("optimizer" in k for k in keys)  # their optimizer state
    assert r["model_numel"] == sum(v.size for v in r["resumed"]["values"].values())  # the adapters, whole
    rec = r["record"]
    assert {k: rec[k] for k in ("rank", "alpha", "rslora", "fused")} == {"rank": 8, "alpha": 16.0, "rslora": False,
                                                                       "fused": None}
    assert rec["base"] == {**r["base_identity"], "path": os.path.abspath(r["base_identity"]["path"])}
    assert rec["base"]["checksum"] is not None


def test_finetune_from_the_adapter_checkpoint_loads_its_adapters(story):
    for r in story:  # the adapters at the end of the resumed run are the ones saved at its exit
        final, loaded = r["resumed"]["values"], r["finetuned"]["values"]
        assert final.keys() == loaded.keys() and final
        for k in final:
            assert np.array_equal(final[k], loaded[k]), k
        assert r["finetuned"]["history"] == []


def test_what_cannot_load_is_refused_in_one_line(story):
    r = story[0]
    assert r["refused_no_lora"]["error"].startswith("--load=") and "--lora-rank 8" in r["refused_no_lora"]["error"]
    assert "holds adapters of other flags" in r["refused_rank"]["error"]
    assert "another base" in r["refused_base"]["error"]
    for step in ("refused_no_lora", "refused_rank", "refused_base"):
        assert "\n" not in r[step]["error"]
