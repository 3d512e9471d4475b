"""Backward-forward TP-communication overlap: bit-identical results and real overlap.

Each distributed case runs megatron's plain schedule and ours on the same model, data and seed
(dropout on) and compares every loss and every gradient bit for bit; it also counts, from the
recorded collectives, that the TP collectives were issued async, handed over to the other
micro-batch, and had compute (matmul FLOPs) between their start and their wait. The suite runs in
the CUDA-faithful CPU mode: every backward on the autograd device thread, pipeline messages under
NCCL's rules (checked here, from the messages each rank really issued).
"""
from __future__ import annotations

import argparse

import pytest

from tests.dist import run_distributed

LAYOUTS = {
    "tp2": dict(world=2, tp=2, pp=1, vpp=None),
    "tp2_pp2": dict(world=4, tp=2, pp=2, vpp=None),
    "tp2_pp2_vpp2": dict(world=4, tp=2, pp=2, vpp=2),
}


def _all_backward_collectives_handed_off(r, where="", ep_first=False):
    """Under the CUDA-faithful mode (backward on the autograd device thread) every TP collective a
    paired backward issues is handed to the forward, unless that forward had already finished or
    (`ep_first`: TP with expert parallelism) it has a token all-to-all in flight, which keeps the
    baton (group_kinds.waits_in_place)."""
    b = r["ours"]["b_lane"]
    assert r["cuda_faithful"], where
    assert b["collectives"] > 0 and b["handed_off"] > 0, (where, b)
    assert b["handed_off"] + b["partner_done"] + b["in_place"] == b["collectives"], (where, b)
    assert (b["in_place"] > 0) == ep_first, (where, b)


def _check_pipeline_messages(results):
    """Every rank's recorded pipeline messages complete under NCCL's rules (both schedules), and
    ours are exactly the pure plan's (pipeline_plan.program) for that rank."""
    from megatron_ext.schedules import p2p, pipeline_plan

    for name in ("plain", "ours"):
        programs = {rank: r[name]["p2p_program"] for rank, r in enumerate(results)}
        verdict = p2p.check(programs)
        assert verdict.ok, f"{name}:\n{verdict.report()}"
    for rank, r in enumerate(results):
        if len(r["pp_ranks"]) == 1:
            assert r["ours"]["p2p_program"] == []
            continue
        expected = pipeline_plan.program(r["num_microbatches"], r["chunks"], len(r["pp_ranks"]),
                                         r["pp_rank"], r["microbatch_group"], ranks=r["pp_ranks"],
                                         pair_warmup=r["ours"]["pair_warmup"])
        strip = [(i.kind, i.peer, i.comm) if isinstance(i, p2p.Op) else i for i in expected]
        got = [(i.kind, i.peer, i.comm) if isinstance(i, p2p.Op) else i for i in r["ours"]["p2p_program"]]
        assert got == strip, f"rank {rank}: issued messages differ from the plan"
        assert len(got) > 0


