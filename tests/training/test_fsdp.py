"""Megatron-FSDP (--use-megatron-fsdp) trains through train.py and agrees with DDP + the
distributed optimizer from the same weights (--layout-invariant-init) and batches.

Tolerance: loss and grad norm within relative 1e-6 of the DDP run (observed: at most ~2e-7).
Not bitwise in general, for two reasons of summation order, not of math: the grad norm sums the
squares of differently sharded gradients (per-parameter shards, not DDP's bucket ranges), and
with `optim_grads` / `optim_grads_params` the gradients are reduce-scattered after every
micro-batch, so a rank's micro-batches are summed after the data-parallel sum, not before.
`optim` reduces once per step as DDP does: its losses are bitwise those of DDP.

Each layout's comparison is one job (DDP, every strategy, and megatron_ext's features under one of
them: tests/training/test_fsdp_compose.py says how a feature is compared), so a run that two
comparisons need is trained once.
"""
from __future__ import annotations

import math

import pytest

from tests.dist import run_distributed

# Two layers: every property below holds per FSDP unit and needs more than one unit (the root and
# two layers: a unit gathered while another is freed or prefetched), not four. The tests that count
# collectives and bytes per unit (memory, storage, teardown) name their four layers.
# two iterations at the full learning rate: the two optimizer updates that three with a warmup
# iteration (at lr 0) made, the second reading the Adam moments the first wrote
ITERS = 2
DENSE = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data", "--train-iters", str(ITERS), "--lr-warmup-iters", "0",
         "--layout-invariant-init", "--log-interval", "100", "--num-layers", "2"]
MOE = ["--recipe", "recipes/tiny_moe.yaml", "--train-iters", str(ITERS), "--lr-warmup-iters", "0",
       "--layout-invariant-init", "--log-interval", "100", "--moe-router-dtype", "fp32", "--num-layers", "2"]
FOUR_LAYERS = ["--num-layers", "4"]
MOE_LAYERS = 2  # every layer of tiny_moe is a MoE layer: one token dispatcher each
STRATEGIES = ["optim", "optim_grads", "optim_grads_params"]
RTOL = 1e-6
FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
# the features composed with a wrapper: the same run with and without each, in one job
# (tests/training/jobs_fsdp_compose.py). Offload in debug mode: released device storage poisoned and
# the copy streams deferred, so a missing wait or an early release (e.g. of a storage the wrapper
# frees and re-gathers) shows in the numbers.
OFFLOAD = ["--activation-offload-min-tensor-kb", "1", "--activation-offload-debug"]
DENSE_OFFLOAD = ["--activation-offload-modules", "core_attention", "qkv_linear", "attn_proj", *OFFLOAD]
MOE_OFFLOAD = ["--activation-offload-modules", "core_attn", "qkv_linear", "attn_proj", "expert_fc1", "router_fc2",
               "moe_act", *OFFLOAD]
SYNC_FREE = ["--moe-sync-free-dispatcher"]
ZERO_SYNC = SYNC_FREE + ["--moe-zero-sync-dropless"]
OVERLAP = ["--overlap-tp-comm-1f1b"]
VARIANTS = "tests.training.jobs_fsdp_compose:variants"


def strategy(name: str) -> list[str]:
    return FSDP + ["--data-parallel-sharding-strategy", name]


def runs(world_size: int, argv: list[str], **features) -> list[dict]:
    """Every rank's runs, in one job: DDP + the distributed optimizer ('ddp'), Megatron-FSDP under
    each strategy (named by it), and each of `features` (name -> its wrapper's flags and its own)."""
    flags = {"ddp": ["--use-distributed-optimizer"], **{s: strategy(s) for s in STRATEGIES}, **features}
    return run_distributed(world_size, VARIANTS, argv=argv + ["--world-size", str(world_size)], flags=flags)


def assert_agree(runs: dict) -> None:
    """Each strategy's losses and grad norms (this rank's log) within RTOL of DDP's; optim's losses
    bitwise."""
    ddp = runs["ddp"]["history"]
    assert len(ddp) == ITERS and ddp[-1][0] < ddp[0][0]  # it learns
    for strategy_name in STRATEGIES:
        got = runs[strategy_name]["history"]
        for i, key in enumerate(("lm loss", "grad norm")):
            a, b = [r[i] for r in ddp], [r[i] for r in got]
            assert all(math.isfinite(x) and math.isclose(x, y, rel_tol=RTOL) for x, y in zip(a, b)), \
                (strategy_name, key, a, b)
    assert [r[0] for r in runs["optim"]["history"]] == [r[0] for r in ddp]  # one reduction per step, as DDP


