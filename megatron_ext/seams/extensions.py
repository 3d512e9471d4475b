"""The C++ extension megatron-core compiles on first use (torch.utils.cpp_extension.load_inline), built
ahead of any run: ``make install`` calls :func:`build`, so that no run, test or rank waits for the
compiler (about 45 s of CPU here; the rank beside it waits on the build's lock). torch keeps the
build in this Python environment's own folder (platform.extensions_dir, set by platform.setup), so a
second checkout's build does not replace it. The platform is set up by the caller, before this package
(which imports megatron-core) is imported."""
from __future__ import annotations


def build() -> list[str]:
    # megatron/core/tensor_parallel/random.py:69: share_storage, which hands an output recomputed in
    # the backward (CheckpointWithoutOutput: --recompute-modules' output-discarding modules) to the
    # tensors that kept its storage
    from megatron.core.tensor_parallel import random

    random._get_share_storage()
    return ["share_storage_ext"]
