"""Job functions for the LoRA tests (run on every rank of a gloo world, see tests/dist.py)."""
from __future__ import annotations

import contextlib


def _adapter_pieces(chunks) -> list:
    """(key, global shape, global offset, prepended axes, value, gradient) of every adapter factor this
    rank holds, from the model's own checkpoint entries (global keys and offsets)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_ext.lora import adapters
    from megatron_ext.seams import offload_unwrap

    pieces = []
    for chunk in chunks:
        model = offload_unwrap(chunk)
        for sh in adapters._adapter_tensors(model.sharded_state_dict()):
            if not isinstance(sh, ShardedTensor):
                continue
            grad = getattr(sh.data, "main_grad", None)
            pieces.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), sh.prepend_axis_num,
                           sh.data.detach().float().cpu().clone(),
                           None if grad is None else grad.detach().float().cpu().clone()))
    return pieces


def _assemble(pieces_per_rank: list) -> tuple[dict, dict]:
    """The full (global) adapter factors and their gradients from every rank's pieces."""
    import torch

    values, grads = {}, {}
    for pieces in pieces_per_rank:
        for key, shape, offset, prepend, value, grad in pieces:
            for out, t in ((values, value), (grads, grad)):
                if t is None:
                    continue
                full = out.setdefault(key, torch.full(shape, float("nan")))
                index = tuple(slice(o, o + (1 if axis < prepend else t.shape[axis - prepend]))
                              for axis, o in enumerate(offset))
                full[index] = t.reshape(full[index].shape)
    return values, grads


@contextlib.contextmanager
def _collected(into: dict):
    """Around train.main: the built chunks, and (just before the run's process groups go) every
    rank's adapter factors and gradients assembled into ``into``."""
    import torch

    from megatron_ext.training import model as models
    from megatron_ext.training import parallel

    built, build, destroy = [], models.build_model, parallel.destroy

    def keep(*a, **k):
        chunks = build(*a, **k)
        built.extend(chunks)
        return chunks

    def collect_then_destroy():
        try:
            if built:
                gathered = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(gathered, _adapter_pieces(built))
                into["values"], into["grads"] = _assemble(gathered)
        finally:
            built.clear()
            destroy()

    models.build_model, parallel.destroy = keep, collect_then_destroy
    try:
        yield built
    finally:
        models.build_model, parallel.destroy = build, destroy


def _numpy(tensors: dict) -> dict:
    """Tensors go back to the test process as numpy arrays: a pickled torch tensor is shared through a
    file descriptor, whose server thread would outlive the job (tests/dist.py's leak check)."""
    return {k: v.numpy() for k, v in tensors.items()}


def train_adapters(argv: list[str]) -> dict:
    """train.main; its log history, and the full adapter factors and last gradients (every rank), as
    numpy arrays."""
    import train

    out: dict = {}
    if "--use-megatron-fsdp" in argv:  # its parameters are DTensor shards: the losses say it
        return dict(history=train.main(list(argv)), values={}, grads={})
    with _collected(out):
        history = train.main(list(argv))
    return dict(history=history, values=_numpy(out.get("values", {})), grads=_numpy(out.get("grads", {})))


def train_adapters_many(argvs: dict) -> dict:
    """train_adapters for several runs in one job: {name: result}."""
    return {name: train_adapters(list(argv)) for name, argv in argvs.items()}
