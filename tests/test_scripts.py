"""Every script of scripts/ runs end to end in the suite: a benchmark or tool whose full run takes minutes
in its --smoke form (tiny sizes, seconds), here, or the whole script by the test named for it. Here a
script's main() runs in this process as its command line would, its ranks on the suite's warm gloo
workers (tests/dist.py) where the script launches a fresh world of its own
(megatron_ext.measure.launch.run_world): the same function on every rank, without paying each
rank's imports again."""
from __future__ import annotations

import glob
import json
import os

import pytest

from tests.dist import run_distributed
from tests.scripts import ROOT, load_script

# script -> the test that runs it end to end: "here" (this file: its smoke form) or a test elsewhere,
# named as path::test
RUN_BY = {
    "bench_ckpt": "not yet: no --smoke",
    "bench_convert": "not yet: no --smoke",
    "bench_dispatcher": "not yet: no --smoke",
    "bench_fsdp": "here",
    "bench_gather": "not yet: no --smoke",
    "bench_lora": "not yet: no --smoke",
    "bench_offload": "here",
    "bench_overlap": "not yet: no --smoke",
    "bench_plan": "not yet: no --smoke",
    "bench_startup": "not yet: no --smoke",
    "convert": "tests/test_docs.py::test_doc_commands_run",
    "estimate_memory": "here",
    "flags_doc": "here",
    "gloo_coalesced_crash": "not yet: no --smoke",
    "gpu_check": "tests/test_gpu_check.py::test_smoke_exits_clean_and_writes_json_and_markdown",
    "pins": "tests/test_pins.py::test_a_package_at_another_version_or_missing_is_named",
    "plan": "not yet: no --smoke",
    "prepare_data": "tests/test_prepare_data.py",
    "soak": "not yet: no --smoke",
    "stress_fsdp": "not yet: no --smoke",
}


def test_every_script_says_where_it_runs_end_to_end():
    scripts = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "scripts", "*.py")))
    assert sorted(RUN_BY) == scripts
    for script, where in RUN_BY.items():
        if where.startswith("tests/"):
            path, _, test = where.partition("::")
            source = open(os.path.join(ROOT, path)).read()
            assert script in source and (not test or f"def {test}(" in source), (script, where)


@pytest.fixture
def pooled(monkeypatch):
    """run_world on the suite's warm workers: fn(**kwargs) on every rank of a gloo world, results in
    rank order, as the script's own fresh world returns them."""
    from megatron_ext.measure import launch

    def run_world(world_size, fn, timeout=900, **kwargs):
        return run_distributed(world_size, f"{fn.__module__}:{fn.__qualname__}", **kwargs)

    monkeypatch.setattr(launch, "run_world", run_world)


def _main(script: str, argv: list, capsys):
    """(exit status, stdout) of the script's main on this command line."""
    status = load_script(script).main(argv)
    return status, capsys.readouterr().out


def test_bench_offload_smoke(pooled, capsys):
    """docs/offload.md's table in its smoke form: every schedule and model, every PP rank, R >= 0.99
    and loss and gradients bit-identical with offload."""
    status, out = _main("bench_offload", ["--smoke", "--json"], capsys)
    cases = json.loads(out)["cases"]
    assert status == 0
    assert {(c["schedule"], c["model"], c["pp_rank"]) for c in cases} == {
        (s, m, r) for s, ranks in (("PP=1", 1), ("PP=2 1F1B", 2), ("PP=2xVPP=2", 2)) for m in ("dense", "moe")
        for r in range(ranks)}
    assert all(c["R"] >= 0.99 and c["grads_bitwise_equal"] and c["offloaded_bytes"] > 0 for c in cases), cases


def test_bench_fsdp_smoke(pooled, capsys):
    """docs/fsdp.md's table in its smoke form: Megatron-FSDP with our seams does host work flat in the
    number of experts, the stock paths grow with it; every fetched byte is released."""
    status, out = _main("bench_fsdp", ["--smoke", "--json"], capsys)
    rows = {(c["wrapper"], c["impl"], c["E"]): c for c in json.loads(out)["cases"]}
    small, large = load_script("bench_fsdp").SMOKE_EXPERTS
    assert status is None and len(rows) == 6
    ours = [rows["megatron_fsdp", "ours", e]["host_ops_per_layer"] for e in (small, large)]
    stock = [rows["megatron_fsdp", "stock", e]["host_ops_per_layer"] for e in (small, large)]
    assert ours[0] == ours[1] and stock[1] > stock[0] > ours[0], (ours, stock)
    assert all(c["released_bytes_per_layer"] == c["bytes_after_fetch_per_layer"] > 0 for c in rows.values())


def test_estimate_memory_and_flags_doc(capsys):
    """Two tools of a few seconds, whole: the memory estimate of a recipe (JSON rows), the flags page."""
    status, out = _main("estimate_memory", ["recipes/tiny_moe.yaml", "--json"], capsys)
    assert status in (None, 0) and json.loads(out)
    status, out = _main("flags_doc", [], capsys)
    assert status in (None, 0) and out == open(os.path.join(ROOT, "docs", "flags.md")).read()
