"""megatron_ext's features under Megatron-FSDP (--use-megatron-fsdp): each one against the same
Megatron-FSDP run without it (same sharding strategy, same layout, same weights and batches),
3 iterations: losses, grad norms and every rank's parameter shards after the last step bit-identical,
and the feature seen doing its work (bytes offloaded and reloaded, dispatchers replaced, paired
passes run). What cannot compose is refused by name."""
from __future__ import annotations

import pytest

from tests.dist import run_distributed
from tests.training.test_fsdp import _parse

COMMON = ["--train-iters", "3", "--lr-warmup-iters", "1", "--layout-invariant-init", "--log-interval", "100"]
DENSE = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data", *COMMON]
MOE = ["--recipe", "recipes/tiny_moe.yaml", "--moe-router-dtype", "fp32", *COMMON]
# Debug mode: released device storage poisoned and the copy streams deferred, so a missing wait or
# an early release (e.g. of a storage the wrapper frees and re-gathers) shows in the numbers.
OFFLOAD = ["--activation-offload-min-tensor-kb", "1", "--activation-offload-debug"]
DENSE_OFFLOAD = ["--activation-offload-modules", "core_attention", "qkv_linear", "attn_proj", *OFFLOAD]
MOE_OFFLOAD = ["--activation-offload-modules", "core_attn", "qkv_linear", "attn_proj", "expert_fc1", "router_fc2",
               "moe_act", *OFFLOAD]
SYNC_FREE = ["--moe-sync-free-dispatcher"]
ZERO_SYNC = SYNC_FREE + ["--moe-zero-sync-dropless"]
JOB = "tests.training.jobs_fsdp_compose:compose"


def _strategy(name: str) -> list[str]:
    return ["--data-parallel-sharding-strategy", name]


def assert_same_as_off(results: list[dict], features) -> None:
    for rank, runs in enumerate(results):
        off = runs["off"]
        assert len(off["history"]) == 3 and off["history"][2][0] < off["history"][0][0]  # it learns
        assert off["params"]
        for name in features:
            assert runs[name]["history"] == off["history"], (rank, name)  # exact floats: loss, grad norm
            assert runs[name]["params"] == off["params"], (rank, name)  # this rank's shards, bit for bit


def test_moe_ep2_optim_grads_params_offload_and_dispatchers():
    """MoE EP2 (8 experts; expert weights unsharded, dense ones sharded over DP2) under ZeRO-3:
    activation offload, the sync-free dispatcher, zero-sync dropless (with offload: the next test)."""
    features = {"offload": MOE_OFFLOAD, "sync-free": SYNC_FREE, "zero-sync": ZERO_SYNC}
    argv = MOE + ["--expert-model-parallel-size", "2", *_strategy("optim_grads_params"), "--world-size", "2"]
    results = run_distributed(2, JOB, argv=argv, features=features)
    assert_same_as_off(results, features)
    for runs in results:
        assert [runs[n]["dispatchers"] for n in features] == [0, 4, 4]  # every MoE layer's dispatcher
        assert runs["offload"]["offloaded"] > 0 and runs["offload"]["reloaded"] == runs["offload"]["offloaded"]


def test_moe_ep2_dp2_sharded_experts_zero_sync_with_offload():
    """EP2 x DP2 (4 ranks): the expert weights are sharded too (expert data-parallel size 2), so
    the grouped experts of zero-sync dropless and the offloaded expert activations meet gathered,
    freed and re-gathered expert buckets."""
    features = {"zero-sync + offload": ZERO_SYNC + MOE_OFFLOAD}
    argv = MOE + ["--expert-model-parallel-size", "2", *_strategy("optim_grads_params"), "--world-size", "4"]
    results = run_distributed(4, JOB, argv=argv, features=features)
    assert_same_as_off(results, features)
    for runs in results:
        run = runs["zero-sync + offload"]
        assert run["dispatchers"] == 4 and run["offloaded"] > 0 and run["reloaded"] == run["offloaded"]


def test_dense_dp2_offload_under_zero3():
    """Dense DP2, activation offload under ZeRO-3 (weights gathered and freed around every use):
    bitwise, and it offloads exactly the bytes it offloads under DDP, so no parameter bytes (views
    of the gathered buckets) are taken for activations."""
    argv = DENSE + ["--world-size", "2"]
    results = run_distributed(2, JOB, argv=argv + _strategy("optim_grads_params"),
                              features={"offload": DENSE_OFFLOAD}, ddp={"offload": DENSE_OFFLOAD})
    assert_same_as_off(results, ["offload"])
    for runs in results:
        assert runs["offload"]["offloaded"] > 0 and runs["offload"]["reloaded"] == runs["offload"]["offloaded"]
        assert runs["offload"]["offloaded"] == runs["ddp offload"]["offloaded"]