def _run(kind, layout):
    lay = LAYOUTS[layout]
    return run_distributed(
        lay["world"], "tests.schedules.jobs:check_bitwise",
        kind=kind, tp=lay["tp"], pp=lay["pp"], vpp=lay["vpp"],
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bitwise_equal_and_overlapped(kind, layout):
    results = _run(kind, layout)
    for rank, r in enumerate(results):
        where = f"{kind} {layout} rank {rank}"
        assert r["grad_mismatch"] == [], f"{where}: gradients differ: {r['grad_mismatch']}"
        assert r["losses_equal"], f"{where}: {r['losses_plain']} != {r['losses_ours']}"
        assert r["rng_equal"], f"{where}: RNG stream after the step differs"
        assert r["n_grads"] > 0 and r["grads_nonzero"] >= r["n_grads"] - 1, where
        plain, ours = r["plain"], r["ours"]
        # the same collectives in both schedules
        assert plain["tp_collectives"] == ours["tp_collectives"] > 0, where
        # plain: nothing is handed over; megatron's dgrad all-reduce/wgrad GEMM overlap is on
        assert plain["tp_handed_off"] == 0, where
        assert plain["upstream_async"] > 0, where
        assert plain["upstream_async_with_compute"] == plain["upstream_async"], where
        # ours keeps megatron's overlap (every async dgrad all-reduce still has the wgrad GEMM
        # between start and wait) ...
        assert ours["upstream_async"] == plain["upstream_async"], where
        assert ours["upstream_async_with_compute"] == ours["upstream_async"], where
        # ... and hands TP collectives to the other micro-batch, with its compute in between
        assert ours["tp_handed_off"] > 0, where
        # (some hand-offs land on a stretch of the other micro-batch without GEMMs, e.g. the MoE
        # token permutation between two dispatch collectives)
        assert ours["tp_handed_off_with_compute"] >= 0.6 * ours["tp_handed_off"], where
        assert ours["flops_between_total"] > plain["flops_between_total"], where
        lanes_seen = {lane for _, lane in ours["per_owner_lane"]}
        assert {"F", "B"} <= lanes_seen, where
        _all_backward_collectives_handed_off(r, where)
        assert not ours["pair_warmup"], where  # dropout on: the warmup's forwards run one at a time
    _check_pipeline_messages(results)
    if layout == "tp2":
        # without pipelining every micro-batch but the first forward / last backward is paired
        owners = dict((o, lane) for o, lane in results[0]["ours"]["per_owner_lane"] if lane != "-")
        assert {"F1", "F2", "F3", "B0", "B1", "B2"} <= set(owners), owners


def test_moe_tp2_ep2_hands_off_expert_all_to_all():
    """MoE with TP2 x EP2 (alltoall dispatcher): bit-identical, and the EP all-to-alls are hand-off
    points too (what megatron's --overlap-moe-expert-parallel-comm hides, done by our lanes)."""
    results = run_distributed(4, "tests.schedules.jobs:check_bitwise", kind="moe", tp=2,
                              extra=["--expert-model-parallel-size", "2"])
    for r in results:
        assert r["grad_mismatch"] == [] and r["losses_equal"] and r["rng_equal"]
        assert r["ours"]["ep_collectives"] == r["plain"]["ep_collectives"] > 0
        assert r["ours"]["ep_handed_off"] > 0 and r["ours"]["tp_handed_off"] > 0
        _all_backward_collectives_handed_off(r, ep_first=True)


@pytest.mark.parametrize("kind", ["dense", "moe", "moe-stateful"])
def test_warmup_forwards_pair_bitwise_without_dropout(kind):
    """Without dropout the warmup's forwards run two at a time (F||F, lanes.Pair two_forwards) on
    TP2 x PP2 x VPP2 (MoE: EP2 too): losses, gradients and the RNG stream bit-identical to the plain
    schedule, the pipeline messages those of the paired plan, under NCCL's rules. "moe-stateful":
    the modules that keep state between calls, interleaved by two forwards at once (the sync-free
    and zero-sync dispatchers, megatron's shared-expert overlap, MoE-layer recompute)."""
    extra = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    if kind.startswith("moe"):
        extra += ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    if kind == "moe-stateful":
        extra += ["--moe-sync-free-dispatcher", "--moe-zero-sync-dropless", "--moe-shared-expert-intermediate-size",
                  "64", "--moe-shared-expert-overlap", "--moe-layer-recompute"]
    kind = kind.split("-")[0]
    results = run_distributed(4, "tests.schedules.jobs:check_bitwise", kind=kind, tp=2, pp=2, vpp=2, extra=extra)
    for rank, r in enumerate(results):
        where = f"{kind} rank {rank}"
        assert r["grad_mismatch"] == [] and r["losses_equal"] and r["rng_equal"], where
        assert r["n_grads"] > 0 and r["grads_nonzero"] >= r["n_grads"] - 1, where
        assert r["ours"]["pair_warmup"] and r["ours"]["forward_pairs"] > 0, where
    _check_pipeline_messages(results)


def test_a_forward_pair_sees_random_draws():
    """The schedule's guard (overlap_1f1b run_forward_pair raises on it): a pair of forwards knows
    whether the earlier one drew random numbers, from the generators' states, not from the config."""
    import torch

    from megatron_ext.schedules import lanes

    for draws in (False, True):
        pair = lanes.Pair("F0", "F1", two_forwards=True)
        pair.run(lambda: torch.rand(3) if draws else torch.zeros(3), lambda: torch.zeros(3))
        assert pair.earlier_drew_random() is draws


@pytest.mark.parametrize("tp", [1, 2])
def test_context_parallel_collectives_handed_off_bitwise(tp):
    """CP 2 (at TP 1; at TP 2 + SP on 4 ranks), a dense model, one layer's attention all-gathering K/V
    (its backward reduce-scatters them), the other's all-to-all (Ulysses): context-parallel
    attention's collectives are handed to the other micro-batch as TP's are, with its compute in
    between; losses, gradients and the RNG stream bit for bit megatron's schedule."""
    extra = ["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "a2a"]
    results = run_distributed(2 * tp, "tests.schedules.jobs:check_bitwise", kind="dense", tp=tp,
                              extra=extra + (["--sequence-parallel"] if tp > 1 else []))
    for rank, r in enumerate(results):
        assert r["grad_mismatch"] == [] and r["losses_equal"] and r["rng_equal"], (rank, r["grad_mismatch"])
        plain, ours = r["plain"], r["ours"]
        assert plain["tp_collectives"] == ours["tp_collectives"], rank
        assert (ours["tp_handed_off"] > 0) == (tp > 1), rank  # at TP 1, CP's are all there is
        assert plain["cp_collectives"] == ours["cp_collectives"] > 0, rank
        assert plain["cp_handed_off"] == 0 < ours["cp_handed_off"], rank
        # both lanes hand theirs over (the backward's reduce-scatters and all-to-alls too), and the
        # other micro-batch's GEMMs run between issue and wait (not after every one: q, k and v's
        # all-to-alls follow one another; 21 of 39 at this size)
        assert ours["cp_handed_off_by_lane"] == ["B", "F"], (rank, ours["cp_handed_off_by_lane"])
        assert ours["cp_handed_off_with_compute"] > 0 and ours["cp_flops_between"] > plain["cp_flops_between"], rank


def test_ep_only_overlap_tp1_ep2_every_dispatcher():
    """TP1 x EP2 MoE (no tensor parallelism: only the expert all-to-all / all-gather to hide), with
    megatron's alltoall and allgather dispatchers and the project's sync-free and zero-sync ones:
    bit-identical losses and gradients, the EP collectives handed to the other micro-batch, and
    every collective a paired backward issues handed off."""
    results = run_distributed(2, "tests.schedules.jobs:check_ep_only")
    for rank, per in enumerate(results):
        for name, r in per.items():
            where = f"{name} rank {rank}"
            assert r["grad_mismatch"] == [] and r["losses_equal"] and r["rng_equal"], where
            assert r["n_grads"] > 0 and r["grads_nonzero"] >= r["n_grads"] - 1, where
            assert r["ours"]["tp_collectives"] == 0, where  # TP1: no TP collective at all
            assert r["ours"]["ep_collectives"] == r["plain"]["ep_collectives"] > 0, where
            assert r["plain"]["ep_handed_off"] == 0, where
            assert r["ours"]["ep_handed_off"] > 0, where
            b = r["ours"]["b_lane_ep"]
            # every token collective of a paired backward is handed off; metadata waited in place
            assert b["collectives"] > 0 and b["handed_off"] > 0, (where, b)
            assert b["handed_off"] + b["partner_done"] + b["in_place"] == b["collectives"], (where, b)
        assert per["sync_free"]["dispatcher_installed"] > per["allgather"]["dispatcher_installed"]
        assert per["zero_sync"]["dispatcher_installed"] > per["sync_free"]["dispatcher_installed"]


def test_megatron_ep_overlap_with_offload_and_dispatchers_bitwise():
    """megatron's own --overlap-moe-expert-parallel-comm (its combined-1F1B plan, as
    pretrain_gpt.py runs it: the forward step returns model.build_schedule_plan) on tiny_moe EP2
    bf16, alone, with our activation offload of every attention and expert module (router_fc1 =
    expert fc1, moe_act, ...), and with the sync-free and zero-sync dispatchers: weights, gradients
    and losses after 3 iterations equal the plain schedule's; the plan ran every iteration and the
    expert modules' activations left the device."""
    from tests.schedules.jobs import MEGATRON_EP_OVERLAP as M, OFFLOAD_ALL_MOE as O

    base = ["--recipe", "recipes/tiny_moe.yaml", "--expert-model-parallel-size", "2", "--bf16",
            "--train-iters", "3", "--num-layers", "2"]
    sync_free = ["--moe-sync-free-dispatcher"]
    zero_sync = sync_free + ["--moe-zero-sync-dropless"]
    variants = {"plain": [], "megatron": M, "megatron+offload": M + O,
                "megatron+sync_free+offload": M + sync_free + O,
                "megatron+zero_sync+offload": M + zero_sync + O}
    results = run_distributed(2, "tests.schedules.jobs:train_digests", base=base, variants=variants)
    for rank, per in enumerate(results):
        ref = per["plain"]
        assert ref["combined_1f1b_calls"] == 0
        losses = [h["lm loss"] for h in ref["history"]]
        for name, r in per.items():
            where = f"{name} rank {rank}"
            assert r["params"] == ref["params"] and r["grads"] == ref["grads"], where
            assert [h["lm loss"] for h in r["history"]] == losses, where
            if name != "plain":
                assert r["combined_1f1b_calls"] == 3, where
            if name.endswith("offload"):
                by_kind = {}
                for key, v in r["offloaded"].items():
                    by_kind[key.split("/")[0]] = by_kind.get(key.split("/")[0], 0) + v["offloaded"]
                assert all(by_kind.get(m, 0) > 0 for m in ("router_fc1", "moe_act", "core_attention")), (where, by_kind)


def test_bitwise_equal_with_data_parallel_overlapped_grad_reduce():
    """TP2 x DP2 with megatron DDP's overlapped grad reduce and the distributed optimizer: no_sync
    is left around the same backward as in the plain schedule; grads after finalize are equal."""
    results = run_distributed(4, "tests.schedules.jobs:check_bitwise", kind="dense", tp=2,
                              extra=["--overlap-grad-reduce", "--use-distributed-optimizer"])
    for r in results:
        assert r["grad_mismatch"] == [] and r["losses_equal"] and r["rng_equal"]
        assert r["ours"]["tp_handed_off"] > 0
        _all_backward_collectives_handed_off(r)


def test_bitwise_equal_with_full_recompute():
    """Recompute runs forward code (TP collectives, dropout) inside the backward lane, on the
    autograd device thread (a reentrant backward there): its collectives are handed off too."""
    results = run_distributed(2, "tests.schedules.jobs:check_bitwise", kind="dense",
                              tp=2, extra=["--recompute-granularity", "full", "--recompute-method",
                                           "uniform", "--recompute-num-layers", "1"])
    for r in results:
        assert r["grad_mismatch"] == [] and r["losses_equal"] and r["rng_equal"]
        assert r["ours"]["tp_handed_off"] > 0
        _all_backward_collectives_handed_off(r)


@pytest.mark.parametrize("layout", ["tp2", "tp2_pp2"])
def test_bitwise_equal_with_activation_offload(layout):
    """Composes with our activation offload (megatron_ext.offload): same bytes offloaded and
    reloaded, bit-identical results. (Its --activation-offload-debug mode, deferred CPU copy
    queues, differs from the plain schedule under our order F[j], B[i<j] even with the pairs run
    serially in one thread, i.e. without any interleaving: see docs/overlap.md, Limits.)"""
    lay = LAYOUTS[layout]
    results = run_distributed(
        lay["world"], "tests.schedules.jobs:check_bitwise", kind="dense", tp=lay["tp"],
        pp=lay["pp"], extra=["--activation-offload-modules", "core_attention", "qkv_linear",
                             "attn_proj", "--activation-offload-min-tensor-kb", "0"],
    )
    for r in results:
        assert r["grad_mismatch"] == [] and r["losses_equal"] and r["rng_equal"]
        assert r["ours"]["tp_handed_off"] > 0
        assert r["ours"]["offload"]["offloaded_bytes"] > 0
        assert r["ours"]["offload"]["reloaded_bytes"] == r["ours"]["offload"]["offloaded_bytes"]
        _all_backward_collectives_handed_off(r)
    _check_pipeline_messages(results)


@pytest.mark.parametrize("recipe, world, layout", [
    ("recipes/tiny_dense.yaml", 2, ["--tensor-model-parallel-size", "2"]),
    ("recipes/tiny_moe.yaml", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                  "2", "--sequence-parallel"]),
])
def test_train_py_trains_a_recipe_with_it_on(recipe, world, layout):
    """train.py with --overlap-tp-comm-1f1b: the overlapped schedule runs every iteration and the
    per-iteration losses and grad norms (optimizer updates included) equal the plain run's."""
    # two iterations at the full learning rate (the recipes warm up for two at a lower one): the second
    # step's losses follow the first's update, whose moments the second update reads
    argv = ["--recipe", recipe, "--train-iters", "2", "--lr-warmup-iters", "0", "--global-batch-size", "8", *layout]
    off = run_distributed(world, "tests.schedules.jobs:train_losses", argv=argv)
    on = run_distributed(world, "tests.schedules.jobs:train_losses",
                         argv=argv + ["--overlap-tp-comm-1f1b"])
    for r_off, r_on in zip(off, on):
        assert r_off["calls"] == 0 and r_on["calls"] == 2 and r_on["pairs"] > 0
        assert list(map(repr, r_on["losses"])) == list(map(repr, r_off["losses"]))  # NaN off the last stage
        assert r_on["grad_norms"] == r_off["grad_norms"]
    last_stage = on[-1]["losses"]
    assert len(last_stage) == 2 and all(x == x for x in last_stage)  # real numbers on the last stage


def test_lane_from_the_thread_loses_the_backward_hand_offs_under_cuda_faithful_backward():
    """Negative control for the lane lookup: taken from the asking thread (a thread-local, as
    before), the backward's collectives, issued on the autograd device thread, find no lane and
    are never handed off; results stay bit-identical, only the overlap is lost. Without the mode
    (backward on the caller's thread, CPU autograd) the same lookup still hands off."""
    faithful = run_distributed(2, "tests.schedules.jobs:check_thread_local_lanes",
                               faithful=True)
    plain_cpu = run_distributed(2, "tests.schedules.jobs:check_thread_local_lanes",
                                faithful=False)
    for r_f, r_c in zip(faithful, plain_cpu):
        assert r_f["cuda_faithful"] and not r_c["cuda_faithful"]
        assert r_f["grad_mismatch"] == [] and r_f["losses_equal"]
        assert r_f["ours"]["b_lane"]["handed_off"] == 0
        assert r_c["ours"]["b_lane"]["handed_off"] == r_c["ours"]["b_lane"]["collectives"] > 0
        assert r_f["ours"]["tp_handed_off"] < r_c["ours"]["tp_handed_off"]


def test_one_communicator_per_kind_deadlocks_under_nccl_p2p_and_is_reported():
    """Negative control for the pipeline communicators: with activations (and gradients) of both
    directions on one communicator per kind, PP2 x VPP2 puts two sends head to head under NCCL's
    rules; the CUDA-faithful mode reports it on both ranks, with both ranks' pending ops, within
    seconds. The schedule's own layout (one communicator per kind and direction) completes."""
    from megatron_ext.schedules import pipeline_plan

    shared = run_distributed(2, "tests.schedules.jobs:check_p2p_layout_deadlock",
                             layout=pipeline_plan.SHARED)
    for r in shared:
        assert not r["completed"] and r["seconds"] < 30, r
        assert "deadlock: both heads are sends" in r["error"]
        assert "rank 0 (" in r["error"] and "rank 1 (" in r["error"] and "pending: send to" in r["error"]
    ours = run_distributed(2, "tests.schedules.jobs:check_p2p_layout_deadlock",
                           layout=pipeline_plan.DIRECTIONAL)
    assert all(r["completed"] for r in ours)


def test_rng_per_lane_is_needed():
    """Negative control: without the per-lane RNG swap the forward's dropout draws change, so
    the bitwise check above is able to fail."""
    results = run_distributed(2, "tests.schedules.jobs:check_without_rng_swap")
    assert any(not r["losses_equal"] or r["grad_mismatch"] for r in results)


def test_plan_pairs_distinct_and_ordered():
    from megatron_ext.schedules.pipeline_plan import plan

    for pp, chunks, m in [(1, 1, 4), (1, 1, 1), (2, 1, 8), (4, 1, 8), (2, 2, 4), (2, 2, 8), (4, 2, 8)]:
        for rank in range(pp):
            table, events = plan(m, chunks, pp, rank, group=pp if chunks > 1 else None)
            fwd = [e[1] for e in events if e[0] in ("F", "FB")]
            bwd = [e[-1] for e in events if e[0] in ("B", "FB")]
            assert fwd == list(range(len(table))) and bwd == list(range(len(table)))
            _, paired = plan(m, chunks, pp, rank, group=pp if chunks > 1 else None, pair_warmup=True)
            warmup = [e for e in events if e[0] == "F"]
            assert [e for e in paired if e[0] not in ("F", "FF")] == [e for e in events if e[0] != "F"]
            assert [v for e in paired if e[0] in ("F", "FF") for v in e[1:]] == [e[1] for e in warmup]
            assert sum(e[0] == "FF" for e in paired) == len(warmup) // 2
            for e in events:
                if e[0] == "FB":
                    f, b = e[1], e[2]
                    assert f > b  # a forward is always ahead of the backward it is paired with
                    bmb, bc = table[b][0], chunks - 1 - table[b][1]
                    assert (table[f][0], table[f][1]) != (bmb, bc)
            if pp == 1 and m > 1:
                assert events[0] == ("F", 0) and events[-1] == ("B", m - 1)
                assert [e[0] for e in events[1:-1]] == ["FB"] * (m - 1)


def _parser():
    from megatron_ext.schedules import add_arguments

    return add_arguments(argparse.ArgumentParser())


def test_flag_does_not_clash_with_megatron():
    import arguments

    parser = arguments.build_parser()  # argparse raises on a duplicate option
    opts = {o for a in parser._actions for o in a.option_strings}
    assert "--overlap-tp-comm-1f1b" in opts
    args = parser.parse_args(["--overlap-tp-comm-1f1b"])
    assert args.overlap_tp_comm_1f1b is True
    assert args.tp_comm_overlap is False and args.overlap_moe_expert_parallel_comm is False


@pytest.mark.parametrize(
    "settings, needle",
    [
        (dict(tensor_model_parallel_size=1), "--tensor-model-parallel-size=1"),
        (dict(tensor_model_parallel_size=1, num_experts=8, expert_model_parallel_size=1),
         "nothing to hide"),
        (dict(defer_embedding_wgrad_compute=True), "--defer-embedding-wgrad-compute=True"),
        (dict(transformer_impl="transformer_engine"), "--transformer-impl=transformer_engine"),
        (dict(cuda_graph_impl="local"), "--cuda-graph-impl=local"),
        (dict(delay_wgrad_compute=True), "--delay-wgrad-compute=True"),
    ],
)
def test_refused_where_it_cannot_apply(settings, needle):
    from megatron_ext.errors import ConfigError
    from megatron_ext.schedules import validate
    from tests.parsed import parsed_args

    base = dict(overlap_tp_comm_1f1b=True, tensor_model_parallel_size=2, transformer_impl="local")
    base.update(settings)
    with pytest.raises(ConfigError) as e:
        validate(parsed_args(**base))
    assert "--overlap-tp-comm-1f1b" in str(e.value) and needle in str(e.value)


def test_validate_accepts_and_ignores_when_off():
    from megatron_ext.schedules import validate
    from tests.parsed import parsed_args

    validate(parsed_args(overlap_tp_comm_1f1b=False, tensor_model_parallel_size=1))
    validate(parsed_args(overlap_tp_comm_1f1b=True, tensor_model_parallel_size=2,
                         transformer_impl="local"))
    # TP1 with expert parallelism: the EP all-to-all is there to hide
    validate(parsed_args(overlap_tp_comm_1f1b=True, tensor_model_parallel_size=1,
                         num_experts=8, expert_model_parallel_size=2, transformer_impl="local"))
    # TP1 with context parallelism: its attention's collectives are there to hide
    validate(parsed_args(overlap_tp_comm_1f1b=True, tensor_model_parallel_size=1, context_parallel_size=2,
                         transformer_impl="local"))


def test_get_forward_backward_func_picks_ours_only_with_flag():
    results = run_distributed(2, "tests.schedules.jobs:which_schedule")
    for r in results:
        assert r == {"on": "forward_backward_overlap", "off": "forward_backward_no_pipelining"}


def test_recipe_key_enables_it_and_refusal_happens_before_compute(tmp_path):
    import arguments
    from megatron_ext.errors import ConfigError

    recipe = tmp_path / "r.yaml"
    recipe.write_text(open("recipes/tiny_dense.yaml").read() + "\noverlap_tp_comm_1f1b: true\n")
    args = arguments.parse(["--recipe", str(recipe), "--tensor-model-parallel-size", "2",
                            "--world-size", "2", "--dry-run"], exit_on_dry_run=False)
    assert args.overlap_tp_comm_1f1b is True
    with pytest.raises(ConfigError, match=r"--overlap-tp-comm-1f1b=True .*--tensor-model-parallel-size=1"):
        arguments.parse(["--recipe", str(recipe), "--world-size", "2", "--dry-run"], exit_on_dry_run=False)
    # the alias names the same flag
    args = arguments.parse(["--recipe", "recipes/tiny_moe.yaml", "--expert-model-parallel-size", "2",
                            "--overlap-model-parallel-comm-1f1b", "--world-size", "2", "--dry-run"],
                           exit_on_dry_run=False)
    assert args.overlap_tp_comm_1f1b is True


def test_delay_wgrad_compute_with_megatron_ep_overlap_where_megatron_allows_it():
    """--delay-wgrad-compute rides megatron's EP overlap: accepted by a CUDA dry run with
    transformer-engine (and apex's fused wgrad accumulation), refused by name on CPU (local
    layers), and refused by name with our schedule."""
    import arguments
    from megatron_ext.errors import ConfigError

    base = ["--recipe", "recipes/tiny_moe.yaml", "--expert-model-parallel-size", "2", "--bf16",
            "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--world-size", "2", "--dry-run"]
    te = ["--transformer-impl", "transformer_engine", "--platform", "cuda", "--assume-te", "--assume-apex"]
    args = arguments.parse(base + te, exit_on_dry_run=False)
    assert args.delay_wgrad_compute and args.overlap_moe_expert_parallel_comm
    with pytest.raises(ConfigError, match=r"--delay-wgrad-compute=True"):
        arguments.parse(base, exit_on_dry_run=False)
    with pytest.raises(ConfigError, match=r"--overlap-tp-comm-1f1b=True .*--delay-wgrad-compute=True"):
        arguments.parse(base + te + ["--overlap-tp-comm-1f1b"], exit_on_dry_run=False)


def test_exposed_time_on_cuda_is_taken_with_events_on_the_compute_stream(monkeypatch):
    """On CUDA, NCCL's wait() does not block the host: the time the compute waits is read from
    CUDA events recorded around the wait (stand-ins here record what they were asked)."""
    import torch

    from bench.overlap import Recorder
    from megatron_ext.schedules import exposed_comm

    class Event:
        clock = 0.0

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self, stream=None):
            self.t = Event.clock

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3  # ms, like CUDA events

    class Work:
        def wait(self):
            Event.clock += 0.25  # the compute stream waits 250 ms; the host does not

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(exposed_comm, "EXPOSED_S", {})
    monkeypatch.setattr(exposed_comm, "_PENDING_EVENTS", [])
    rec = Recorder()
    token = rec.collective_issued("all_reduce", "tp", 8, "F0", "F", False)
    t0, t1, events = exposed_comm.timed_wait(Work(), "tp")
    rec.collective_waited(token, t0, t1, events, True, False)
    assert rec.exposed("tp") == pytest.approx(0.25)
    assert exposed_comm.exposed_seconds() == {"tp": pytest.approx(0.25)}


