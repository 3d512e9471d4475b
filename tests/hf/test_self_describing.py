"""Runs that describe themselves (megatron_ext/checkpoint/recipe.py): a checkpoint train.py saves
records the model it holds, so a fine-tune, an export and logits of it need no --recipe; and every
failure of scripts/convert.py is one line."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.dist import run_distributed
from tests.hf import models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = ["--mock-data", "--num-workers", "0", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size",
         "2", "--train-iters", "2", "--lr", "1e-2", "--world-size", "2", "--log-interval", "1", "--save-interval", "2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EP2 = ["--expert-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Qwen3-MoE imported; fine-tuned 2 iterations under TP2+SP from the import's recipe (run A); run A
    fine-tuned 2 more under EP2 with no --recipe (run B); each exported and its logits taken with no
    --recipe, run B's under EP2 and after its directory moved."""
    root = tmp_path_factory.mktemp("described")
    hf_dir = models.make(root, "qwen3_moe")
    ckpt, run_a, run_b = str(root / "ckpt"), str(root / "run_a"), str(root / "run_b")
    run_distributed(1, "tests.hf.jobs:import_export", hf_dir=hf_dir, ckpt=ckpt, out=str(root / "import_out"))
    a = run_distributed(2, "tests.hf.jobs_convert:train_then", argv=[
        "--recipe", os.path.join(ckpt, "recipe.yaml"), "--load", ckpt, "--finetune", "--save", run_a, *TRAIN, *TP2_SP],
        after=[])[0]
    b = run_distributed(2, "tests.hf.jobs_convert:train_then", argv=[
        "--load", run_a, "--finetune", "--save", run_b, *TRAIN, *EP2], after=[])[0]
    moved = str(root / "run_b_moved")
    shutil.move(run_b, moved)
    out = {}
    for name, load in (("a", run_a), ("b", moved)):
        out[name] = run_distributed(1, "tests.hf.jobs_convert:train_then", argv=None, after=[
            ("export", ["export", "--load", load, "--hf", str(root / f"{name}_hf")]),
            ("logits", ["logits", "--load", load, "--input-ids", ",".join(map(str, models.IDS)),
                        "--out", str(root / f"{name}_logits.pt")])])[0]
    out["b ep2"] = run_distributed(2, "tests.hf.jobs_convert:train_then", argv=None, after=[
        ("logits", ["logits", "--load", moved, "--input-ids", ",".join(map(str, models.IDS)),
                    "--out", str(root / "b_logits_ep2.pt"), *EP2])])[0]
    return {"root": root, "hf": hf_dir, "ckpt": ckpt, "a": run_a, "b": moved, "b_trained_at": run_b, "trained": (a, b),
            "out": out}


def test_a_run_records_its_model_not_its_layout(runs):
    a, b = runs["trained"]
    assert a["iterations"] == [1, 2] and b["iterations"] == [1, 2], (a, b)  # --finetune: from iteration 0
    with open(os.path.join(runs["a"], "iter_0000002", "recipe.yaml")) as f:
        text = f.read()
    recipe = yaml.safe_load(text)
    with open(os.path.join(runs["ckpt"], "recipe.yaml")) as f:
        imported = yaml.safe_load(f)
    assert recipe["num_experts"] == imported["num_experts"] == 4 and recipe["moe_layer_freq"] == "[0,1,1]"
    assert recipe["tokenizer_model"] == os.path.join(runs["a"], "iter_0000002", "tokenizer")
    assert sorted(os.listdir(recipe["tokenizer_model"])) == sorted(os.listdir(os.path.join(runs["ckpt"], "tokenizer")))
    for run_flag in ("tensor_model_parallel_size", "sequence_parallel", "expert_model_parallel_size", "load", "save",
                     "lr", "train_iters", "mock_data", "finetune"):
        assert run_flag not in recipe, run_flag
    assert "# tensor_model_parallel_size: 2" in text and "# sequence_parallel: true" in text  # the run's, as comments


