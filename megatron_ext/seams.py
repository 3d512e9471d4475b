"""Every place megatron_ext replaces or wraps a megatron-core internal.

One section per capability; each entry names the upstream site (file:line in megatron-core 0.19.2).
CPU-only compatibility shims are not here: they live in ``megatron_ext/platform/cpu_shims.py``.
"""
from __future__ import annotations


# ---------------------------------------------------------------------------------------------
# substrate (training/)
# ---------------------------------------------------------------------------------------------
def reset_megatron_globals() -> None:
    """Process-wide state megatron-core keeps between runs, cleared so a persistent worker can run
    another layout: the global memory buffer (megatron/core/utils.py:_GLOBAL_MEMORY_BUFFER, via
    parallel_state.destroy_global_memory_buffer) and the microbatch calculator
    (megatron/core/num_microbatches_calculator.py:_GLOBAL_NUM_MICROBATCHES_CALCULATOR)."""
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core import parallel_state

    parallel_state.destroy_global_memory_buffer()
    nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
