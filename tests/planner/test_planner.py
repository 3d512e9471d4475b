"""The planner: the pass order it takes from megatron's schedules, its predicted peak per stage
against a measured training step (within 5 %), its refusals, and its choice for a cluster recipe
validated by running that choice scaled down."""
from __future__ import annotations

import json
import math
import os

import pytest

from tests.dist import run_distributed

DENSE = ["--recipe", "recipes/tiny_dense.yaml"]
MOE = ["--recipe", "recipes/tiny_moe.yaml"]
OFFLOAD = ["--activation-offload-min-tensor-kb", "1", "--activation-offload-chunk-mb", "0.0625"]
MANY_EXPERTS = ["--num-experts", "64", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "8",
                "--moe-router-num-groups", "8", "--moe-router-group-topk", "4", "--moe-router-score-function", "sigmoid",
                "--moe-router-enable-expert-bias"]


@pytest.mark.parametrize("pp,vpp,m", [(1, None, 4), (2, None, 4), (2, 2, 4), (4, None, 8), (4, 2, 8)])
def test_in_flight_passes_follow_megatrons_schedule(pp, vpp, m):
    from megatron_ext.offload import theory
    from megatron_ext.planner import schedule

    for rank in range(pp):
        events = schedule.passes(pp, vpp, m, rank)
        passes = [e[:3] for e in events]
        assert sorted(e for e in passes if e[0] == "F") == sorted(("F", i, c) for i in range(m) for c in range(vpp or 1))
        # every backward follows its own forward
        seen = set()
        for kind, mb, chunk in passes:
            assert kind == "F" or (mb, chunk) in seen
            seen.add((mb, chunk))
        # the warm-up arithmetic of megatron's schedules (stated independently in offload/theory.py)
        assert schedule.max_in_flight(pp, vpp, m, rank) == theory.inflight_passes(pp, vpp, rank, m)
        # the interleaved schedule overlaps its messages with compute: it holds receive buffers posted
        # ahead and sends in flight while passes run; plain 1F1B waits for each at once
        assert (max(e[3] for e in events) >= 1) == bool(vpp)


def _check_within(results, bound=0.05):
    rows = [r for r in results if r["report"]]
    assert rows
    for r in rows:
        measured = sum(r["measured"].values())
        predicted = r["predicted"]["peak_bytes"]
        assert abs(predicted - measured) / measured < bound, (r["pp_rank"], predicted, r["measured"])
        act = r["predicted"]["activation_peak_bytes"]
        assert abs(act - r["measured"]["activations"]) / r["measured"]["activations"] < bound, (r["pp_rank"], act, r["measured"])
        # model state is counted, not estimated: exact
        for k in ("parameters", "gradients", "optimizer", "buffers"):
            assert round(r["predicted"]["components"][k]) == r["measured"][k], k
    return rows


def test_predicted_peak_within_5_percent_pp2_with_offload(capsys):
    """scripts/bench_plan.py --smoke --json end to end (its case "dense PP2 offload", its ranks on the
    warm workers): per stage the predicted peak and activations within 5 % of the measured step, the
    model state exact, offload's bytes moved and modeled."""
    import json

    from tests.scripts import load_script, warm_worlds

    with warm_worlds():
        bench_plan = load_script("bench_plan")
        status = bench_plan.main(["--smoke", "--json"])
    rows = json.loads(capsys.readouterr().out)["cases"]
    assert status == 0 and [(r["case"], r["stage"]) for r in rows] == [(bench_plan.SMOKE, 0), (bench_plan.SMOKE, 1)]
    for r in rows:
        assert abs(r["error"]) < 0.05 and abs(r["activation_error"]) < 0.05, r
        assert r["predicted_peak_bytes"] == pytest.approx(sum(r["predicted_components"].values()), abs=8), r
        assert r["measured_peak_bytes"] == sum(r["measured"].values()), r
        for k in ("parameters", "gradients", "optimizer", "buffers"):  # counted, not estimated: exact
            assert round(r["predicted_components"][k]) == r["measured"][k], k
        assert r["offloaded_bytes"] > 0
    assert rows[0]["predicted_components"]["offload_removed"] < 0  # the first stage keeps two passes


