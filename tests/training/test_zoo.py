"""Every architecture of the zoo (tests/training/zoo.py) trains on 2 processes (TP2 + SP, EP2 for MoE)
and trains bit-identically with every applicable megatron_ext feature on: activation offload of every
module the architecture has, the sync-free dispatcher (MoE), the TP-overlapped 1F1B schedule. Losses,
grad norms, every weight and every last gradient are compared bit for bit; and offload must have
moved bytes out of every hooked sub-module, so nothing is bypassed."""
from __future__ import annotations

import math

import pytest

from tests.dist import run_distributed
from tests.training import zoo


def _run(argv):
    return run_distributed(2, "tests.training.jobs_zoo:train_digest", argv=argv)


_PLAIN: dict = {}


def _plain(name):
    """The plain run of an architecture, once per module: several tests compare against it (runs
    are deterministic: the same flags give the same digests)."""
    if name not in _PLAIN:
        _PLAIN[name] = _run(zoo.plain_argv(name))
    return _PLAIN[name]


def _assert_bitwise(plain, featured, modules):
    losses = [r["lm loss"] for r in plain[-1]["history"]]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    for rank, (a, b) in enumerate(zip(plain, featured)):
        assert [(r["lm loss"], r["grad norm"]) for r in a["history"]] == \
            [(r["lm loss"], r["grad norm"]) for r in b["history"]], (rank, a["history"], b["history"])
        assert a["params"].keys() == b["params"].keys() and a["grads"].keys() == b["grads"].keys()
        differ = [k for k in a["params"] if a["params"][k] != b["params"][k]]
        differ += [k + " (grad)" for k in a["grads"] if a["grads"][k] != b["grads"][k]]
        assert not differ, (rank, differ)
        hooked = b["offloaded"]
        assert {key.split("/")[0] for key in hooked} == set(modules), (rank, sorted(hooked))
        bypassed = [key for key, v in hooked.items() if v["saved"] > 0 and v["offloaded"] == 0]
        assert not bypassed, (rank, bypassed)


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_architecture_trains_bitwise_with_every_feature_on(name):
    _assert_bitwise(_plain(name), _run(zoo.features_argv(name)), zoo.offload_modules(name))


@pytest.mark.parametrize("name", [n for n, case in zoo.ZOO.items() if case["moe"] and not case.get("expert_bias")])
def test_moe_architecture_trains_bitwise_zero_sync_dropless(name):
    featured = _run(zoo.zero_sync_argv(name))
    _assert_bitwise(_plain(name), featured, zoo.offload_modules(name))
    for r in featured:  # the experts ran grouped: offload saw (and moved) their grouped linears
        grouped = [k for k, v in r["offloaded"].items() if ".grouped_experts.linear_fc" in k and v["offloaded"]]
        assert {k.split("/")[0] for k in grouped} == {"router_fc1", "router_fc2", "moe_act"}, sorted(r["offloaded"])


def test_zero_sync_dropless_allgather_trains_bitwise_with_every_feature_on():
    """The allgather dispatcher in the zero-sync mode, with offload of the grouped experts and the
    TP-overlapped 1F1B schedule (Qwen3-MoE)."""
    swap = ["--moe-token-dispatcher-type", "allgather"]
    featured = _run(zoo.zero_sync_argv("qwen3_moe") + swap)
    _assert_bitwise(_run(zoo.plain_argv("qwen3_moe") + swap), featured, zoo.offload_modules("qwen3_moe"))


def test_expert_biases_zero_sync_dropless_equal_to_rounding():
    """gpt-oss's experts have biases: the grouped path sums each expert's bias gradient in another
    order than torch's per-expert column sum (docs/moe.md), so only the first loss is bitwise."""
    plain, featured = _plain("gpt_oss"), _run(zoo.zero_sync_argv("gpt_oss"))
    for a, b in zip(plain, featured):
        first_a, first_b = a["history"][0], b["history"][0]
        assert first_a["lm loss"] == first_b["lm loss"]
        for ra, rb in zip(a["history"], b["history"]):
            assert ra["lm loss"] == pytest.approx(rb["lm loss"], rel=1e-4)
            assert ra["grad norm"] == pytest.approx(rb["grad norm"], rel=1e-3)