def test_cost_model_arithmetic():
    from megatron_ext.schedules import costmodel

    link = costmodel.Link("test", bus_bandwidth=1e9, latency=1e-6, flops=1e12)
    # all-reduce of 1 MB over 2 ranks: 1e-6 + 2*(1/2)*1e6/1e9 = 1.001 ms; 0.5 GFLOP = 0.5 ms between
    recs = [{"op": "all_reduce", "nbytes": 1_000_000, "flops_linear": 5e8, "flops_attn": 0}]
    m = costmodel.modeled_hidden(recs, link)
    assert m["comm_s"] == pytest.approx(1.001e-3) and m["hidden_fraction"] == pytest.approx(0.5 / 1.001)
    # no compute between: nothing hidden; 4x the linear FLOPs: fully hidden (capped at 1)
    assert costmodel.modeled_hidden([dict(recs[0], flops_linear=0)], link)["hidden_fraction"] == 0
    assert costmodel.modeled_hidden(recs, link, scale=(4, 1, 1))["hidden_fraction"] == 1.0
    lin, attn, nbytes = costmodel.shape_scale({"hidden": 256, "seq": 128, "mbs": 2},
                                             {"hidden": 512, "seq": 256, "mbs": 1})
    assert (lin, attn, nbytes) == (4.0, 4.0, 2.0)