def test_predicted_peak_within_5_percent_many_experts_ep2():
    """64 experts, DeepSeek-V3's routing (sigmoid, expert bias, top-8 within 4 of 8 groups), EP2: the
    planner traces 16 and 32 experts with balanced routing and scales to 64 (expert parameters exact,
    activations and the expert-parallel exchange's buffers within 5 %)."""
    from megatron_ext.planner.tiny import base_shape, traced_experts
    from tests.parsed import parsed_args

    routing = dict(moe_router_topk=8, moe_router_num_groups=8, moe_router_group_topk=4)
    assert traced_experts(parsed_args(num_experts=64, **routing)) == 16
    assert traced_experts(parsed_args(num_experts=256, **routing)) == 16
    assert traced_experts(parsed_args(num_experts=8, moe_router_topk=2)) == 4  # few: half
    assert traced_experts(parsed_args(num_experts=6, moe_router_topk=4)) == 6  # 3 < top-k: as they are
    # the base sequence gives every traced expert the same whole number of tokens per rank
    for e, k, tp in ((256, 8, 2), (60, 4, 1), (40, 6, 4), (160, 6, 8)):
        a = parsed_args(num_experts=e, moe_router_topk=k, tensor_model_parallel_size=tp)
        traced = traced_experts(a)
        seq, mbs = (base_shape(a, traced)[f] for f in ("seq", "mbs"))
        assert seq % tp == 0 and (seq // tp * mbs * k) % (2 * traced) == 0 and seq < 128, (e, k, tp, traced, seq)
    rows = _check_within(run_distributed(2, "bench.plan:measure", argv=[*MOE, *MANY_EXPERTS, "--expert-model-parallel-size", "2"]))
    assert rows[0]["predicted"]["components"]["moe_dispatch"] > 0  # the peak is in a MoE layer, EP2 exchanges


def test_predicted_peak_within_5_percent_zero_sync_dropless_ep2():
    """Fixed-budget dispatch (worst-case budget: twice the routed rows here) with the experts as grouped
    GEMMs over the whole buffer and a copy of the local experts' weights: the trace sizes the buffers
    as the run's per token, and counts weight copies per local expert (experts / EP)."""
    _check_within(run_distributed(2, "bench.plan:measure", argv=[
        *MOE, "--expert-model-parallel-size", "2", "--moe-sync-free-dispatcher", "--moe-zero-sync-dropless"]))


CP2 = ["--context-parallel-size", "2", "--seq-length", "128", "--max-position-embeddings", "128"]


@pytest.mark.parametrize("comm", ["all_gather", "p2p"])
def test_predicted_peak_within_1_percent_context_parallel(comm):
    """Within 1 %: a context-parallel rank holds its share of the sequence (predicted as the whole
    sequence, the activations were +98 % to +106 %), and its attention keeps what its comm type hands
    the kernel (all_gather: every rank's keys and values; p2p: copies of its own): the trace runs the
    attention as one CP rank simulated on its process (without it p2p's peak is +1.4 %)."""
    rows = [r for r in run_distributed(2, "bench.plan:measure", argv=[*DENSE, *CP2, "--cp-comm-type", comm])
            if r["report"]]
    assert len(rows) == 1
    for r in rows:
        measured, predicted = sum(r["measured"].values()), r["predicted"]["peak_bytes"]
        assert abs(predicted - measured) / measured < 0.01, (comm, predicted, r["measured"])
        act = r["predicted"]["activation_peak_bytes"]
        assert abs(act - r["measured"]["activations"]) / r["measured"]["activations"] < 0.01, (comm, act, r["measured"])


def _plan_script(argv: list) -> dict:
    """scripts/plan.py end to end as its command line runs it (on a warm rank, from the repository
    root): its exit status, stdout and stderr."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return run_distributed(1, "tests.jobs_docs:run_entry", cwd=root, script="scripts/plan.py", argv=argv)[0]


TOP_0 = "error: --plan-top=0: must be an integer >= 1 (batch size)\n"


def test_refusals_name_the_flag():
    done = _plan_script([*DENSE, "--gpu", "x100"])  # scripts/plan.py: one line, exit 1
    assert done["rc"] == 1 and done["stderr"].startswith("error: --gpu=x100: unknown GPU; known: a100"), done
    assert done["stderr"].count("\n") == 1 and done["stdout"] == "", done
    # out of PlanOptions' range: the parse's domain check, before any compute (--top is --plan-top)
    done = _plan_script([*DENSE, "--top", "0"])
    assert (done["rc"], done["stdout"]) == (1, "") and done["stderr"] == TOP_0, done
    r = run_distributed(1, "tests.planner.jobs:plan_json", argv=[*DENSE, "--memory-gb", "0.001"])[0]
    assert r["error"].startswith("--memory-gb=0.001: no configuration fits")
    assert "closest: " in r["error"] and "\n" not in r["error"]


def test_plan_json_components_and_candidates():
    done = _plan_script([*DENSE, "--memory-gb", "1", "--json"])  # scripts/plan.py end to end
    assert done["rc"] == 0, done["stderr"][-2000:]
    r = json.loads(done["stdout"])
    (stage,) = r["stages"]
    assert stage["peak_bytes"] == pytest.approx(sum(stage["components"].values()), abs=8)
    cands = r["candidates"]
    assert cands[0]["fits"] and cands[0]["flags"] == []  # 1 GiB is plenty: nothing to change, the fastest
    fitting = [c["step_time_s"] for c in cands if c["fits"]]
    assert fitting == sorted(fitting)
    assert all(max(c["peak_bytes_per_stage"]) <= r["budget_bytes"] for c in cands if c["fits"])
    # per model chunk under PP2 x VPP2: megatron's layer placement, the stage's parameters split over
    # its chunks, and what the chunks' passes hold at the peak is the stage's saved activations
    r = run_distributed(1, "tests.planner.jobs:plan_json", argv=[
        *DENSE, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
        "--world-size", "2", "--memory-gb", "1"])[0]["report"]
    assert [[ch["layers"] for ch in st["chunks"]] for st in r["stages"]] == [
        [["embedding", "dense"], ["dense"]], [["dense"], ["dense", "head"]]]
    for st in r["stages"]:
        c = st["components"]
        assert sum(ch["parameters"] for ch in st["chunks"]) == pytest.approx(c["parameters"], abs=4)
        assert all(ch["activations_per_microbatch"] > 0 for ch in st["chunks"])
        assert sum(ch["activations_at_peak"] for ch in st["chunks"]) <= c["activations"] + 4
        assert c["moe_dispatch"] == 0  # dense


def test_a_sequence_no_split_fits_gets_context_parallelism_with_its_launch_line():
    """tiny_dense at 8192 tokens on 2 GPUs of 60 MiB: no split of TP, PP, micro-batch, recompute and
    offload fits, so the search takes context parallelism's ranks from data parallelism: the chosen
    candidate sets a CP size and a comm type, its launch line carries both (where a split without CP
    fits, CP is not searched: search.plan)."""
    argv = [*DENSE, "--seq-length", "8192", "--max-position-embeddings", "8192", "--world-size", "2",
            "--search-parallelism"]
    r = run_distributed(1, "tests.planner.jobs:plan_json", argv=[*argv, "--memory-gb", "0.06"])[0]["report"]
    best = r["candidates"][0]
    assert best["fits"] and "--context-parallel-size" in best["flags"] and "--cp-comm-type" in best["flags"], best
    cp = best["flags"][best["flags"].index("--context-parallel-size") + 1]
    assert f"--context-parallel-size {cp} --cp-comm-type " in r["launch"]["torchrun_command"], r["launch"]
    assert all("--context-parallel-size" in c["flags"] for c in r["candidates"] if c["fits"])


def test_choice_for_a_cluster_recipe_fits_when_scaled_down():
    """Mixtral-8x7B on H100 with a budget its recipe cannot meet without offload: the planner's
    choice, scaled down to this machine, fits the scaled budget; the recipe without it does not."""
    r = run_distributed(2, "bench.plan:validate_choice", timeout=120)[0]
    assert "--activation-offload-modules" in r["chosen_flags"]
    assert max(r["chosen_peaks"]) <= r["budget_bytes"] < max(r["plain_peaks"])
    assert 0 < r["phi"] < 1
    assert r["measured_with_choice"] <= r["scaled_budget_bytes"] < r["measured_without"], r


def test_trace_routing_is_balanced_and_shape_stable():
    """While the planner traces, megatron's router still computes its scores and top-k but every
    expert gets tokens x top-k / experts tokens, whatever the logits (grouped top-k included)."""
    import torch
    from megatron.core.transformer.moe import router

    from megatron_ext.seams.planner import balanced_routing

    logits = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    logits[:, :4] += 10.0  # a router that prefers four experts
    kw = dict(num_groups=8, group_topk=4, score_function="sigmoid", expert_bias=torch.zeros(32))
    probs, routing_map = router.topk_routing_with_score_function(logits, 8, **kw)
    assert routing_map.sum(0).tolist() != [16] * 32
    with balanced_routing():
        probs, routing_map = router.topk_routing_with_score_function(logits, 8, **kw)
    assert routing_map.sum(0).tolist() == [16] * 32 and routing_map.sum(1).tolist() == [8] * 64
    assert bool((probs[routing_map] > 0).all()) and bool((probs[~routing_map] == 0).all())
    probs, routing_map = router.topk_routing_with_score_function(logits, 8, **kw)
    assert routing_map.sum(0).tolist() != [16] * 32  # removed after the block


def test_dispatch_rows_follow_the_dispatchers_rules():
    """The expert-parallel exchange's receive rows per MoE layer: tokens x top-k (dropless), padded
    capacity, the zero-sync dispatcher's fixed budget (megatron_ext.moe.fixed_dispatch.budget_rows);
    none without expert parallelism."""
    from megatron_ext.moe.fixed_dispatch import budget_rows
    from megatron_ext.planner.memory import Layout, dispatch_bytes, dispatch_rows
    from tests.parsed import parsed_args

    # DeepSeek-V3's layout: TP2 (sequence parallel: 2048 tokens per rank), EP64, top-8 of 256
    layout = Layout(tp=2, pp=16, vpp=None, ep=64, etp=1, cp=1, dp=32, edp=1, mbs=1, microbatches=128, world=1024)
    a = parsed_args(num_experts=256, moe_router_topk=8, seq_length=4096, micro_batch_size=1, hidden_size=7168,
                    bf16=True, fp16=False, moe_token_dispatcher_type="alltoall")
    assert dispatch_rows(a, layout) == 2048 * 8
    assert dispatch_bytes(a, layout) == 2048 * 8 * 7168 * 2
    capped = parsed_args(**{**vars(a), "moe_expert_capacity_factor": 1.5, "moe_pad_expert_input_to_capacity": True})
    assert dispatch_rows(capped, layout) == 256 * 96  # 64 tokens per expert x 1.5
    fixed = parsed_args(**{**vars(a), "moe_sync_free_dispatcher": True, "moe_zero_sync_dropless": True,
                           "moe_dropless_budget_factor": None})
    worst = budget_rows(2048, 8, 256, 4, None)[0]
    assert worst == 2048 * 4 and dispatch_rows(fixed, layout) == 64 * worst
    fixed.moe_dropless_budget_factor = 1.25
    assert dispatch_rows(fixed, layout) == 64 * budget_rows(2048, 8, 256, 4, 1.25)[0] == 64 * 320
    assert dispatch_rows(a, Layout(2, 16, None, 1, 1, 1, 32, 32, 1, 128, 1024)) == 0


def test_plan_help_prints_usage():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "scripts/plan.py", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "usage: scripts/plan.py" in done.stdout
    for name in ("--gpu", "--memory-gb", "--host-link-gbps", "--search-parallelism", "--json", "--png"):
        assert name in done.stdout


def test_options_are_declared_once_for_flags_and_recipe_keys():
    """scripts/plan.py's --gpu, train.py's --plan-gpu and a recipe's plan_gpu: are one option: a
    recipe key is read (not accepted and ignored)."""
    from megatron_ext.planner import cli

    assert cli.train_flags(["--gpu", "h200", "--memory-gb=40", "--num-layers", "2"]) == [
        "--plan-gpu", "h200", "--plan-memory-gb=40", "--num-layers", "2"]
    r = run_distributed(1, "tests.planner.jobs:plan_json", argv=[*DENSE, "--plan-gpu", "x100"], prefix="--plan-")[0]
    assert r["error"].startswith("--plan-gpu=x100: unknown GPU")
    r = run_distributed(1, "tests.planner.jobs:plan_json_recipe", extra={"plan_gpu": "x100"})[0]
    assert r["error"].startswith("--gpu=x100: unknown GPU")


def test_gpt_oss_recompute_plans_on_transformer_engine():
    """--recompute-modules layernorm moe_act --moe-grouped-gemm (the published GPT-OSS recipe's): the
    local copy cannot build either, the cluster can; the plan models them (less saved per micro-batch
    than without) and keeps the run as given."""
    te = [*MOE, "--transformer-impl", "transformer_engine", "--moe-grouped-gemm", "--memory-gb", "1"]
    r = run_distributed(1, "tests.planner.jobs:plan_as_given", argv=[
        *te, "--recompute-granularity", "selective", "--recompute-modules", "layernorm", "moe_act"])[0]
    assert r["as_given"]["fits"] and r["first"], r
    plain = run_distributed(1, "tests.planner.jobs:plan_as_given", argv=te)[0]
    assert r["chunks"][0] < plain["chunks"][0], (r["chunks"], plain["chunks"])


def test_transformer_engine_attention_keeps_no_scores():
    """On a transformer-engine target the trace's core attention and norms keep what TE's keep, and
    on the local spec torch's attention (--attention-backend auto) keeps what it keeps: no storage
    saved for backward grows with the square of the sequence (megatron's unfused attention keeps its
    [b, heads, s, s] softmax output), and a layer saves less."""
    r = run_distributed(1, "tests.planner.jobs:saved_seq_exponents", argv=DENSE)[0]
    assert r["transformer_engine"]["max_seq_exponent"] == 1.0, r
    assert r["local"]["max_seq_exponent"] == 1.0, r
    assert r["local_unfused"]["max_seq_exponent"] == 2.0, r
    assert r["transformer_engine"]["saved"] < r["local_unfused"]["saved"], r
    assert r["local"]["saved"] < r["local_unfused"]["saved"], r
    # the trace runs torch attention as its run does: the causal triangle is the kernel's, no mask (a
    # mask took CUDA's flex_attention, which the trace's dispatch modes cannot enter: the H200 run)
    assert r["local"]["masks"] == [False], r


def test_fp8_keeps_saved_gemm_inputs_in_one_byte():
    """--fp8-format on a transformer-engine target: the trace marks exactly the storages a layer's
    linears save as their input (QKV's and FC1's normed inputs and FC2's activation input only there;
    the projection's input also kept by the fused attention), and the FP8 plan counts those at one
    byte per element, with the FP8 copy on top where the 16-bit tensor stays."""
    r = run_distributed(1, "tests.planner.jobs:fp8_saved", argv=DENSE)[0]
    exp, bf16, fp8 = r["expected"], r["bf16"], r["fp8"]
    assert bf16["only"] == exp["only"] and bf16["shared"] == exp["shared"], r
    want = bf16["saved"] - exp["only"] * (1 - 1 / exp["elem"]) + exp["shared"] / exp["elem"]
    assert math.isclose(fp8["saved"], want, rel_tol=1e-12), r
    assert bf16["gemm_weights"] > 0, r


def test_published_throughput_within_25_percent():
    """tokens/s/GPU of every published H100 run (megatron_ext.planner.published) within 25 % of the
    published figure, with one set of constants (megatron_ext/planner/hardware.py)."""
    rows = run_distributed(1, "tests.planner.jobs:published_throughput")[0]
    assert len(rows) >= 4
    for name, predicted, published in rows:
        assert abs(predicted / published - 1) <= 0.25, (name, predicted, published)


def test_published_qwen3_fits_as_given():
    """Qwen3-30B-A3B on 16xH100 (TP1 PP1 EP16, MBS1, GBS1024, BF16, no recompute), published at 62.17
    GiB peak allocated: the plan says it fits as given, recommends nothing, and predicts the peak
    within 15 %."""
    r = run_distributed(1, "tests.planner.jobs:published_plan", name="qwen3-30b-a3b 16xH100 EP16", timeout=120)[0]
    g, published = r["report"]["as_given"], r["published"]
    assert g["fits"] and r["report"]["candidates"][0]["as_given"] and r["report"]["candidates"][0]["flags"] == []
    peak = max(g["peak_bytes_per_stage"]) / 2**30
    assert abs(peak / published["peak_gib"] - 1) <= 0.15, peak
    assert abs(g["tokens_per_s_per_gpu"] / published["tokens_per_s_per_gpu"] - 1) <= 0.25


def test_planner_imports_no_bench_and_no_circle():
    """From the source: no module of megatron_ext/planner imports the benchmarks' helpers
    (scripts/bench/), and the
    planner's modules import each other without a circle (function-level imports included)."""
    import ast
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "..", "megatron_ext", "planner")
    graph = {}
    for name in os.listdir(root):
        if not name.endswith(".py"):
            continue
        mod = "megatron_ext.planner" + ("" if name == "__init__.py" else "." + name[:-3])
        deps = set()
        for node in ast.walk(ast.parse(open(os.path.join(root, name)).read())):
            if isinstance(node, ast.ImportFrom) and node.module:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        assert not any(d.split(".")[0] == "bench" for d in deps), (name, deps)
        graph[mod] = {d for d in deps if d.startswith("megatron_ext.planner.")} - {mod}
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in graph.get(m, ()):
            assert state.get(d) != "open", " -> ".join([*path, d])
            if d not in state:
                visit(d, [*path, d])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
