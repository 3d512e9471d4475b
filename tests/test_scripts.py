"""Every script of scripts/ runs end to end in the suite: a benchmark or tool whose full run takes minutes
in its --smoke form (tiny sizes, seconds), here or as the docs give it (tests/test_docs.py runs a
documented benchmark command with --smoke), or the whole script by the test named for it. Here a
script's main() runs in this process as its command line would, its ranks on the suite's warm gloo
workers (tests/scripts.py warm_worlds) where the script launches a fresh world of its own
(megatron_ext.measure.launch.run_world): the same function on every rank, without paying each
rank's imports again."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from tests import test_docs, tiers
from tests.scripts import ROOT, load_script, warm_worlds

DOCS = "tests/test_docs.py::test_doc_commands_run"  # a documented command of the script, run (smoke form)

# script -> the test that runs it end to end: "here" (this file: its smoke form) or a test elsewhere,
# named as path::test
RUN_BY = {
    "bench_ckpt": "here",
    "bench_convert": "here",
    "bench_dispatcher": "here",
    "bench_fsdp": "here",
    "bench_gather": "here",
    "bench_long_context": "here",
    "bench_lora": "here",
    "bench_offload": DOCS,
    "bench_overlap": "here",
    "bench_plan": "tests/planner/test_planner.py::test_predicted_peak_within_5_percent_pp2_with_offload",
    "bench_startup": "here",
    "convert": DOCS,
    "estimate_memory": "here",
    "flags_doc": "here",
    "gloo_coalesced_crash": "here",
    "gpu_check": "tests/test_gpu_check.py::test_smoke_exits_clean_and_writes_json_and_markdown",
    "pins": "tests/test_pins.py::test_a_package_at_another_version_or_missing_is_named",
    "plan": "tests/planner/test_planner.py::test_plan_json_components_and_candidates",
    "prepare_data": "tests/test_prepare_data.py",
    "soak": "tests/training/test_restart.py::"
            "test_rank_sigkilled_mid_step_during_an_async_save_restarts_and_resumes_exactly",
}


def test_every_script_says_where_it_runs_end_to_end():
    scripts = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "scripts", "*.py")))
    assert sorted(RUN_BY) == scripts
    # the commands of the pages `make test` runs (a page in `make test-matrix` runs its commands there only)
    documented = {word for doc in test_docs.DOCS if f"{DOCS}[{doc}]" not in tiers.MATRIX
                  for cmd in test_docs.commands(doc) if not test_docs.skipped(cmd)
                  for word in cmd.text.split() if word.startswith("scripts/")}
    for script, where in RUN_BY.items():
        if where == DOCS:  # the docs give a command of it that the doc test runs
            assert f"scripts/{script}.py" in documented, script
        elif where.startswith("tests/"):
            path, _, test = where.partition("::")
            source = open(os.path.join(ROOT, path)).read()
            assert script in source and (not test or f"def {test}(" in source), (script, where)
            # run by `make test`, not only by `make test-matrix`
            assert not [t for t in tiers.MATRIX if t == where or t.startswith(f"{where}[")], (script, where)


def _main(script: str, argv: list, capsys):
    """(exit status, stdout) of the script's main on this command line, its ranks on warm workers."""
    with warm_worlds():
        status = load_script(script).main(argv)
    return status, capsys.readouterr().out


def test_bench_fsdp_smoke(capsys):
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


def test_bench_lora_smoke(capsys):
    """docs/finetune.md's LoRA-against-full table in its smoke form (its page runs in `make test-matrix`):
    both modes train the same recipe on 2 processes; LoRA keeps fewer gradient and optimizer bytes per rank
    than the full fine-tune, and as many parameter bytes or more (the frozen base plus the adapters)."""
    with warm_worlds():
        load_script("bench_lora").main(["--smoke", "--json"])
    out = json.loads(capsys.readouterr().out)
    full, lora = out["modes"]["full"], out["modes"]["lora"]
    assert out["world_size"] == 2 and full["tokens_per_s"] > 0 and lora["tokens_per_s"] > 0, out
    assert lora["grad_bytes_per_rank"] < full["grad_bytes_per_rank"], out
    assert lora["optim_bytes_per_rank"] < full["optim_bytes_per_rank"], out
    assert lora["param_bytes_per_rank"] >= full["param_bytes_per_rank"], out


