"""Each CPU shim is needed: remove it and the megatron-core call site it names fails; keep it and
the site works. (The shims are CPU-only: on a CUDA machine this whole module is skipped.)"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from megatron_ext.platform import cpu_shims
from tests.dist import run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims are applied only without CUDA")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_shim_names_its_upstream_site_and_is_active():
    for shim in cpu_shims.SHIMS.values():
        assert shim.active, shim.name
        assert shim.upstream and all(":" in site and site.startswith(("megatron/", "torch/")) for site in shim.upstream)


def test_triton_free_paged_stash():
    # an import-time shim: probe in a fresh interpreter with every shim but this one
    code = (
        "from megatron_ext.platform import cpu_shims\n"
        "for s in cpu_shims.SHIMS.values():\n"
        "    s.name != 'triton_free_paged_stash' and s.apply()\n"
        "import megatron.core.models.gpt\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    without = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert without.returncode != 0 and "triton" in without.stderr
    import megatron.core.models.gpt  # noqa: F401 - with the shim (this process) the import works


def test_cpu_rng():
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("probe", 1234)
    with tracker.fork("probe"):
        a = torch.rand(3)
    with tracker.fork("probe"):
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the tracker's stream advanced, as it does on CUDA
    with cpu_shims.without("cpu_rng"), pytest.raises((RuntimeError, AssertionError)):
        mrandom.CudaRNGStatesTracker().add("probe2", 1)


def test_cuda_device_to_cpu():
    from megatron.core.transformer.utils import get_default_causal_mask
    from megatron.core.utils import GlobalMemoryBuffer

    assert get_default_causal_mask(4).device.type == "cpu"  # transformer/utils.py:39
    assert GlobalMemoryBuffer().get_tensor([2, 3], torch.float32, "probe").device.type == "cpu"  # utils.py:712
    get_default_causal_mask.cache_clear() if hasattr(get_default_causal_mask, "cache_clear") else None
    with cpu_shims.without("cuda_device_to_cpu"), pytest.raises((RuntimeError, AssertionError)):
        GlobalMemoryBuffer().get_tensor([2, 3], torch.float32, "probe")


def test_cuda_device_to_cpu_yarn_rope():
    """Multi-latent attention's yarn rope builds its tables under `with torch.device(cuda)`
    (yarn_rotary_pos_embedding.py:78) and moves them with .to(device=current_device()) (:122)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    def build():
        return YarnRotaryEmbedding(24, rotary_base=10000, scaling_factor=40.0, original_max_position_embeddings=16,
                                   use_cpu_initialization=False)

    rope = build()
    assert rope.inv_freq.device.type == "cpu" and rope(8)[0].device.type == "cpu"
    with cpu_shims.without("cuda_device_to_cpu"), pytest.raises(RuntimeError):
        build()


def test_cuda_only_tensor_methods():
    x = torch.ones(4)
    x.record_stream(torch.cuda.current_stream())  # fine_grained_callables.py:243
    assert x.pin_memory() is x
    with cpu_shims.without("cuda_only_tensor_methods"), pytest.raises(RuntimeError):
        torch.ones(4).pin_memory()


def test_cuda_tensor_type_names():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)  # clip_grads.py:174
    assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5)
    with cpu_shims.without("cuda_tensor_type_names"), pytest.raises(AssertionError):
        clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)


def test_cuda_runtime_stand_ins():
    stream = torch.cuda.Stream()  # token_dispatcher.py:469
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()  # p2p_communication.py:419
    with cpu_shims.without("cuda_runtime_stand_ins"), pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.synchronize()


def test_torch_norm_sequence_parallel():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, sequence_parallel=True,
        tensor_model_parallel_size=2, normalization="RMSNorm", persist_layer_norm=False,
    )
    norm = WrappedTorchNorm(config, 8)
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())  # grads all-reduced over TP
    with cpu_shims.without("torch_norm_sequence_parallel"), pytest.raises(AssertionError):
        WrappedTorchNorm(config, 8)


def test_eager_jit_fuser():
    import torch._dynamo as dynamo
    from megatron.core.fusions.fused_bias_swiglu import swiglu
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    worker = threading.Thread(target=swiglu, args=(torch.randn(6, 8),))  # a backward on the autograd device thread
    worker.start()
    worker.join()
    assert counters["stats"]["unique_graphs"] == before  # ran eagerly there
    swiglu(torch.randn(4, 8))
    assert counters["stats"]["unique_graphs"] == before  # and here
    # without the shim dynamo captures it (jit.py:21); the captured graph runs on dynamo's eager backend, not
    # inductor, whose C++ build of the kernel costs ~15 s of CPU on a machine without its cache
    with cpu_shims.without("eager_jit_fuser"), torch.compiler.set_stance("default", force_backend="eager"):
        dynamo.reset()
        swiglu(torch.randn(5, 8))
        assert counters["stats"]["unique_graphs"] > before


