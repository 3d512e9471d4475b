"""The forked --async-save writer's results reach the training process whatever their size."""
from __future__ import annotations

import multiprocessing as mp

from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_ext import seams

PAST_A_PIPE = 1 << 20  # a pipe holds 64 KiB; an fsdp_dtensor save's write results are larger


def _writer(results: bytes) -> None:
    filesystem_async._results_queue.put(results)  # as write_preloaded_data does (filesystem_async.py:357)


def test_a_forked_writer_with_large_results_exits_and_hands_them_over(tmp_path):
    seams.set_write_results_queue(True, str(tmp_path), rank=0)
    results = bytes(range(256)) * (PAST_A_PIPE // 256)
    writer = mp.get_context("fork").Process(target=_writer, args=(results,))
    writer.start()
    writer.join(timeout=10)  # megatron-core waits for the writer to exit before it reads the results
    exited = not writer.is_alive()
    if not exited:
        writer.kill()
    assert exited, "the writer could not exit before its results were read"
    assert filesystem_async._results_queue.get_nowait() == results
    assert list(tmp_path.iterdir()) == []  # taken, not left for the checkpoint's manifest
