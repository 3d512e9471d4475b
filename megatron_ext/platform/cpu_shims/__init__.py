"""CPU-only compatibility shims for megatron-core 0.19.2: the one place they live.

Applied by :func:`megatron_ext.platform.setup` only when CUDA is absent; never on a GPU machine.
Each :class:`Shim` names the upstream call sites it covers (file:line in the installed wheel) and is
reversible (the record type of megatron_ext/patching.py, shared with the seams), so
``tests/platform/test_cpu_shims.py`` can remove one at a time and prove it is needed.
The installed package is never edited.

This module holds the records (SHIMS); what each installs, beside the upstream code it answers:

    kernels.py          CUDA-only kernel packages: Triton's paged stash, torch.compile, apex/TE norms
    cuda_runtime.py     the CUDA runtime: its generator, streams, events, device queries
    device_redirect.py  device='cuda' and CUDA-only tensor methods, through one TorchFunctionMode
    gloo.py             what NCCL does and gloo does not: uneven and coalesced collectives, PREMUL_SUM
"""
from __future__ import annotations

from typing import Dict

from megatron_ext.patching import Patch as Shim
from megatron_ext.platform.cpu_shims import cuda_runtime, device_redirect, gloo, kernels


SHIMS: Dict[str, Shim] = {
    s.name: s
    for s in [
        Shim(
            "triton_free_paged_stash",
            ["megatron/core/transformer/moe/ops/paged_stash.py:4"],
            "unguarded `import triton` reached by importing GPTModel and the schedules",
            kernels.install_triton_free_paged_stash,
        ),
        # before any record that imports megatron-core: its jit_fuser takes torch.compile as it is then
        Shim(
            "eager_jit_fuser",
            ["megatron/core/jit.py:21"],
            "jit_fuser = torch.compile costs ~18 s of compilation per process on CPU",
            kernels.install_eager_jit_fuser,
        ),
        Shim(
            "cpu_rng",
            [
                "megatron/core/tensor_parallel/random.py:118",
                "megatron/core/tensor_parallel/random.py:165",
                "megatron/core/tensor_parallel/random.py:305",
                "megatron/core/tensor_parallel/random.py:490",
            ],
            "the model-parallel RNG tracker reads and writes the CUDA generator",
            cuda_runtime.install_cpu_rng,
        ),
        Shim(
            "cuda_device_to_cpu",
            [
                "megatron/core/utils.py:712",
                "megatron/core/transformer/utils.py:39",
                "megatron/core/pipeline_parallel/schedules.py:749",
                "megatron/core/pipeline_parallel/p2p_communication.py:339",
                "megatron/core/distributed/param_and_grad_buffer.py:1183",
                "megatron/core/optimizer/clip_grads.py:108",
                "megatron/core/optimizer/optimizer.py:315",
                "megatron/core/tensor_parallel/mappings.py:145",
                "megatron/core/transformer/moe/router.py:98",
                "megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py:78",
                "megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py:122",
            ],
            "device='cuda' / torch.cuda.current_device() hard-coded in factory calls and .to()",
            device_redirect.mode_rule("device"),
        ),
        Shim(
            "cuda_only_tensor_methods",
            [
                "megatron/core/pipeline_parallel/utils.py:269",
                "megatron/core/models/gpt/fine_grained_callables.py:243",
            ],
            "Tensor.record_stream / pin_memory have no CPU meaning",
            device_redirect.mode_rule("cuda_only_methods"),
        ),
        Shim(
            "cuda_tensor_type_names",
            [
                "megatron/core/optimizer/clip_grads.py:174",
                "megatron/core/optimizer/distrib_optimizer.py:401",
                "megatron/core/optimizer/distrib_optimizer.py:466",
                "megatron/core/optimizer/distrib_optimizer.py:758",
                "megatron/core/optimizer/optimizer.py:1009",
            ],
            "params are accepted only if Tensor.type() == 'torch.cuda.FloatTensor' (or Half/BFloat16)",
            device_redirect.mode_rule("tensor_type_names"),
        ),
        Shim(
            "cuda_runtime_stand_ins",
            [
                "megatron/core/distributed/param_and_grad_buffer.py:632",
                "megatron/core/pipeline_parallel/p2p_communication.py:419",
                "megatron/core/transformer/moe/token_dispatcher.py:469",
                "megatron/core/transformer/moe/token_dispatcher.py:922",
                "megatron/core/pipeline_parallel/utils.py:392",
            ],
            "streams, events, synchronize and current_device are CUDA runtime calls",
            cuda_runtime.install_cuda_runtime_stand_ins,
        ),
        Shim(
            "host_split_sizes",
            ["megatron/core/transformer/moe/moe_utils.py:1184", "megatron/core/transformer/moe/token_dispatcher.py:927"],
            "alltoall split sizes stay tensors on CPU; megatron's all_to_all and gloo want host sizes",
            gloo.install_host_split_sizes,
        ),
        Shim(
            "uneven_collectives",
            ["megatron/core/tensor_parallel/mappings.py:154", "megatron/core/tensor_parallel/mappings.py:197"],
            "gloo rejects uneven all_gather / reduce_scatter (TP x EP with the alltoall dispatcher)",
            gloo.install_uneven_collectives,
        ),
        Shim(
            "torch_norm_sequence_parallel",
            ["megatron/core/transformer/torch_norm.py:50"],
            "torch LayerNorm refused under sequence parallel without apex/TE (blocks TP+MoE)",
            kernels.install_torch_norm_sequence_parallel,
        ),
        Shim(
            "no_device_arch",
            [
                "megatron/training/arguments.py:1414",
                "megatron/training/arguments.py:1437",
                "megatron/training/utils/common_utils.py:504",
            ],
            "validate_args reads the GPU compute capability when TP or CP > 1",
            cuda_runtime.install_no_device_arch,
        ),
        Shim(
            "gloo_all_gathers_one_by_one",
            ["torch/distributed/distributed_c10d.py:2837",
             "megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:4561",
             "megatron/core/distributed/param_and_grad_buffer.py:15"],
            "gloo's coalesced all-gather corrupts the heap once its outputs' storages are resized "
            "(Megatron-FSDP's buckets): the block's all-gathers are issued one by one",
            gloo.install_gloo_all_gathers_one_by_one,
        ),
        Shim(
            "fsdp_premul_sum_as_scale",
            ["megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:4748"],
            "Megatron-FSDP reduce-scatters gradients with NCCL's PREMUL_SUM, which gloo lacks",
            gloo.install_fsdp_premul_sum_as_scale,
        ),
    ]
}


