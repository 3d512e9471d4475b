"""The planner's step time from kernels (planner/steptime.py, planner/profiles): the roofline of a matrix
product, grouped products at small per-expert counts, the attention the run will use, a measured
hardware profile read in place of the datasheet model, the fitted constants chosen on the calibration half
of the data points and checked on the held-out half, and gpu_check's kernel_profile on CPU."""
from __future__ import annotations

import json

import pytest

from tests.dist import run_distributed


@pytest.fixture(scope="module")
def kinds():
    return run_distributed(1, "tests.planner.jobs_steptime:attention_kinds")[0]


def test_small_m_products_are_bandwidth_bound_and_experts_read_their_weights_once():
    """Datasheet model (no profile): a product with few rows costs its weight bytes at HBM, not its
    FLOPs (4x the rows, the same time); with many rows, its FLOPs (4x the rows, 4x the time). The
    same routed rows split over more experts cost more: each expert's weights are read once."""
    from megatron_ext.planner import profiles

    dev = profiles.device("h100", None)
    n = k = 8192
    weights = 2 * n * k / dev.hbm
    assert dev.gemm_s(16, n, k) == pytest.approx(weights, rel=0.02)
    assert dev.gemm_s(64, n, k) == pytest.approx(dev.gemm_s(16, n, k), rel=0.05)
    assert dev.gemm_s(4 * 8192, n, k) == pytest.approx(4 * dev.gemm_s(8192, n, k), rel=0.02)
    flops = 2 * 8192 * n * k
    assert dev.gemm_s(8192, n, k) == pytest.approx(flops / (dev.datasheet["peak_flops"] * dev.gemm_efficiency), rel=0.05)
    rows = 16384
    t = [dev.grouped_gemm_s(g, rows / g, 2880, 2880) for g in (4, 16, 64, 256)]
    assert t == sorted(t) and t[-1] > 2 * t[0], t
    # a weight gradient accumulated into an fp32 main gradient at 64 rows per expert: its output traffic binds
    assert dev.grouped_gemm_s(16, 2880, 2880, 64, out_elem=4, accumulate=True) > 2 * dev.grouped_gemm_s(16, 2880, 2880, 64)


def test_the_attention_kind_changes_the_step_time(kinds):
    """One dense run (Llama-3-8B's shape, BF16) with each core attention: megatron's unfused attention,
    memory-bound on its s x s scores, costs more than a flash-class kernel (torch SDPA, transformer-engine's
    fused), by more at a longer sequence; nothing but the attention term differs. The run's flags
    resolve the kind: transformer-engine's target runs its fused attention, the local spec torch's SDPA
    with --attention-backend auto (megatron's default) or flash, megatron's with unfused."""
    times, resolved = kinds["times"], kinds["resolved"]
    assert resolved == dict(transformer_engine="transformer_engine", local_unfused="unfused", local_auto="sdpa",
                            local_flash="sdpa")
    for seq, t in times.items():
        unfused, sdpa, te = t["unfused"], t["sdpa"], t["transformer_engine"]
        assert unfused["attention_s"] > 5 * sdpa["attention_s"], (seq, unfused, sdpa)
        assert unfused["step_time_s"] > sdpa["step_time_s"] and sdpa["step_time_s"] == pytest.approx(te["step_time_s"])
        for term in unfused:
            if term not in ("attention_s", "step_time_s", "bubble_s"):
                assert unfused[term] == pytest.approx(sdpa[term]), term
    short, long = (times[s] for s in sorted(times, key=int))
    gap = [t["unfused"]["step_time_s"] / t["sdpa"]["step_time_s"] for t in (short, long)]
    assert gap[1] > gap[0], gap