def test_export_and_logits_need_no_recipe_on_tp2_sp_and_ep2_runs(runs):
    """Both runs export (no --recipe) into HF directories transformers loads, whose forward is our
    forward's logits (no --recipe), on one process and for run B under EP2, after its directory moved;
    the export message's iteration is the newest checkpoint's."""
    import torch

    for name in ("a", "b"):
        done = runs["out"][name]
        assert done["export"] is None and done["logits"] is None, done
        ours = torch.load(str(runs["root"] / f"{name}_logits.pt"))
        models.assert_close(ours, models.hf_logits(str(runs["root"] / f"{name}_hf")))
    assert runs["out"]["b ep2"]["logits"] is None
    models.assert_close(torch.load(str(runs["root"] / "b_logits_ep2.pt")), models.hf_logits(str(runs["root"] / "b_hf")))
    # each fine-tune moved the weights: three different models
    a_hf, b_hf = models.hf_logits(str(runs["root"] / "a_hf")), models.hf_logits(str(runs["root"] / "b_hf"))
    assert not torch.allclose(a_hf, b_hf, atol=1e-3)
    assert not torch.allclose(a_hf, models.hf_logits(runs["hf"]), atol=1e-3)


def test_convert_failures_are_one_line_each(runs, tmp_path):
    """A damaged checkpoint, a foreign one, a missing tokenizer, an export into a non-empty directory, a
    directory without a recipe: one line each, naming what. A model whose tokenizer has no config.json
    (as one trained from a recipe) exports as the family that represents it."""
    run = str(tmp_path / "run")
    shutil.copytree(runs["a"], run)
    damaged = os.path.join(run, "iter_0000002", "__0_0.distcp")
    with open(damaged, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    foreign = tmp_path / "foreign" / "iter_0000001" / "mp_rank_00"
    foreign.mkdir(parents=True)
    (foreign / "model_optim_rng.pt").write_bytes(b"not ours")
    # run B was moved after it was trained: without the copy beside its recipe, the path it records is gone
    untokenized = str(tmp_path / "untokenized")
    shutil.copytree(runs["b"], untokenized)
    shutil.rmtree(os.path.join(untokenized, "iter_0000002", "tokenizer"))
    # a run whose tokenizer has no config.json, as one trained from a recipe: the family that represents
    # it is written (run B moved: the copy beside its recipe is the tokenizer it reads)
    foreign_model = str(tmp_path / "foreign_model")
    shutil.copytree(runs["b"], foreign_model)
    os.remove(os.path.join(foreign_model, "iter_0000002", "tokenizer", "config.json"))
    full = tmp_path / "full"
    full.mkdir()
    (full / "model.safetensors").write_bytes(b"an earlier export")
    out = str(tmp_path / "out")
    lines = run_distributed(1, "tests.hf.jobs_convert:train_then", argv=None, after=[
        ("damaged", ["export", "--load", run, "--hf", out]),
        ("foreign", ["export", "--load", str(tmp_path / "foreign"), "--hf", out,
                     "--recipe", os.path.join(runs["ckpt"], "recipe.yaml")]),
        ("tokenizer", ["export", "--load", untokenized, "--hf", out]),
        ("non-empty", ["export", "--load", runs["a"], "--hf", str(full)]),
        ("not imported", ["export", "--load", foreign_model, "--hf", str(tmp_path / "derived")]),
        ("no recipe", ["logits", "--load", str(tmp_path / "foreign"), "--input-ids", "1,2", "--out", out]),
    ])[0]
    expected = {
        "damaged": f"--load={run}: every checkpoint is damaged ([2]); damaged checkpoint {run}/iter_0000002: "
                   "__0_0.distcp checksum mismatch",
        "foreign": f"--load={tmp_path / 'foreign'}: every checkpoint is damaged (iter_0000001: metadata.json missing)",
        "tokenizer": f"--tokenizer-model={runs['b_trained_at']}/iter_0000002/tokenizer",
        "non-empty": f"--hf={full}: not empty (an export writes a fresh directory; --overwrite replaces it as a whole)",
        "no recipe": f"--load={tmp_path / 'foreign'}: no recipe.yaml there, in its checkpoints or beside them",
    }
    for name, start in expected.items():
        line = lines[name]
        assert line is not None and line.startswith(start) and "\n" not in line, (name, line)
    assert not os.path.exists(out) and not os.path.exists(out + ".partial")
    assert lines["not imported"] is None
    with open(tmp_path / "derived" / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen3MoeForCausalLM"]
    assert sorted(os.listdir(full)) == ["model.safetensors"]


FIRST_READ_FINDS = ({"listing": 1, "recipe": 1, "manifest": 2, "common state": 1}, {},
                    {".metadata": 2, "__0_0.distcp": 2})
LOAD_FINDS = ({"listing": 1, "recipe": 1, "manifest": 2, "common state": 2}, {"manifest": 1, "common state": 1},
              {".metadata": 2, "__0_0.distcp": 2, "__1_0.distcp": 1})


@pytest.mark.parametrize("damaged, expected", [("__0_0.distcp", FIRST_READ_FINDS), ("__1_0.distcp", LOAD_FINDS)])
def test_an_export_falls_back_past_a_damaged_checkpoint_with_load_read_once(runs, tmp_path, damaged, expected):
    """An export hands what it read of --load to its run (checkpoint/reading.py first_read). Run A's
    newest checkpoint damaged in the file holding its common state (the first read finds it and goes on
    to the older one) or in the other rank's file (the load's weight reads find it and fall back): the
    older checkpoint, an import, is exported either way, every checkpoint's manifest and files read once,
    and the run reads only what the first read did not (the older checkpoint, in the second case)."""
    run = str(tmp_path / "run")
    shutil.copytree(runs["a"], run)
    shutil.copytree(os.path.join(runs["ckpt"], "iter_0000000"), os.path.join(run, "iter_0000000"))  # the import
    with open(os.path.join(run, "iter_0000002", damaged), "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    reads = run_distributed(1, "tests.hf.jobs_convert:conversions_counting_reads",
                            conversions=[("export", "hf", run, str(tmp_path / "hf"))])[0]["export"]
    assert reads["iteration"] == 0, reads
    assert (reads["read"], reads["by the run"], reads["summed"]) == expected, reads


def test_cli_failure_before_bring_up_is_one_line(tmp_path):
    """The refusal before anything is set up stays the one line, whatever the cleanup does after it
    (the teardown used to import megatron-core there and fail on triton instead)."""
    (tmp_path / "iter_0000001").mkdir()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "convert.py"), "export", "--load", str(tmp_path),
                        "--hf", str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 1, p
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: --load={tmp_path}: no recipe.yaml there, in its checkpoints or beside them (a checkpoint train.py "
        "saves records one, an import writes one): pass --recipe"), p.stderr
    assert "Traceback" not in p.stderr and not os.path.exists(tmp_path / "out")


def test_recorded_recipe_reads_back_to_the_same_model(tmp_path):
    """Every value a checkpoint records reads back through the parser to the value the run resolved:
    list flags, strings a type function parses (--moe-layer-freq, --window-size, --no-rope-freq),
    enums; a tokenizer file is copied and named by its copy."""
    import arguments
    from megatron_ext.checkpoint import recipe as ckpt_recipe

    vocab = tmp_path / "vocab.json"
    vocab.write_text("{}")
    argv = ["--recipe", os.path.join(ROOT, "recipes", "tiny_moe.yaml"), "--moe-layer-freq", "[0,1,1,1]",
            "--window-size", "3,0", "--no-rope-freq", "[0,1,0,1]", "--activation-offload-modules", "core_attention",
            "qkv_linear", "--attention-backend", "unfused", "--tensor-model-parallel-size", "1",
            "--tokenizer-metadata", str(vocab)]
    args = arguments.parse(argv)
    ckpt_recipe.record(args, str(tmp_path), str(tmp_path))
    recorded = str(tmp_path / "recipe.yaml")
    with open(recorded) as f:
        text = f.read()
    recipe = yaml.safe_load(text)
    assert recipe["moe_layer_freq"] == "[0,1,1,1]" and recipe["window_size"] == "3,0"
    assert recipe["metadata_path"] == str(tmp_path / "tokenizer" / "vocab.json")
    assert (tmp_path / "tokenizer" / "vocab.json").read_text() == "{}"
    assert "# activation_offload_modules:" in text and "# attention_backend: unfused" in text
    assert not {"tensor_model_parallel_size", "activation_offload_modules", "attention_backend", "lr"} & set(recipe)
    again = arguments.parse(["--recipe", recorded, "--mock-data", "--train-iters", "1", "--lr", "0",
                             "--micro-batch-size", "1", "--global-batch-size", "1"])
    for dest in set(recipe) - {"metadata_path"}:
        assert getattr(again, dest) == getattr(args, dest), dest