def test_bench_long_context_smoke(capsys):
    """docs/long_context.md's table in its smoke form: CP 1 without offload and CP 2 with it, each at two
    sequence lengths. A CP 2 rank's peak grows at most half as fast with the sequence as CP 1's (less:
    offload), so the budget holds a longer sequence; the planner's predicted peaks are within 1 %, and
    its longest sequence within 10 % of the measured one."""
    with warm_worlds():
        status = load_script("bench_long_context").main(["--smoke", "--json"])
    out = json.loads(capsys.readouterr().out)
    one, two = out["cases"]
    assert status == 0 and (one["cp"], one["offload"], two["cp"], two["offload"]) == (1, False, 2, True), out
    for c in out["cases"]:
        for m, p in zip(c["measured"], c["predicted"]):
            assert abs(p - m) / m < 0.01, c
        assert abs(c["error"]) <= 0.10, c
    assert two["slope_over_cp1"] <= 0.5 and two["over_cp1_without_offload"] > 2, out


def test_bench_gather_smoke(capsys):
    """docs/sharded_params.md's table in its smoke form (E = 4): ours, megatron's defaults and its overlap
    each trained; ours does fewer host ops and bucket calls per step than megatron's overlap, every
    parameter a view of its buffer."""
    _, out = _main("bench_gather", ["--smoke", "--json"], capsys)
    result = json.loads(out)
    (ours,), baselines = result["cases"], result["baselines"]
    (overlap,) = baselines["mcore-overlap"]
    assert sorted(baselines) == ["mcore-default", "mcore-overlap"] and ours["experts"] == 4
    assert ours["host_ops_per_step"] < overlap["host_ops_per_step"]
    assert ours["bucket_calls_per_step"] < overlap["bucket_calls_per_step"]
    assert all(c["params_are_buffer_views"] for group in (result["cases"], *baselines.values()) for c in group)


def test_bench_overlap_smoke(capsys):
    """docs/overlap.md's benchmark in its smoke form (TP2): every backward-lane collective handed off to
    the other micro-batch's compute, the pipeline messages checked, gradients bit-identical to
    megatron's plain schedule."""
    _, out = _main("bench_overlap", ["--smoke", "--json"], capsys)
    (case,) = json.loads(out)["cases"]
    assert case["layout"] == "tp2" and case["grads_bitwise_equal"] and case["p2p_checked"]
    assert case["b_lane_handed_off"] == case["b_lane_collectives"] > 0


def test_bench_dispatcher_smoke(capsys):
    """docs/moe.md's tables in their smoke form: the multihot conversion sync-free and bit-identical;
    our dispatchers with a capacity and the zero-sync dropless layer without a host sync; every
    dropless run without overflow bit-identical to megatron's."""
    _, out = _main("bench_dispatcher", ["--smoke", "--json"], capsys)
    result = json.loads(out)
    multihot, rows = result["multihot"], result["moe_layer"]
    assert multihot["syncs_ours"] == 0 < multihot["syncs_reference"] and multihot["bitwise_equal"]
    ours = [r for r in rows if r["dispatcher"].startswith("multihot-") and r["mode"] != "dropless"]
    zero = [r for r in rows if r.get("impl") == "ours-zero-sync"]
    assert ours and zero and all(r["syncs_forward"] == r["syncs_backward"] == 0 for r in ours + zero)
    assert all(r["bitwise_equal"] for r in rows if r.get("impl") and not r["overflowed_tokens"])