def test_a_measured_profile_is_read_and_changes_the_prediction():
    """A profile whose products run at half the datasheet model's rate and whose fused attention takes
    a tenth of its time: the same run's GEMM term about doubles, its attention term is a tenth, and
    the step says it used measured kernels. The H200's stored profile (seeded from the first device
    run) gives back the attention it measured and its host link; no H100 profile is stored (nothing
    was measured there): the datasheet model, said so."""
    r = run_distributed(1, "tests.planner.jobs_steptime:profile_changes_the_prediction")[0]
    sheet, prof = r["times"]["datasheet"], r["times"]["profile"]
    assert 1.7 < prof["gemm_s"] / sheet["gemm_s"] < 2.3, (prof["gemm_s"], sheet["gemm_s"])
    assert prof["attention_s"] == pytest.approx(sheet["attention_s"] / 10, rel=1e-6)
    assert prof["step_time_s"] > sheet["step_time_s"]
    assert "measured on NVIDIA H100 (test)" in prof["kernels"] and "datasheet" in sheet["kernels"]
    assert r["sources"]["gemm"].startswith("measured") and r["sources"]["hbm"].startswith("datasheet")
    # no grouped rows: the experts' products are timed from the measured products, and say so
    assert r["sources"]["grouped_gemm"].startswith("measured") and "one product per group" in r["sources"]["grouped_gemm"]
    for kind, (measured, read) in r["h200_attention"].items():
        assert read == pytest.approx(measured, rel=1e-9), kind
    assert r["h200_link"][0] == r["h200_link"][1] == 55.17e9
    assert "attention unfused" in r["h200_measured"] and "gemm" not in r["h200_measured"]
    assert r["h100_stored"] is None


def test_the_fitted_constants_are_the_fits_and_the_held_out_half_is_not_read():
    """published.fit over the calibration half of the data points gives exactly hardware.GEMM_EFFICIENCY
    and MOE_LAYER_S, with every held-out point (published runs and device steps) made unreadable and its
    measured figure multiplied by 10. The split gives each half published runs and device steps, dense
    and MoE, and alternates within each kind in the order listed."""
    r = run_distributed(1, "tests.planner.jobs_steptime:fit_with_the_held_out_half_poisoned")[0]
    points, f = r["points"], r["fitted"]
    for role in ("calibration", "held out"):
        half = [p for p in points if p["role"] == role]
        assert {p["kind"] for p in half} == {"published", "device"} and {p["moe"] for p in half} == {True, False}, half
    for kind in ("published", "device"):
        roles = [p["role"] for p in points if p["kind"] == kind]
        assert roles == [("calibration", "held out")[i % 2] for i in range(len(roles))], (kind, roles)
    assert f["points"] == [p["name"] for p in points if p["role"] == "calibration"]
    assert (f["gemm_efficiency"], f["moe_layer_s"]) == (r["constants"]["gemm_efficiency"], r["constants"]["moe_layer_s"])


def test_every_data_point_with_the_fitted_constants():
    """scripts/bench_plan.py --published-fit: the fit's errors are the planner's own predictions at the
    constants in use (hardware.py holds the fit), and the calibration half's largest |error| is the
    fit's. The target, every held-out point within 15 %, is not met: the held-out half is within 25 %
    (docs/planner.md, "Against published runs and the device": which points are outside 15 %). Device
    steps with torch attention are within 15 %, with megatron's unfused attention within 25 %."""
    out = run_distributed(1, "tests.planner.jobs_steptime:published_fit_stdout")[0]
    assert out["status"] == 0
    f = json.loads(out["stdout"])["published_fit"]  # stdout is the JSON alone
    assert f["constants_are_the_fit"], (f["fit"], f["constants"])
    rows = {r["name"]: r for r in f["points"]}
    for name, error in f["fit"]["errors"].items():
        assert rows[name]["role"] == "calibration" and error == pytest.approx(rows[name]["error"], abs=1e-4), name
    worst = f["largest_abs_error"]
    assert worst["calibration"] == pytest.approx(f["fit"]["largest_abs_error"], abs=1e-4)
    assert worst["held out"] == max(abs(r["error"]) for r in rows.values() if r["role"] == "held out")
    assert worst["held out"] <= 0.25, worst
    device = [r for r in rows.values() if r["kind"] == "device"]
    assert {r["name"].split(" ", 2)[2] for r in device} == {
        "(a) unfused x8", "(a) flash x8", "(b) flash x19", "(c) unfused x4", "(c) flash x4", "(b) unfused x4"}
    for r in device:
        assert abs(r["error"]) <= (0.15 if "flash" in r["name"] else 0.25), r


