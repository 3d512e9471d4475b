"""megatron_ext's features under Megatron-FSDP (--use-megatron-fsdp): each one against the same
Megatron-FSDP run without it (same sharding strategy, same layout, same weights and batches),
2 iterations: losses, grad norms and every rank's parameter shards after the last step bit-identical,
and the feature seen doing its work (bytes offloaded and reloaded, dispatchers replaced, paired
passes run). What cannot compose is refused by name."""
from __future__ import annotations

import pytest

from tests.dist import run_distributed
from tests.training.test_fsdp import (
    DENSE, FSDP, ITERS, MOE, MOE_LAYERS, MOE_OFFLOAD, OVERLAP, SYNC_FREE, ZERO_SYNC, _parse, assert_offloaded, assert_same_as,
)

JOB = "tests.training.jobs_fsdp_compose:compose"
# Composed with each strategy's own comparison against DDP (tests/training/test_fsdp.py, one job per
# layout): offload, the sync-free and zero-sync dispatchers under optim_grads_params (MoE EP2), offload
# under optim_grads_params (dense DP2), the overlap under optim (dense DP2 x TP2); under torch FSDP2:
# tests/training/test_fsdp2.py.


def _strategy(name: str) -> list[str]:
    return ["--data-parallel-sharding-strategy", name]


def assert_same_as_off(results: list[dict], features) -> None:
    assert_same_as(results, "off", features)


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
        assert run["dispatchers"] == MOE_LAYERS
        assert_offloaded(run)


def test_moe_tp2_ep2_sp_overlap_tp_comm_1f1b_optim_grads_with_dispatcher_and_offload():
    """MoE TP2 x EP2 + SP under optim_grads (a gradient reduce-scatter per micro-batch, issued from
    the paired backward): the overlap (handing off TP collectives and EP all-to-alls) with the
    sync-free dispatcher and activation offload on as well: bitwise."""
    features = {"overlap + sync-free + offload": OVERLAP + SYNC_FREE + MOE_OFFLOAD}
    argv = MOE + ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                  "--world-size", "4", *_strategy("optim_grads")]
    results = run_distributed(4, JOB, argv=argv, features=features)
    assert_same_as_off(results, features)
    for runs in results:
        assert [runs[n]["overlap_calls"] for n in ("off", *features)] == [0, ITERS]
        both = runs["overlap + sync-free + offload"]
        assert both["dispatchers"] == MOE_LAYERS
        assert_offloaded(both)


def test_overlap_tp_comm_1f1b_refused_under_zero3():
    from megatron_ext.errors import ConfigError

    fsdp = DENSE + FSDP + ["--world-size", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                           *OVERLAP]
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

    from megatron_ext.offload import OffloadOptions
    from megatron_ext.offload.manager import OffloadManager

    layer = torch.nn.Linear(64, 64, bias=False)
    mgr = OffloadManager(OffloadOptions(modules=["qkv_linear"], pool_mb=1.0, chunk_mb=1 / 16, min_tensor_kb=0.0))
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
