"""CPU shims for megatron-core's reliance on CUDA-only kernel packages: the Triton paged-stash
kernels its MoE code imports unguarded, torch.compile behind its jit_fuser, and apex/transformer-engine
norms under sequence parallelism. Each install returns its own undo (cpu_shims/__init__.py: the records)."""
from __future__ import annotations

import functools
import sys
import types

import torch

from megatron_ext.patching import set_attr as _patch


# --------------------------------------------------------------------------------------------
# triton: megatron/core/transformer/moe/ops/paged_stash.py:4 imports triton unguarded, and
# gpt_model.py:32 / schedules.py:27 / experts.py:43 reach it through moe/paged_stash.py:12.
# A fake top-level `triton` breaks torch._inductor, so stand in for that one module only.
# --------------------------------------------------------------------------------------------
_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


def install_triton_free_paged_stash():
    if _PAGED_STASH_OPS in sys.modules:
        return lambda: None
    module = types.ModuleType(_PAGED_STASH_OPS)
    module.__doc__ = "CPU stand-in: the Triton paged-stash kernels exist only on CUDA."
    module.GLOBAL_BLOCK_SIZE = 1024

    def _no_kernel(*_a, **_k):
        raise RuntimeError("paged stash Triton kernels need CUDA (megatron-core moe/ops/paged_stash.py)")

    module.paged_stash_copy_kernel = _no_kernel
    module.paged_stash_pop_kernel = _no_kernel
    sys.modules[_PAGED_STASH_OPS] = module

    def undo():
        if sys.modules.get(_PAGED_STASH_OPS) is module:
            del sys.modules[_PAGED_STASH_OPS]

    return undo


# --------------------------------------------------------------------------------------------
# megatron/core/transformer/torch_norm.py:50 asserts `not config.sequence_parallel` when
# neither apex nor TE exists, which blocks TP+SP and TP+MoE on the local spec. torch's norm is
# correct under SP if its weights are marked `sequence_parallel`, so DDP/finalize_model_grads
# all-reduce their grads over the TP group (megatron/core/distributed/finalize_model_grads.py).
# --------------------------------------------------------------------------------------------
def install_torch_norm_sequence_parallel():
    # Up a floor, on purpose: the patch is needed on CUDA too, so the record is a seam
    # (megatron_ext/seams/training.py, which training/model.py applies on CUDA); on CPU it is always
    # on, like every shim here. One record for both: removing the shim removes the seam.
    from megatron_ext.seams.training import TORCH_NORM_SEQUENCE_PARALLEL as seam

    seam.apply()
    return seam.remove


# --------------------------------------------------------------------------------------------
# megatron/core/jit.py:21 makes `jit_fuser = torch.compile` (bias_swiglu, bias_gelu, rotary, MoE
# permute helpers, ...). On CPU each process then spends ~18 s compiling for a tiny model. Run
# those functions eagerly instead: the same math, without the compile. torch.compile hands back a
# function that runs the one it was given (and compiles it, on its first call, only once the shim is
# removed): nothing of dynamo or inductor is imported for it, ~3 s of every process's start on CPU.
# A function compiled before the shim (dynamo already imported) runs eagerly through dynamo's
# `disable` and the force_eager stance, which, unlike a per-thread override, covers the autograd
# device thread where a recomputed router or activation runs in the backward.
# --------------------------------------------------------------------------------------------
_EAGER = [False]  # the shim is on: what torch.compile handed out runs eagerly


def _eager_compile(real_compile):
    def compile(model=None, **options):  # noqa: A001 - torch.compile's own name and signature
        if model is None:  # @torch.compile(mode=...) and the like
            return lambda fn: compile(fn, **options)
        if isinstance(model, torch.nn.Module):
            return model  # run as it is: the module itself, eager
        compiled = []

        @functools.wraps(model)
        def run(*args, **kwargs):
            if _EAGER[0]:
                return model(*args, **kwargs)
            if not compiled:
                compiled.append(real_compile(model, **options))
            return compiled[0](*args, **kwargs)

        return run

    return compile


def install_eager_jit_fuser():
    real_compile = torch.compile
    undo = [_patch(torch, "compile", _eager_compile(real_compile))]
    _EAGER[0] = True
    if "torch._dynamo" in sys.modules:
        from torch._dynamo import eval_frame

        undo.append(_patch(sys.modules["torch._dynamo"].config, "disable", True))
        before = eval_frame._stance
        torch.compiler.set_stance("force_eager")
        undo.append(lambda: torch.compiler.set_stance(
            before.stance, skip_guard_eval_unsafe=before.skip_guard_eval_unsafe, force_backend=before.backend))

    def remove():
        _EAGER[0] = False
        for u in reversed(undo):
            u()

    return remove