def test_unfused_attention_bytes_counted_from_megatrons_ops():
    """hardware.UNFUSED_BYTES_PER_SCORE and profiles.UNFUSED_FORWARD_SHARE are what megatron's unfused
    DotProductAttention moves per element of its scores, forward and backward (bf16, fp32 softmax),
    counted op by op on CPU."""
    from megatron_ext.planner import hardware, profiles

    r = run_distributed(1, "tests.planner.jobs_steptime:unfused_bytes_per_score")[0]
    total = r["forward"] + r["backward"]
    assert total == pytest.approx(hardware.UNFUSED_BYTES_PER_SCORE, rel=0.03), r
    assert r["forward"] / total == pytest.approx(profiles.UNFUSED_FORWARD_SHARE, abs=0.02), r


def test_kernel_profile_runs_on_cpu_and_writes_no_profile_there():
    """gpu_check's kernel_profile at its smoke size on CPU: every block measured through the same code
    (host timings, under cpu_smoke), readable by the planner's profile reader, status "skipped: no CUDA",
    no claim, and writing it as a GPU profile refused."""
    r = run_distributed(1, "tests.planner.jobs_steptime:kernel_profile_smoke")[0]
    assert r["status"] == "skipped: no CUDA" and r["claims"] == []
    assert all(r["blocks"].values()), r["blocks"]
    assert r["kinds"] == ["sdpa", "unfused"] and r["skipped"] == {"transformer_engine": "skipped: no CUDA"}
    assert {"gemm", "grouped_gemm", "hbm", "host_link", "attention unfused", "attention sdpa"} <= set(r["read"])
    assert r["refused"] and r["gpu"] == "cpu" and r["kind"] == "h100"


def test_context_parallel_time_is_a_ranks_share_and_what_attention_does_not_hide():
    """Llama-3-8B's attention (32 heads, 8 groups of 128), 32768 tokens, BF16, one H100 datasheet: at
    CP 2 a rank computes half of CP 1's causal pairs; all_gather's and a2a's exchanges are exposed,
    all_gather's growing with CP and a2a's shrinking; the ring's steps hide under their blocks at this
    length, not at a short one."""
    from megatron_ext.planner import profiles, steptime, work
    from megatron_ext.planner.memory import Layout
    from tests.parsed import parsed_args

    dev = profiles.device("h100", None)

    def args_at(seq, cp, comm="p2p"):
        return parsed_args(num_layers=1, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
                           num_query_groups=8, kv_channels=128, ffn_hidden_size=14336, seq_length=seq,
                           micro_batch_size=1, bf16=True, context_parallel_size=cp, cp_comm_type=comm,
                           transformer_impl="local", attention_backend="flash")

    def layout(cp):
        return Layout(tp=1, pp=1, vpp=None, ep=1, etp=1, cp=cp, dp=1, edp=1, mbs=1, microbatches=1, world=cp)

    def attention(seq, cp):
        a = args_at(seq, cp)
        return work.component_work(a, work.shapes(a, layout(cp)), dev, ("layer", "dense")).total()["attention_s"]

    one, two = attention(32768, 1), attention(32768, 2)
    assert two == pytest.approx(one / 2, rel=0.05)
    gather, a2a = ([steptime.context_parallel_s(args_at(32768, cp, comm), layout(cp), comm, two) for cp in (2, 4)]
                   for comm in ("all_gather", "a2a"))
    assert 0 < gather[0] < gather[1], gather  # every rank gathers the whole sequence's keys and values
    assert a2a[0] > a2a[1] > 0, a2a  # a rank's own tokens leave: less with more ranks
    assert steptime.context_parallel_s(args_at(32768, 1), layout(1), "p2p", one) == 0.0
    assert steptime.context_parallel_s(args_at(32768, 2), layout(2), "p2p", two) == 0.0  # hidden
    short = attention(1024, 2)
    assert steptime.context_parallel_s(args_at(1024, 2), layout(2), "p2p", short) > 0.0
