"""A model trained from a recipe goes to transformers (megatron_ext/hf/trained.py, tokenizer_files.py):
a dense and a MoE recipe trained under TP2 x PP2 (4 gloo processes) export as the family that represents
them (Llama, Mixtral), and transformers' fp32 forward on the export is ours; the dense run's tokenizer,
trained by scripts/prepare_data.py --train-tokenizer, goes with it (the same ids), and its validation
loss is transformers' loss on the same tokens; an architecture no family represents, a NullTokenizer,
a SentencePiece model the export finds inexact (the dense run exported again: the same weights, no
tokenizer), a disagreeing --vocab-size, a too-small or empty --train-tokenizer: one line each."""
from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.dist import run_distributed
from tests.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 16
IDS = [3, 17, 100, 5, 250, 42, 7, 200, 1, 2, 130, 60]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
RUN = ["--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2",
       "--lr-warmup-iters", "0", "--log-interval", "1", "--num-workers", "0", "--world-size", "4",
       "--save-interval", "2", *TP2_PP2]


def _recipe(root, name: str, **changes) -> str:
    with open(os.path.join(ROOT, "recipes", name)) as f:
        recipe = yaml.safe_load(f)
    for key in [k for k, v in changes.items() if v is None]:
        recipe.pop(key, None)
        changes.pop(key)
    recipe.update(changes)
    path = str(root / name)
    with open(path, "w") as f:
        yaml.safe_dump(recipe, f)
    return path


