"""Parallel, streaming Hugging Face conversion (megatron_ext/hf/shards.py, convert.py): an import on 4
processes under TP2 x EP2 writes the checkpoint a one-process import writes, bit for bit once loaded,
each rank reading exactly the bytes of the tensors it holds; an export on 2 processes gives each a
pipeline stage, writes the original tensors bit for bit, each rank only its stage's; an export or
import never leaves stale or partial files."""
from __future__ import annotations

import glob
import json
import os

import pytest

import arguments
from megatron_ext.errors import ConfigError
from tests.dist import run_distributed
from tests.hf import models

TP2_EP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
           "--expert-tensor-parallel-size", "1"]
FAMILIES = ("qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """Each family imported on one process and on four (TP2 x EP2), once per module."""
    root = tmp_path_factory.mktemp("parallel")
    hf = {f: models.make(root, f) for f in FAMILIES}
    one = run_distributed(1, "tests.hf.jobs_convert:import_counting_reads",
                          imports=[(hf[f], str(root / f"{f}_1"), []) for f in FAMILIES])
    four = run_distributed(4, "tests.hf.jobs_convert:import_counting_reads",
                           imports=[(hf[f], str(root / f"{f}_4"), TP2_EP2) for f in FAMILIES])
    return {"root": root, "hf": hf, "one": one, "four": four}


def _hf_tensors(d):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _bitwise_differences(a: dict, b: dict) -> list:
    import torch

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))]


def _hf_bytes(d) -> int:
    return sum(t.numel() * t.element_size() for t in _hf_tensors(d).values())


def test_tp2_ep2_import_equals_one_process_import_bitwise(imports):
    root = imports["root"]
    paths = [str(root / f"{f}_{n}" / "iter_0000000") for f in FAMILIES for n in (1, 4)]
    loaded = run_distributed(1, "tests.hf.jobs_convert:plain_tensors", paths=paths)[0]
    for i, family in enumerate(FAMILIES):
        single, parallel = loaded[2 * i], loaded[2 * i + 1]
        assert single.keys() == parallel.keys() and len(single) > 20, family
        assert [k for k in single if single[k] != parallel[k]] == [], family  # dtype, shape and every byte


def test_each_rank_reads_exactly_what_it_holds(imports):
    """One process reads every HF byte once; under TP2 x EP2 each rank reads the bytes of its own
    shard (the slices of its query groups, vocabulary rows, columns; its experts only), no more."""
    for i, family in enumerate(FAMILIES):
        total = _hf_bytes(imports["hf"][family])
        single = imports["one"][0]["imports"][i]
        assert single["read"] == single["held"] == total, (family, single["read"], total)
        ranks = [r["imports"][i] for r in imports["four"]]
        for rank, r in enumerate(ranks):
            assert r["read"] == r["held"] < 0.75 * total, (family, rank, r["read"], r["held"], total)
        # the two EP ranks of a TP rank read different experts: neither reads the other's
        experts = [{t for t in r["tensors"] if ".experts." in t} for r in ranks]
        assert experts[0] and not experts[0] & experts[1], family


def test_export_on_two_stages_is_the_original_and_each_rank_writes_its_layers(imports):
    """Qwen3-MoE's 3 layers on 2 pipeline stages (2 + 1): the TP2 x EP2 import exported, every tensor
    bit-identical to the original; rank 0 wrote the embedding and layers 0-1, rank 1 layer 2, the
    final norm and the output layer; the index names every shard."""
    root = imports["root"]
    out = str(root / "qwen3_moe_out2")
    ranks = run_distributed(2, "tests.hf.jobs_convert:export_recording_stages", load=str(root / "qwen3_moe_4"), out=out)
    assert ranks[0]["iteration"] == 0 and ranks[0]["names"] == ranks[1]["names"]
    original, exported = _hf_tensors(imports["hf"]["qwen3_moe"]), _hf_tensors(out)
    assert _bitwise_differences(original, exported) == []

    def layers(names):
        return {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}

    assert layers(ranks[0]["written"]) == {0, 1} and "model.embed_tokens.weight" in ranks[0]["written"]
    assert layers(ranks[1]["written"]) == {2} and {"model.norm.weight", "lm_head.weight"} <= set(ranks[1]["written"])
    assert set(ranks[0]["written"]) | set(ranks[1]["written"]) == set(original)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"].values()) == set(ranks[0]["names"])
    assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors")) == sorted(ranks[0]["names"])


def test_export_never_leaves_stale_or_partial_files(imports):
    """An earlier single-file export in the directory: refused (nothing touched); with overwrite the
    directory is replaced as a whole (no old file left beside the new shards); a failure part-way on
    one rank while another still writes leaves the previous export as it was and no staging directory."""
    from megatron_ext import hf

    root = imports["root"]
    out = root / "stale"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old weights")
    (out / "notes.txt").write_text("kept until replaced")
    with pytest.raises(ConfigError, match=r"--hf=.*stale: not empty \(an export writes a fresh directory; "
                                          r"--overwrite replaces it as a whole\)"):
        hf.export_hf(str(root / "qwen3_moe_1"), str(out), parse=arguments.parse)
    assert sorted(os.listdir(out)) == ["model.safetensors", "notes.txt"]
    failed = run_distributed(2, "tests.hf.jobs_convert:export_recording_stages", load=str(root / "qwen3_moe_1"),
                             out=str(out), fail_after=1, overwrite=True, slow_rank=1)
    # rank 1 was still writing when rank 0 failed: the staging directory went once both had stopped
    assert [r["error"] for r in failed] == ["stopped part-way through the export"] * 2 and failed[1]["written"], failed
    assert sorted(os.listdir(out)) == ["model.safetensors", "notes.txt"]
    assert not os.path.exists(str(out) + ".partial") and not os.path.exists(str(out) + ".replaced")
    done = run_distributed(1, "tests.hf.jobs_convert:export_recording_stages", load=str(root / "qwen3_moe_1"),
                           out=str(out), overwrite=True)[0]
    assert done["error"] is None and "model.safetensors" not in done["names"]
    assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors")) == sorted(done["names"])
    assert "notes.txt" not in os.listdir(out) and not os.path.exists(str(out) + ".replaced")
    assert _hf_tensors(str(out)).keys() == _hf_tensors(imports["hf"]["qwen3_moe"]).keys()


def test_failed_import_leaves_nothing_and_overwrite_replaces(imports, tmp_path):
    """A shape the config does not describe, found once the model is built and the directory made:
    the import removes what it wrote. An import over an earlier directory (a stale later checkpoint in
    it) is refused, or with overwrite replaced: only the import's checkpoint is left."""
    import shutil

    from megatron_ext import hf

    bad_hf = str(tmp_path / "bad_hf")
    shutil.copytree(imports["hf"]["qwen3_moe"], bad_hf)
    with open(os.path.join(bad_hf, "config.json")) as f:
        config = json.load(f)
    config["moe_intermediate_size"] = 16
    with open(os.path.join(bad_hf, "config.json"), "w") as f:
        json.dump(config, f)
    save = str(tmp_path / "ckpt")
    error = run_distributed(2, "tests.hf.jobs_convert:import_refused", hf_dir=bad_hf, save=save, flags=TP2_EP2[:3])
    assert "does not match the config's" in error[0] and error[0] == error[1], error
    assert not os.path.exists(save) and not os.path.exists(save + ".replaced")

    os.makedirs(os.path.join(save, "iter_0000009"))
    with pytest.raises(ConfigError, match=r"--save=.*ckpt: not empty \(an import writes a fresh directory"):
        hf.import_hf(imports["hf"]["qwen3_moe"], save, parse=arguments.parse)
    run_distributed(1, "tests.hf.jobs_convert:import_overwriting", hf_dir=imports["hf"]["qwen3_moe"], save=save)
    assert sorted(os.listdir(save)) == ["iter_0000000", "latest_checkpointed_iteration.txt", "recipe.yaml", "tokenizer"]


def test_logits_file_is_written_whole_or_not_at_all(tmp_path):
    from megatron_ext import hf

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot be written")

    path = str(tmp_path / "logits.pt")
    with pytest.raises(RuntimeError, match="cannot be written"):
        hf.save_logits([1.0] * 100000 + [Unpicklable()], path)
    assert os.listdir(tmp_path) == []