def test_torch_fsdp2_moe_dp2_offload_and_dispatchers():
    """torch FSDP2 (MoE DP2, experts replicated over EP1 and sharded by FSDP2, which gathers and
    frees every layer's weights around each use): offload, the sync-free dispatcher, zero-sync
    dropless with offload, each bitwise; the offload moves exactly the bytes it moves under DDP."""
    features = {"offload": MOE_OFFLOAD, "sync-free": SYNC_FREE, "zero-sync + offload": ZERO_SYNC + MOE_OFFLOAD}
    results = run_distributed(2, JOB, argv=MOE + ["--world-size", "2"], features=features,
                              ddp={"offload": MOE_OFFLOAD}, wrapper=["--use-torch-fsdp2"])
    assert_same_as_off(results, features)
    for runs in results:
        assert [runs[n]["dispatchers"] for n in features] == [0, 4, 4]
        for name in ("offload", "zero-sync + offload"):
            assert runs[name]["offloaded"] > 0 and runs[name]["reloaded"] == runs[name]["offloaded"]
        assert runs["offload"]["offloaded"] == runs["ddp offload"]["offloaded"]


OVERLAP = ["--overlap-tp-comm-1f1b"]


def test_dense_dp2_tp2_sp_overlap_tp_comm_1f1b_optim():
    """DP2 x TP2 + SP, --overlap-tp-comm-1f1b (no pipeline: consecutive micro-batches paired) under
    optim (one gradient reduce-scatter per step, as DDP): bitwise, the paired schedule ran every
    iteration."""
    argv = DENSE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--world-size", "4",
                    *_strategy("optim")]
    results = run_distributed(4, JOB, argv=argv, features={"overlap": OVERLAP})
    assert_same_as_off(results, ["overlap"])
    assert [(r["off"]["overlap_calls"], r["overlap"]["overlap_calls"]) for r in results] == [(0, 3)] * 4


def test_moe_tp2_ep2_sp_overlap_tp_comm_1f1b_optim_grads_with_dispatcher_and_offload():
    """MoE TP2 x EP2 + SP under optim_grads (a gradient reduce-scatter per micro-batch, issued from
    the paired backward): the overlap (handing off TP collectives and EP all-to-alls) alone, and
    with the sync-free dispatcher and activation offload on as well: bitwise."""
    features = {"overlap": OVERLAP, "overlap + sync-free + offload": OVERLAP + SYNC_FREE + MOE_OFFLOAD}
    argv = MOE + ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                  "--world-size", "4", *_strategy("optim_grads")]
    results = run_distributed(4, JOB, argv=argv, features=features)
    assert_same_as_off(results, features)
    for runs in results:
        assert [runs[n]["overlap_calls"] for n in ("off", *features)] == [0, 3, 3]
        both = runs["overlap + sync-free + offload"]
        assert both["dispatchers"] == 4 and both["offloaded"] > 0 and both["reloaded"] == both["offloaded"]


def test_overlap_tp_comm_1f1b_refused_under_zero3():
    from megatron_ext.errors import ConfigError

    fsdp = DENSE + ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--world-size", "4",
                    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--overlap-tp-comm-1f1b"]
    with pytest.raises(ConfigError, match=r"^--overlap-tp-comm-1f1b=True cannot be combined with "
                                          r"--data-parallel-sharding-strategy=optim_grads_params \(--use-megatron-fsdp\): "
                                          r".*frees a layer's bucket"):
        _parse(fsdp)  # megatron's default strategy
    assert _parse(fsdp + _strategy("optim_grads")).overlap_tp_comm_1f1b


def test_offload_never_takes_a_gathered_weight_storage():
    """A sharded wrapper points a layer's weights at a bucket it frees and re-gathers (Megatron-FSDP:
    the same storage resized, or a new one): a saved view of such a weight (here `w.t()`, saved by
    mm) is left to the wrapper, recognised by the storage the layer's weights have when its forward
    starts, not the one they had when offload was attached."""
    import torch

    from megatron_ext.offload import Options
    from megatron_ext.offload.manager import OffloadManager

    layer = torch.nn.Linear(64, 64, bias=False)
    mgr = OffloadManager(Options(modules=("qkv_linear",), pool_bytes=1 << 20, chunk_bytes=1 << 16, min_tensor_bytes=0))
    try:
        mgr._layer_params[id(layer)] = list(layer.parameters())  # what attach lists per layer
        seen = []
        for gathered in (torch.randn(64, 64), torch.randn(64 * 64).view(64, 64)):  # a new storage per gather
            layer.weight.data = gathered
            mgr._begin_group(0, layer, ())
            mgr._push(("qkv_linear", "w"))
            try:
                x = torch.randn(4, 64, requires_grad=True)
                seen.append(mgr._pack(layer.weight.t()))  # what autograd would hand the pack hook
                seen.append(mgr._pack(x * 2))  # an activation: taken
            finally:
                mgr._pop()
                mgr._group = None
        assert [isinstance(s, torch.Tensor) for s in seen] == [True, False, True, False]
    finally:
        mgr.close()