def test_no_device_arch():
    import arguments
    from megatron_ext.errors import ConfigError

    argv = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data", "--tensor-model-parallel-size", "2",
            "--world-size", "2", "--dry-run"]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert arguments.parse(argv, exit_on_dry_run=False).tensor_model_parallel_size == 2
        with cpu_shims.without("no_device_arch"), pytest.raises(ConfigError):
            arguments.parse(argv, exit_on_dry_run=False)
    finally:
        os.chdir(cwd)


def test_uneven_collectives():
    with_shim = run_distributed(2, "tests.platform.jobs:uneven_gather", without_shim=False)
    assert with_shim[0] == [[1.0] * 3, [2.0] * 3, [2.0] * 3] == with_shim[1]
    without = run_distributed(2, "tests.platform.jobs:uneven_gather", without_shim=True)
    assert all(isinstance(r, str) and r.startswith("error") for r in without)


def test_host_split_sizes():
    with_shim = run_distributed(2, "tests.platform.jobs:host_split_sizes", without_shim=False)
    assert with_shim[0] == [[0.0, 0.0], [1.0, 1.0]] and with_shim[1] == [[0.0, 0.0], [1.0, 1.0]]
    without = run_distributed(2, "tests.platform.jobs:host_split_sizes", without_shim=True)
    assert all(isinstance(r, str) and r.startswith("error") for r in without)


def test_backward_runs_with_the_device_rewrite_active():
    """Megatron's autograd Functions allocate on 'cuda' inside backward (mappings.py:145); the mode
    must be active there, and Tensor.backward / torch.autograd.backward must not recurse into it."""

    class AllocatesOnCuda(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, grad):
            return grad + torch.ones(grad.shape, device=torch.cuda.current_device())

    x = torch.ones(3, requires_grad=True)
    AllocatesOnCuda.apply(x).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]
    y = torch.ones(3, requires_grad=True)
    torch.autograd.backward(AllocatesOnCuda.apply(y), grad_tensors=torch.full((3,), 2.0))
    assert y.grad.tolist() == [3.0, 3.0, 3.0]


def test_fsdp_premul_sum_as_scale():
    """Megatron-FSDP's averaged gradient reduce-scatter: PREMUL_SUM(1/world) on NCCL, scale then SUM
    here; either way each element is the mean over ranks, bit for bit."""
    with_shim = run_distributed(2, "tests.platform.jobs_fsdp:premul_reduce_scatter", without_shim=False)
    expected = [(torch.arange(8.0) * 0.5 + (torch.arange(8.0) + 10) * 0.5)[4 * r:4 * r + 4].tolist() for r in (0, 1)]
    assert with_shim == expected
    without = run_distributed(2, "tests.platform.jobs_fsdp:premul_reduce_scatter", without_shim=True)
    assert all(isinstance(r, str) and "PREMUL_SUM" in r for r in without), without


def test_gloo_all_gathers_one_by_one():
    """Megatron-FSDP's coalesced parameter all-gathers reach gloo as one all_gather_single each (its
    coalesced all-gather corrupts the heap once the buckets' storages are resized:
    scripts/gloo_coalesced_crash.py, docs/reliability.md), waited for through the manager as before,
    with the same results bit for bit; other coalesced ops still go through torch's manager."""
    with_shim = run_distributed(2, "tests.platform.jobs_fsdp:coalesced_all_gathers", without_shim=False)
    without = run_distributed(2, "tests.platform.jobs_fsdp:coalesced_all_gathers", without_shim=True)
    for rank in (0, 1):
        w, wo = with_shim[rank], without[rank]
        assert w["calls"] == ["all_gather_single", "all_gather_single", "reduce_scatter_single_coalesced"], w
        assert wo["calls"] == ["all_gather_single_coalesced", "reduce_scatter_single_coalesced"], wo
        assert w["waits"] == 2 and wo["waits"] == 1
        assert w["outs"] == wo["outs"] == [[1.0] * 4 + [2.0] * 4, [3.0, 4.0]]
        assert w["shard"] == wo["shard"] == [2.0 * i + 1 + 8 * rank for i in range(4)]