# --------------------------------------------------------------------------------------------
# The CUDA-faithful CPU mode (megatron_ext/platform/faithful.py): installed with the other
# shims, active only while the mode is on. The backward on the autograd device thread
# (autograd_thread.py) and NCCL's point-to-point rules (nccl_p2p.py).
# --------------------------------------------------------------------------------------------
def _register_faithful_mode() -> None:
    from megatron_ext.platform import autograd_thread, nccl_p2p

    for shim in (
        Shim(
            "faithful_autograd_device_thread",
            [
                "megatron/core/pipeline_parallel/schedules.py:220",
                "megatron/core/pipeline_parallel/schedules.py:574",
                "megatron/core/tensor_parallel/random.py:656",
            ],
            "on CUDA every backward (and the recompute inside it) runs on the autograd engine's "
            "device thread, not the caller's; CPU autograd runs it on the caller's",
            autograd_thread.install,
        ),
        Shim(
            "faithful_nccl_p2p",
            [
                "megatron/core/pipeline_parallel/p2p_communication.py:79",
                "megatron/core/pipeline_parallel/p2p_communication.py:48",
            ],
            "NCCL runs a communicator's sends/recvs in issue order and a send completes only with "
            "the peer's recv; gloo matches each (source, tag) on its own",
            nccl_p2p.install,
        ),
    ):
        SHIMS[shim.name] = shim


_register_faithful_mode()


def apply_all() -> None:
    for shim in SHIMS.values():
        shim.apply()


def without(name: str):
    """Temporarily remove one shim (tests prove each one is needed)."""
    return SHIMS[name].without()