def assert_same_as(results: list[dict], reference: str, features) -> None:
    """Every rank: each feature's run bit-identical to `reference` (losses, grad norms, this rank's
    parameter shards after the last step)."""
    for rank, runs in enumerate(results):
        ref = runs[reference]
        assert len(ref["history"]) == ITERS and ref["history"][-1][0] < ref["history"][0][0]  # it learns
        assert ref["params"]
        for name in features:
            assert runs[name]["history"] == ref["history"], (rank, name)  # exact floats: loss, grad norm
            assert runs[name]["params"] == ref["params"], (rank, name)  # this rank's shards, bit for bit


def assert_offloaded(run: dict) -> None:
    assert run["offloaded"] > 0 and run["reloaded"] == run["offloaded"]


def test_dense_dp2():
    """And activation offload under ZeRO-3 (weights gathered and freed around every use): bitwise
    the run without it, and it offloads exactly the bytes it offloads under DDP, so no parameter
    bytes (views of the gathered buckets) are taken for activations."""
    results = runs(2, DENSE, offload=strategy("optim_grads_params") + DENSE_OFFLOAD,
                   ddp_offload=["--use-distributed-optimizer", *DENSE_OFFLOAD])
    assert_agree(results[-1])
    assert_same_as(results, "optim_grads_params", ["offload"])
    for r in results:
        assert_offloaded(r["offload"])
        assert r["offload"]["offloaded"] == r["ddp_offload"]["offloaded"]


def test_moe_ep2():
    """And under ZeRO-3 (expert weights unsharded, dense ones sharded over DP2): activation
    offload, the sync-free dispatcher, zero-sync dropless, each bitwise the run without it."""
    ogp = strategy("optim_grads_params")
    features = {"offload": ogp + MOE_OFFLOAD, "sync-free": ogp + SYNC_FREE, "zero-sync": ogp + ZERO_SYNC}
    results = runs(2, MOE + ["--expert-model-parallel-size", "2"], **features)
    assert_agree(results[-1])
    assert_same_as(results, "optim_grads_params", features)
    for r in results:
        assert [r[n]["dispatchers"] for n in features] == [0, MOE_LAYERS, MOE_LAYERS]  # every MoE layer's
        assert_offloaded(r["offload"])


def test_dense_dp2_tp2():
    """And --overlap-tp-comm-1f1b under optim (one gradient reduce-scatter per step, as DDP; no
    pipeline: consecutive micro-batches paired): bitwise, the paired schedule ran every iteration."""
    results = runs(4, DENSE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                   overlap=strategy("optim") + OVERLAP)
    assert_agree(results[-1])
    assert_same_as(results, "optim", ["overlap"])
    assert [(r["optim"]["overlap_calls"], r["overlap"]["overlap_calls"]) for r in results] == [(0, ITERS)] * 4


def _parse(argv: list[str]):
    import os

    import arguments

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        return arguments.parse(argv + ["--dry-run"], exit_on_dry_run=False)
    finally:
        os.chdir(cwd)


def test_no_gather_in_flight_when_the_process_groups_are_destroyed():
    """--overlap-param-gather prefetches the next forward's buckets after every step; at the end of
    the run they are waited for before the groups go (destroyed under them, gloo crashed)."""
    argv = DENSE + FOUR_LAYERS + strategy("optim_grads_params") + ["--overlap-param-gather", "--overlap-grad-reduce",
                                                                   "--world-size", "2"]
    for out in run_distributed(2, "tests.training.jobs_fsdp:gathers_in_flight_at_teardown", argv=argv):
        assert out == {"pipelines": 1, "in flight": [0]}


def test_no_storage_is_freed_under_a_collective_in_flight():
    """ZeRO-3 with the overlapped gather and reduce (prefetched all-gathers, queued reduce-scatters):
    no bucket storage is resized to 0 or reallocated between an asynchronous collective on it and
    its wait(). On gloo that would be a write into freed memory (heap corruption); on NCCL, a block
    the stream-ordered allocator hands to the next allocation while the collective still uses it."""
    argv = DENSE + FOUR_LAYERS + strategy("optim_grads_params") + ["--overlap-param-gather", "--overlap-grad-reduce",
                                                                   "--world-size", "2"]
    for out in run_distributed(2, "tests.training.jobs_fsdp:storage_kept_while_in_flight", argv=argv):
        assert out["async"] > 20 and out["resizes"] > 20, out  # the gathers and the bucket frees were seen
        assert out["violations"] == [] and out["unwaited"] == 0 and out["error"] is None, (out["error"],
                                                                                           out["violations"][:1])


