"""The order of forward and backward passes on one pipeline rank, from megatron's own schedule
functions (forward_backward_pipelining_without_interleaving / _with_interleaving), run without a
model on the stand-ins of ``megatron_ext.measure.p2p_programs`` (a process group that only knows its
size and rank, passes that return placeholders, point-to-point calls recorded instead of sent).
Which micro-batches are in flight at any moment follows from that order: nothing here restates the
schedule's warm-up arithmetic."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=256)
def passes(pp: int, vpp: int | None, num_microbatches: int, rank: int) -> tuple:
    """(("F" | "B", micro-batch, model chunk, boundary tensors held by the pipeline), ...) in the
    order rank ``rank`` runs them; the last field counts receive buffers posted and not yet consumed
    by a pass and sent tensors whose send was not yet waited for."""
    if pp == 1:  # no pipelining: megatron runs each micro-batch's forward then its backward
        return tuple(e for m in range(num_microbatches) for e in (("F", m, 0, 0), ("B", m, 0, 0)))
    import torch
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron_ext.measure import p2p_programs as pg

    interleaved = bool(vpp) and vpp > 1
    events: list = []

    class Recorder(pg._Recorder):
        posted: set = set()  # receive buffers posted, not yet consumed by a pass

        sends: set = set()   # sends posted, not yet waited for (the sent tensor is held until then)

        def op(self, kind, tensor, peer, group):
            if kind == "recv":
                self.posted.add(id(tensor))
            req = super().op(kind, tensor, peer, group)
            if kind == "send":
                self.sends.add(req.index)
                wait = req.wait

                def waited(index=req.index):
                    self.sends.discard(index)
                    return wait()

                req.wait = waited
            return req

        def held(self) -> int:
            return len(self.posted) + len(self.sends)

        def consumed(self, tensor, label):
            tensor = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
            if tensor is not None:
                self.posted.discard(id(tensor))
            return super().consumed(tensor, label)

        def forward_step(self, *args, current_microbatch=None, vp_stage=None, **kwargs):
            out = super().forward_step(*args, current_microbatch=current_microbatch, vp_stage=vp_stage, **kwargs)
            events.append(("F", current_microbatch, vp_stage or 0, self.held()))
            return out

        def backward_step(self, input_tensor, output_tensor, output_tensor_grad, config):
            out = output_tensor[0] if isinstance(output_tensor, (list, tuple)) else output_tensor
            mb, chunk = self.made_by[id(out)]
            grad = super().backward_step(input_tensor, output_tensor, output_tensor_grad, config)
            events.append(("B", mb, chunk, self.held()))
            return grad

    config = ModelParallelConfig(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if interleaved else None,
        pipeline_dtype=torch.float32, overlap_p2p_comm=interleaved, batch_p2p_comm=not interleaved,
    )
    pg.run_schedule(Recorder(pp, rank, vpp or 1), config, pp, rank, vpp or 1, num_microbatches)
    return tuple(events)


def max_in_flight(pp: int, vpp: int | None, num_microbatches: int, rank: int) -> int:
    """Most (micro-batch, chunk) passes whose activations are alive at once."""
    alive = best = 0
    for kind, _m, _c, _r in passes(pp, vpp, num_microbatches, rank):
        alive += 1 if kind == "F" else 0
        best = max(best, alive)
        alive -= 1 if kind == "B" else 0
    return best