@pytest.mark.parametrize("name", list(zoo.COMBINATIONS))
def test_features_with_recompute_and_mtp_train_bitwise(name):
    plain, featured = _run(zoo.combination_argv(name, False)), _run(zoo.combination_argv(name, True))
    _assert_bitwise(plain, featured, zoo.COMBINATIONS[name][2])


def test_the_comparison_sees_a_one_ulp_change():
    """Negative control: the same run with another init scale differs in every digest."""
    other = zoo.plain_argv("llama3")
    other[other.index("--init-method-std") + 1] = "0.0200001"
    with pytest.raises(AssertionError):
        _assert_bitwise(_plain("llama3"), _run(other), [])


_PP: dict = {}


def _pp(case):
    """A PP case's plain and featured runs (every rank's digests), both in one pool job, once per
    module: the negative control below compares against the same plain run."""
    if case not in _PP:
        argvs = {"plain": zoo.pp_argv(case, False), "features": zoo.pp_argv(case, True)}
        results = run_distributed(4, "tests.training.jobs_zoo:train_digests", argvs=argvs)
        _PP[case] = [r["plain"] for r in results], [r["features"] for r in results]
    return _PP[case]


def test_per_pass_state_swap_is_needed():
    """Negative control for the test below: with the overlap's per-pass swap of the stateful
    modules' attributes turned off, Qwen3-235B-A22B's case (MoE-layer recompute, the zero-sync
    dispatcher) no longer trains as the plain run does: the forward recomputed inside a paired
    backward finds the state the other pass left."""
    plain, _ = _pp("qwen3_235b")  # no pair in the plain run: nothing to swap
    results = run_distributed(4, "tests.training.jobs_zoo:train_digests_without_state_swap",
                              argvs={"features": zoo.pp_argv("qwen3_235b", True)})
    broken = [r["features"] for r in results]
    assert any("index_select" in b.get("error", "") or "error" not in b and (
        b["params"] != p["params"] or b["grads"] != p["grads"]) for b, p in zip(broken, plain)), broken


@pytest.mark.parametrize("case", list(zoo.PP_CASES))
def test_moe_recipes_under_pp_vpp_train_bitwise_with_every_feature_on(case):
    """Three of Megatron-LM's modelopt MoE models (DeepSeek-R1, Llama-4-Maverick, Qwen3-235B-A22B;
    tests/training/zoo.py PP_CASES), scaled down, on 4 processes as TP2+SP x PP2 with 2 virtual
    stages and EP2, with their own recompute flags (selective + MoE-layer recompute): plain vs
    activation offload + sync-free/zero-sync dispatcher + the overlapped 1F1B schedule, one
    iteration each, bit for bit. The overlap interleaves two passes on the same model chunk and
    the MoE-layer recompute re-enters the forward inside the paired backward: the shared-expert
    overlap state machine and the dispatchers' saved indices are kept per lane. Both runs of a case
    in one pool job."""
    plain, featured = _pp(case)
    losses = [h["lm loss"] for h in plain[-1]["history"]]
    assert len(losses) == 1 and all(math.isfinite(x) for x in losses), case
    for rank, (a, b) in enumerate(zip(plain, featured)):
        assert [repr((h["lm loss"], h["grad norm"])) for h in a["history"]] == \
            [repr((h["lm loss"], h["grad norm"])) for h in b["history"]], (case, rank)  # NaN off the last stage
        assert a["params"] == b["params"] and a["grads"] == b["grads"], (case, rank)
        hooked = b["offloaded"]
        assert {key.split("/")[0] for key in hooked} <= set(zoo.pp_offload_modules(case)), (case, rank)
        assert sum(v["offloaded"] for v in hooked.values()) > 0, (case, rank)