def test_validates_on_cpu_with_the_launch_environment_megatron_asks():
    """Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS != 1 for Megatron-FSDP (arguments.py:1143), while
    the CPU shims set it to 1 for its TP check: validation sees FSDP's environment, then it is back."""
    import os

    before = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    args = _parse(DENSE + ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--world-size", "4",
                           "--tensor-model-parallel-size", "2", "--data-parallel-sharding-strategy", "optim_grads_params"])
    assert args.use_megatron_fsdp and args.use_distributed_optimizer  # megatron's: FSDP implies it
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == before


def test_refusals_name_the_flag():
    from megatron_ext.errors import ConfigError

    fsdp = DENSE + ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--world-size", "4"]
    with pytest.raises(ConfigError, match=r"^--pipeline-model-parallel-size=2, --use-megatron-fsdp=True: .*no pipeline"):
        _parse(fsdp + ["--pipeline-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match=r"^--ckpt-format=torch_dist, --use-megatron-fsdp=True: .*fsdp_dtensor"):  # megatron's own rule
        _parse(DENSE + ["--use-megatron-fsdp", "--world-size", "2"])
    with pytest.raises(ConfigError, match=r"^--use-nccl-ub=True: NCCL user-buffer registration"):  # CUDA + NCCL only
        _parse(fsdp + ["--use-nccl-ub"])
    with pytest.raises(ConfigError, match=r"^--layout-invariant-init with --init-model-with-meta-device: "):
        _parse(fsdp + ["--init-model-with-meta-device"])
    with pytest.raises(ConfigError, match=r"^--init-model-with-meta-device without --use-megatron-fsdp: "):
        _parse(DENSE + ["--init-model-with-meta-device", "--world-size", "2"])


def test_resume_is_exact_and_checkpoints_are_verified(tmp_path):
    """MoE EP2 under optim_grads_params (SwiGLU, experts, two optimizers: every preprocessing step of
    the fsdp_dtensor format): saved at 2 and 3, resumed, bitwise the uninterrupted run; a flipped
    tensor byte in the newest checkpoint is named, and the run falls back to iteration 2 exactly;
    --finetune from it loads the weights only."""
    argv = MOE + strategy("optim_grads_params") + ["--expert-model-parallel-size", "2", "--world-size", "2"]
    out = run_distributed(2, "tests.training.jobs_fsdp:resume", argv=_without_iters(argv),
                          save_dir=str(tmp_path / "ckpt"), finetune=True)[-1]
    straight = [(r["lm loss"], r["grad norm"]) for r in out["straight"]]
    assert [(r["lm loss"], r["grad norm"]) for r in out["first"]] == straight[:3]
    assert [(r["lm loss"], r["grad norm"]) for r in out["resumed"]] == straight[3:]
    # --finetune: the weights only, as megatron's (a fresh optimizer, no RNG state)
    finetune, weights_only = ([(r["lm loss"], r["grad norm"]) for r in run] for run in out["finetune"])
    assert finetune == weights_only and len(finetune) == 2, (finetune, weights_only)
    assert out["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json", "recipe.yaml",
                            "rng_state.0.pt", "rng_state.1.pt"]
    assert out["refused"].startswith("damaged checkpoint ") and "iter_0000003: __1_0.distcp checksum mismatch" in out["refused"]
    assert [(r["lm loss"], r["grad norm"]) for r in out["fallback"]] == straight[2:3]
    # --auto-detect-ckpt-format: the resumed run read the format from the checkpoint; a DDP model asked
    # to load it is refused by name
    assert out["cross"].startswith("--auto-detect-ckpt-format: ") and "is a fsdp_dtensor checkpoint" in out["cross"]


def test_async_save_resumes_exactly_and_is_verified(tmp_path):
    """--async-save: the fsdp_dtensor files are written by megatron-core's forked writer, summed as
    written, committed when every rank is done; the resume is bitwise and a damaged byte is named."""
    argv = DENSE + strategy("optim_grads_params") + ["--world-size", "2"]
    out = run_distributed(2, "tests.training.jobs_fsdp:resume", argv=_without_iters(argv),
                          save_dir=str(tmp_path / "ckpt"), save_flags=("--async-save",), fallback=False)[-1]
    straight = [(r["lm loss"], r["grad norm"]) for r in out["straight"]]
    assert [(r["lm loss"], r["grad norm"]) for r in out["first"]] == straight[:3]
    assert [(r["lm loss"], r["grad norm"]) for r in out["resumed"]] == straight[3:]
    assert out["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json", "recipe.yaml",
                            "rng_state.0.pt", "rng_state.1.pt"]  # no sums left beside the files: all taken at commit
    assert "iter_0000003: __1_0.distcp checksum mismatch" in out["refused"]


def _without_iters(argv: list[str]) -> list[str]:
    i = argv.index("--train-iters")
    return argv[:i] + argv[i + 2:]



# The layers in flight made visible: the prefetch window of all-gathers (S/2 elements) and the
# reduce-scatter queue (S) sized to the tiny model's units (65,664 elements per transformer layer);
# megatron's default S is at least 1e9 elements, which would gather this whole model at once.
UNIT = 2 * 65664
MEMORY_ARGV = DENSE + FOUR_LAYERS + ["--overlap-grad-reduce", "--overlap-param-gather", "--suggested-communication-unit-size",
                       str(UNIT), "--train-iters", "2", "--lr-warmup-iters", "1", "--log-interval", "1", "--log-params-norm",
                       "--log-num-zeros-in-grad"]


@pytest.mark.parametrize("dp", [2, 4])
def test_memory_per_rank_is_one_over_dp(dp):
    """Per-rank bytes of real storage (log line: parameters, gradients, optimizer state; the
    unsharded buckets now and at peak), the formula of docs/fsdp.md "Memory per rank", DP2 and DP4, dense:

    - optim_grads_params holds each parameter group's padded bucket / DP, for the model weights,
      the fp32 main weights and the gradients: exactly, every rank. A group's bucket pads its
      parameters to whole rows (a shard is cut on rows of `row` elements) and to DP rows, so its
      padding is < (DP + parameters) x row elements: against DDP's unsharded buffers (+ the
      distributed optimizer) each sharded quantity x DP is within that padding of the unsharded.
    - Adam's state is the same 1/DP under DDP + distributed optimizer and every strategy (summed
      over ranks: equal up to the per-parameter step scalars); a rank's share differs from 1/DP by
      at most the padding (it lies on the last ranks).
    - optim keeps weights and gradients whole; optim_grads shards the gradients.
    - In flight: between steps the root group and the first unit (the optimizer step's prefetch);
      at peak at most root (weights + gradients) + (1 + ceil(S/2 / unit)) units of weights +
      (ceil(S / unit) + 1) units of gradients, less than the whole unsharded model."""
    out = run_distributed(dp, "tests.training.jobs_fsdp:memory", argv=MEMORY_ARGV + ["--world-size", str(dp)],
                          strategies=STRATEGIES)
    groups = out[0]["optim_grads_params"]["groups"]
    assert len(groups) == 5 and all(o["optim_grads_params"]["groups"] == groups for o in out)  # root + 4 layers
    isz = groups[0]["grad itemsize"]
    assert all(g["grad itemsize"] == g["weight itemsize"] == isz == 4 for g in groups)  # fp32 run
    buckets = sum(g["bucket"] for g in groups)
    pad_bound = sum((dp + g["params"]) * g["row"] for g in groups)  # elements, unsharded
    assert all(0 <= g["bucket"] - g["numel"] < (dp + g["params"]) * g["row"] for g in groups)
    pad = sum(g["bucket"] - g["numel"] for g in groups)
    steps = 8 * sum(g["params"] for g in groups)  # a step scalar per parameter, at most 8 bytes
    for rank in range(dp):
        ddp, ogp = out[rank]["ddp"], out[rank]["optim_grads_params"]
        optim, optim_grads = out[rank]["optim"], out[rank]["optim_grads"]
        # sharded: exactly the padded buckets / DP; the main weights are a second fp32 copy
        assert ogp["grad bytes"] == buckets * isz // dp
        assert ogp["param bytes"] == 2 * buckets * isz // dp
        # against the unsharded: x DP within the padding
        assert abs(dp * ogp["grad bytes"] - ddp["grad bytes"]) <= pad_bound * isz
        assert abs(dp * ogp["param bytes"] - 2 * ddp["param bytes"]) <= 2 * pad_bound * isz
        assert abs(dp * optim_grads["grad bytes"] - ddp["grad bytes"]) <= pad_bound * isz
        assert abs(optim["grad bytes"] - ddp["grad bytes"]) <= pad_bound * isz  # whole
        assert abs(optim["param bytes"] - (ddp["param bytes"] + ddp["param bytes"] // dp)) <= 2 * pad_bound * isz
        assert optim_grads["param bytes"] == optim["param bytes"]
        # Adam's state: 1/DP everywhere
        for run in ("ddp", "optim", "optim_grads", "optim_grads_params"):
            assert abs(out[rank][run]["optim bytes"] - _summed(out, run) / dp) <= 2 * pad * isz + steps, (rank, run)
        # in flight
        assert optim["fsdp unsharded bytes"] == optim["fsdp unsharded peak bytes"] == 0
        root, unit = groups[0]["bucket"] * isz, groups[1]["bucket"]
        assert ogp["fsdp unsharded bytes"] == root + unit * isz
        peak = 2 * root + ((1 + -(-UNIT // 2 // unit)) + (-(-UNIT // unit) + 1)) * unit * isz
        assert root + unit * isz < ogp["fsdp unsharded peak bytes"] <= peak < 2 * buckets * isz
    # --log-params-norm: megatron's calc_params_l2_norm over Megatron-FSDP's DTensor shards, the same
    # norm on every rank and strategy (DDP's is read before --overlap-param-gather's next gather: each
    # rank sees its own updated half); --log-num-zeros-in-grad: the same count everywhere
    norm = out[0]["optim_grads_params"]["params norm"]
    assert all(math.isclose(o[run]["params norm"], norm, rel_tol=1e-9) for o in out for run in STRATEGIES)
    assert len({o[run]["num zeros"] for o in out for run in ("ddp", *STRATEGIES)}) == 1
    summed = _summed(out, "ddp")
    for run in ("optim", "optim_grads", "optim_grads_params"):
        assert abs(_summed(out, run) - summed) <= steps
    assert abs(summed - 2 * isz * sum(g["numel"] for g in groups)) <= steps  # Adam: 2 moments x every element


def _summed(out: list, run: str) -> int:
    return sum(o[run]["optim bytes"] for o in out)


def test_deepseek_v3_fsdp_tiny_recipe_trains():
    """recipes/deepseek_v3_fsdp_tiny.yaml (Megatron-LM's DeepSeek-V3 Megatron-FSDP example scaled down:
    MLA, DeepSeek routing, MTP, ZeRO-3 with its flags) on 2 ranks: built on the meta device
    (--init-model-with-meta-device: as under pretrain_gpt.py, the parameters megatron-core creates
    without naming a device, norms and routers; its tensor-parallel linears and embeddings name the
    device), Megatron-FSDP materialises and initialises them, and the buffers of the modules it
    materialises keep their built values; the loss is finite and falls."""
    out = run_distributed(2, "tests.training.jobs_fsdp:meta_built",
                          argv=["--recipe", "recipes/deepseek_v3_fsdp_tiny.yaml", "--train-iters", "6",
                                "--global-batch-size", "4"])  # one micro-batch per rank and step
    losses = [r["lm loss"] for r in out[-1]["history"]]
    assert out[0]["experimental"] == [True, False]  # --enable-experimental: megatron-core's flag, for the run
    meta = out[0]["meta"]
    assert "decoder.final_layernorm.weight" in meta and "decoder.layers.1.mlp.router.weight" in meta
    assert not any("linear_fc1" in name or "embedding" in name for name in meta)
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.1, losses
    assert 0 < out[-1]["history"][-1]["param bytes"] and out[-1]["history"][-1]["fsdp unsharded peak bytes"] > 0
    # The routers' expert bias and token counts are the zeros they were built with on every rank, not
    # the uninitialised memory Megatron-FSDP's materialisation gives a meta module's buffers (the build
    # fills such memory with NaN here): 2 MoE layers and the MTP layer, 8 experts each
    for o in out:
        buffers = o["router buffers"]
        assert len(buffers) == 6 and all(v == [0.0] * 8 for v in buffers.values()), buffers


def test_nccl_ub_registers_the_buffers_once_after_the_first_step():
    """--use-nccl-ub (CUDA + NCCL; refused on CPU): megatron's loop registers each Megatron-FSDP
    chunk's buffers once, after the first step of the run (training.py:3913-3926)."""
    from types import SimpleNamespace

    from megatron_ext.training.model import register_fsdp_buffers

    calls = []
    buffer = SimpleNamespace(manual_buffer_registration=lambda: calls.append("registered"))
    chunk = SimpleNamespace(ddp_config=SimpleNamespace(fsdp_manual_registration=True), param_and_grad_buffer=buffer)
    args = SimpleNamespace(use_megatron_fsdp=True, nccl_ub=True, fsdp_manual_registration=True)
    for steps_done in (1, 2, 3):
        register_fsdp_buffers(args, [chunk, chunk], steps_done)
    assert calls == ["registered"] * 2
    register_fsdp_buffers(SimpleNamespace(use_megatron_fsdp=True, nccl_ub=False, fsdp_manual_registration=False),
                          [chunk], 1)
    assert len(calls) == 2