def _dataset(prefix: str, documents: list) -> str:
    """An indexed dataset of these token-id documents."""
    import numpy as np

    from megatron_ext import platform

    platform.setup()
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for doc in documents:
        builder.add_document(np.asarray(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(get_idx_path(prefix))
    return prefix


def _text(n: int = 3) -> list:
    import glob
    import sysconfig

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))[:n]
    return [open(f, encoding="utf-8").read() for f in files]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tokenizer of 320 ids trained on a corpus (prepare_data --train-tokenizer), the corpus tokenized
    with it (one training document) and a validation document whose every sample is the same SEQ + 1
    tokens; a Llama-shaped recipe (GQA, RMSNorm, SwiGLU, RoPE, no biases; its vocab_size 257 gives way
    to the tokenizer's) trained 2 iterations under TP2 x PP2 and validated; exported on the 4
    processes, our logits taken under TP2 x PP2."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("trained_dense")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in _text()))
    prepared = load_script("prepare_data").main(["--input", str(corpus), "--train-tokenizer", "320",
                                                 "--output-prefix", str(root / "corpus")])
    tokenizer = AutoTokenizer.from_pretrained(prepared["tokenizer"])
    period = tokenizer("def decode(self, s):\n        return self.scan_once(s, idx=0)")["input_ids"][:SEQ]
    assert len(period) == SEQ
    # the corpus as it was tokenized, then the validation document: every sample of it (SEQ + 1 tokens
    # from a multiple of SEQ) is the period and its first token again
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    corpus_ids = [int(t) for doc in IndexedDataset(prepared["prefix"]) for t in doc]
    data = _dataset(str(root / "data"), [corpus_ids, period * 4])
    recipe = _recipe(root, "tiny_dense.yaml", data_path=[data], split="50,50,0", group_query_attention=True,
                     num_query_groups=2, eval_iters=1, eval_interval=1000)
    save, out = str(root / "run"), str(root / "hf")
    argv = ["--recipe", recipe, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", prepared["tokenizer"],
            "--save", save, *RUN]
    again = {"recipe": _sentencepiece_recipe(root, recipe, str(corpus)), "out": str(root / "hf_sentencepiece")}
    result = run_distributed(4, "tests.hf.jobs_trained:train_export_logits", argv=argv, save=save, out=out, ids=IDS,
                             layout=TP2_PP2, again=again)
    return {"root": root, "tokenizer": prepared["tokenizer"], "period": period, "save": save, "out": out,
            "again": again["out"], "ranks": result}


def _sentencepiece_recipe(root, recipe: str, corpus: str) -> str:
    """The dense recipe with a SentencePiece word model of 300 pieces trained on the corpus (a model
    the export finds inexact; its 320 padded rows are the run's): the run exported again under it."""
    import sentencepiece

    lines = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter("".join(lines).splitlines()),
                                             model_prefix=str(root / "word"), model_type="word", vocab_size=300,
                                             minloglevel=2)
    with open(recipe) as f:
        changed = yaml.safe_load(f)
    changed.update(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(root / "word.model"))
    path = str(root / "sentencepiece.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(changed, f)
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The tiny MoE recipe (4 experts, top-2, renormalised: Mixtral's routing), byte-level NullTokenizer,
    trained 2 iterations under TP2 x PP2 (sequence parallel, EP2) on mock data; exported, our logits taken."""
    root = tmp_path_factory.mktemp("trained_moe")
    recipe = _recipe(root, "tiny_moe.yaml", num_experts=4)
    save, out = str(root / "run"), str(root / "hf")
    argv = ["--recipe", recipe, "--save", save, "--sequence-parallel", "--expert-model-parallel-size", "2",
            "--expert-tensor-parallel-size", "1", *RUN]
    result = run_distributed(4, "tests.hf.jobs_trained:train_export_logits", argv=argv, save=save, out=out, ids=IDS,
                             layout=[*TP2_PP2, "--sequence-parallel"])
    return {"root": root, "save": save, "out": out, "ranks": result}


def _ours(stderr: str) -> list:
    """The lines the export printed (not the libraries' warnings, which the CLI filters: errors.quiet)."""
    return [line for line in stderr.splitlines() if line.startswith(("warning:", "error:", "note:"))]


def _hf_model(out: str):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _assert_logits_equal(out: str, ours, architecture: str):
    """transformers' fp32 forward on the export is ours (to float rounding: 1e-5 of the largest logit)."""
    import torch

    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == [architecture]
    model = _hf_model(out)
    with torch.no_grad():
        theirs = model(torch.tensor([IDS])).logits[0]
    ours = torch.as_tensor(ours)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max(), (ours - theirs).abs().max()
    return model


def test_a_dense_recipe_trained_under_tp2_pp2_exports_as_llama_with_its_tokenizer(dense):
    from transformers import AutoTokenizer

    rank0 = dense["ranks"][0]
    assert rank0["iteration"] == 2 and len(rank0["losses"]) == 2, rank0["losses"]
    assert "note: the recipe's vocab_size 257 gives way to the HuggingFaceTokenizer's 320 ids" in rank0["printed"]
    assert not _ours(rank0["export stderr"]), rank0["export stderr"]
    _assert_logits_equal(dense["out"], rank0["logits"], "LlamaForCausalLM")
    # the checkpoint records the trained tokenizer (a copy beside its recipe) and no vocab_size
    ckpt = os.path.join(dense["save"], "iter_0000002")
    with open(os.path.join(ckpt, "recipe.yaml")) as f:
        recorded = yaml.safe_load(f)
    assert recorded["tokenizer_type"] == "HuggingFaceTokenizer" and "vocab_size" not in recorded
    assert recorded["tokenizer_model"] == os.path.join(os.path.abspath(dense["save"]), "iter_0000002", "tokenizer")
    with open(os.path.join(dense["tokenizer"], "tokenizer.json")) as a, \
            open(os.path.join(recorded["tokenizer_model"], "tokenizer.json")) as b:
        assert a.read() == b.read()
    text = "".join(_text(1))[:2000]
    exported, trained = AutoTokenizer.from_pretrained(dense["out"]), AutoTokenizer.from_pretrained(dense["tokenizer"])
    assert exported(text)["input_ids"] == trained(text)["input_ids"] and len(trained(text)["input_ids"]) > 300


def test_a_sentencepiece_model_the_export_finds_inexact_is_refused_in_one_line_and_the_weights_written(dense):
    """The dense run exported again under its recipe with a SentencePiece word model: one line naming the
    first text whose ids differ and the model; the weights and config.json written, no tokenizer file."""
    import torch
    from safetensors.torch import load_file

    assert _ours(dense["ranks"][0]["again stderr"]) == [
        "warning: --tokenizer-type=SentencePieceTokenizer: the tokenizer is not exported (AutoTokenizer gives other "
        "ids than megatron's for ' one leading space': a sentencepiece word model, nmt_nfkc normalization); the "
        "weights and config.json are"], dense["ranks"][0]["again stderr"]
    weights = sorted(f for f in os.listdir(dense["out"]) if "token" not in f)  # the first export's, but its tokenizer
    assert sorted(os.listdir(dense["again"])) == weights and "config.json" in weights, os.listdir(dense["again"])
    shards = [f for f in weights if f.endswith(".safetensors")]
    assert shards
    for shard in shards:
        ours, theirs = (load_file(os.path.join(d, shard)) for d in (dense["again"], dense["out"]))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), shard


def test_validation_loss_equals_transformers_loss_on_the_same_tokens(dense):
    import torch

    validation = [v["lm loss"] for r in dense["ranks"] for v in r["validation"] if "lm loss" in v]
    assert validation, [r["validation"] for r in dense["ranks"]]
    model = _hf_model(dense["out"])
    sample = torch.tensor([dense["period"] + dense["period"][:1]])
    with torch.no_grad():
        theirs = model(sample, labels=sample).loss.item()
    for ours in validation:
        assert abs(ours - theirs) <= 1e-5, (ours, theirs)


def test_a_moe_recipe_exports_as_mixtral_and_its_null_tokenizer_in_one_line(moe):
    rank0 = moe["ranks"][0]
    assert rank0["iteration"] == 2 and len(rank0["losses"]) == 2
    assert _ours(rank0["export stderr"]) == [
        "warning: --tokenizer-type=NullTokenizer: the tokenizer is not exported (ids 0..255 are the text's bytes and "
        "--vocab-size - 1 is end-of-document; no Hugging Face tokenizer class reads them); the weights and "
        "config.json are"], rank0["export stderr"]
    assert not [f for f in os.listdir(moe["out"]) if "token" in f], os.listdir(moe["out"])
    model = _assert_logits_equal(moe["out"], rank0["logits"], "MixtralForCausalLM")
    assert model.config.num_local_experts == 4 and model.config.num_experts_per_tok == 2


def test_an_architecture_no_family_represents_is_refused_naming_the_property_and_the_closest(tmp_path):
    """LayerNorm with a GELU MLP, biases and learned positions (GPT-2's): the first property no family
    has, and Llama as the closest; a MoE model whose router keeps the softmax over all experts and has no
    qk-norm (Qwen3-MoE's has): Mixtral the closest."""
    import arguments
    from megatron_ext.errors import ConfigError
    from megatron_ext.hf import trained

    gpt2 = _recipe(tmp_path, "tiny_dense.yaml", normalization="LayerNorm", swiglu=False, disable_bias_linear=False,
                   position_embedding_type="learned_absolute", data_path=None, split=None, mock_data=True)
    lines = []
    for argv in (["--recipe", gpt2], ["--recipe", os.path.join(ROOT, "recipes", "tiny_moe.yaml"),
                                      "--moe-router-pre-softmax"]):
        with pytest.raises(ConfigError) as e:
            trained.hf_config(arguments.parse(argv, exit_on_dry_run=False), "RUN")
        lines.append(str(e.value))
    assert lines == [
        "--load=RUN: no Hugging Face family represents this model's --normalization=LayerNorm: the closest, llama, "
        "has RMSNorm and differs in --swiglu=False, --add-bias-linear=True, --add-qkv-bias=True, "
        "--position-embedding-type=learned_absolute",
        "--load=RUN: no Hugging Face family represents this model's --moe-router-pre-softmax=True: the closest, "
        "mixtral, has False"], lines


def test_gpt2_bpe_files_export_as_the_same_ids(dense, tmp_path):
    """A GPT2BPETokenizer run's --vocab-file and --merge-file are written as transformers' GPT-2
    tokenizer: AutoTokenizer gives the ids megatron's GPT2BPETokenizer gives (prepare_data's)."""
    import argparse

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from megatron_ext.hf import tokenizer_files

    files = Tokenizer.from_file(os.path.join(dense["tokenizer"], "tokenizer.json")).model.save(str(tmp_path))
    vocab, merges = sorted(files, key=lambda f: not f.endswith(".json"))
    prepare = load_script("prepare_data")
    args = prepare.get_args(["--input", "x", "--output-prefix", "x", "--tokenizer-type", "GPT2BPETokenizer",
                             "--vocab-file", vocab, "--merge-file", merges])
    megatron_tokenizer = prepare.build_tokenizer(args)
    out = tmp_path / "hf"
    out.mkdir()
    assert tokenizer_files.write(argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab,
                                                    merge_file=merges), str(out)) is None
    text = "".join(_text(2))[:3000] + " naïve café 日本"
    ids = AutoTokenizer.from_pretrained(str(out))(text)["input_ids"]
    assert ids == list(megatron_tokenizer.tokenize(text)) and len(ids) > 500
    assert AutoTokenizer.from_pretrained(str(out)).eos_token_id == megatron_tokenizer.eod


def test_bad_tokenizer_input_is_one_line_each(tmp_path):
    """--train-tokenizer below the byte alphabet, or on an empty corpus; a --vocab-size on the command
    line that disagrees with the tokenizer."""
    import arguments
    from megatron_ext.errors import ConfigError

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    lines = []
    for size in ("100", "300"):
        with pytest.raises(SystemExit) as e:
            load_script("prepare_data").main(["--input", str(empty), "--train-tokenizer", size, "--output-prefix",
                                              str(tmp_path / "out")])
        lines.append(str(e.value.code))
    assert lines == ["error: --train-tokenizer=100: below the byte alphabet (256 bytes + 1 special token = 257 ids)",
                     "error: --train-tokenizer=300: the corpus is empty (no text in 1 input files)"]
    assert sorted(os.listdir(tmp_path)) == ["empty.txt"]
    tokenizer = os.path.join(ROOT, "recipes", "tiny_sft", "tokenizer")  # 320 ids
    with pytest.raises(ConfigError) as e:
        arguments.parse(["--recipe", os.path.join(ROOT, "recipes", "tiny_dense.yaml"), "--tokenizer-type",
                         "HuggingFaceTokenizer", "--tokenizer-model", tokenizer, "--vocab-size", "300"],
                        exit_on_dry_run=False)
    assert str(e.value) == ("--vocab-size=300: the HuggingFaceTokenizer has 320 ids (the vocabulary size comes from "
                            "the tokenizer: leave --vocab-size out)")