def test_estimate_memory_and_flags_doc(capsys):
    """Two tools of a few seconds, whole: the memory estimate of a recipe (JSON rows), the flags page."""
    status, out = _main("estimate_memory", ["recipes/tiny_moe.yaml", "--json"], capsys)
    assert status in (None, 0) and json.loads(out)
    status, out = _main("flags_doc", [], capsys)
    assert status in (None, 0) and out == open(os.path.join(ROOT, "docs", "flags.md")).read()


def test_bench_startup_smoke(capsys):
    """The two --help that answer without torch, each in a fresh process from the root: exit 0 in well
    under the CPU second importing torch alone costs (2.8 s on the 2-core CPU)."""
    bench = load_script("bench_startup")
    result = bench.main(["--smoke", "--json"])
    assert json.loads(capsys.readouterr().out) == result and result["repeats"] == 1
    rows = result["after"]
    assert list(rows) == bench.SMOKE
    assert all(r["exit"] == 0 and r["runs"] == 1 and 0 < r["cpu s"] < 1.0 for r in rows.values()), rows


def test_gloo_coalesced_crash_smoke():
    """docs/reliability.md's torch-only reproduction, from the root as a user runs it, in its smoke form
    with the CPU shim (--one-by-one; the crash itself is too rare for 20 iterations): one 2-process
    gloo world does Megatron-FSDP's gather / resize pattern 20 times and ends cleanly."""
    done = subprocess.run([sys.executable, "scripts/gloo_coalesced_crash.py", "--smoke", "--one-by-one", "--json"],
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["one_by_one"] and result["resize"] and result["worlds"] == 1 and result["died"] == 0
    assert result["runs"][0]["finished"] and result["iterations"] == 20, result


def test_bench_ckpt_smoke(capsys):
    """docs/checkpointing.md's checksum cost in its smoke form (tiny_dense, DP2 with the distributed
    optimizer, 3 saves and 1 load per case, the async writer forked from the warm workers): saves
    synchronous and asynchronous, with checksums and without; the checksums' share is their work over
    the save's own (the writer's and the commit's when asynchronous), and none is done without them.
    Its size against the 5 % target is the benchmark's to report, not a test's to time."""
    _, out = _main("bench_ckpt", ["--smoke", "--json"], capsys)
    rows = {(r["mode"], r["checksums"]): r for r in json.loads(out)["rows"]}
    assert sorted(rows) == [("async", False), ("async", True), ("sync", False), ("sync", True)]
    assert all(r["recipe"] == "tiny_dense" and r["saves"] == 2 and r["bytes"] > 1e6 and r["load_ms"] > 0
               for r in rows.values())
    for mode in ("sync", "async"):
        on, off = rows[mode, True], rows[mode, False]
        own = on["save_ms"] if mode == "sync" else on["writer_ms"] + on["commit_ms"]
        assert 0 < on["sum_ms"] and on["sum_pct"] == pytest.approx(100 * on["sum_ms"] / own), on
        assert "sum_ms" not in off and off["sum_pct"] is None, off
    assert rows["async", True]["writer_ms"] > 0  # the forked writer ran and reported


def test_bench_convert_smoke(capsys):
    """The Hugging Face import and export benchmark in its smoke form (2 layers, hidden 64, on 2
    processes): the model made, imported under TP2 and exported with each rank a pipeline stage, the
    export bit for bit the model's tensors. Its memory columns need fresh processes (a warm worker's
    peak is its lifetime's), so only their order is checked here."""
    _, out = _main("bench_convert", ["--smoke", "--json"], capsys)
    result = json.loads(out)
    rows = {r["step"]: r for r in result["rows"]}
    assert sorted(rows) == ["export", "import"] and all(r["processes"] == 2 for r in rows.values())
    assert rows["export"]["bitwise"] is True and rows["import"]["bitwise"] is None
    assert 0 < result["largest_tensor_mib"] < result["weights_mib"] and result["layers"] == 2
    assert all(r["peak_mib"] >= r["base_mib"] > 0 for r in rows.values())
