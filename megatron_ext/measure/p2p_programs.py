"""The pipeline messages of megatron's plain schedules, as p2p-checker programs, without processes.

`megatron_program(pp, vpp, m, rank)` runs megatron's own schedule function for one pipeline rank
(forward_backward_pipelining_without_interleaving, or _with_interleaving for vpp > 1) with its own
P2PCommunicator, on stand-ins: a process group that only knows its size and rank, forward/backward
passes that return placeholder tensors (megatron_ext/seams/schedules.py, plain_schedule_steps), and
torch.distributed's point-to-point calls replaced by a recorder while it runs. Every isend / irecv
(and batch_isend_irecv group) megatron issues, and every wait() on their requests, becomes a
p2p.Op / p2p.Wait in issue order. Each message is labelled with the pass that consumes it
(("act", mb, chunk) / ("grad", mb, chunk) on the receiver), so the checker also sees a message
delivered to the wrong pass.
"""
from __future__ import annotations

import contextlib

import torch

from megatron_ext.schedules.p2p import Op, Wait


class _Group:
    def __init__(self, name: str, size: int, rank: int):
        self.name, self._size, self._rank = name, size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _Request:
    def __init__(self, recorder, index: int):
        self.recorder, self.index = recorder, index

    def wait(self) -> bool:
        self.recorder.items.append(("wait", self.index))
        return True

    def is_completed(self) -> bool:
        return True


class _P2POp:
    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


class _Recorder:
    def __init__(self, pp: int, rank: int, chunks: int):
        self.pp, self.rank, self.chunks = pp, rank, chunks
        self.items: list = []          # op dicts and ("wait", op index)
        self.send_label: dict = {}     # id(tensor) -> label of the message it carries
        self.recv_index: dict = {}     # id(tensor) -> index of the recv that fills it
        self.made_by: dict = {}        # id(output tensor) -> (mb, chunk) of its forward
        self.keep: list = []           # every tensor seen stays alive: ids stay unique
        self.batch = None
        self.batches = 0

    def op(self, kind: str, tensor, peer: int, group):
        self.items.append({"kind": kind, "peer": peer,
                           "comm": "WORLD" if group is None else group.name,
                           "label": self.send_label.get(id(tensor)) if kind == "send" else None,
                           "group": self.batch})
        if kind == "recv":
            self.recv_index[id(tensor)] = len(self.items) - 1
        self.keep.append(tensor)
        return _Request(self, len(self.items) - 1)

    def consumed(self, tensor, label) -> None:
        tensor = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
        if tensor is not None and id(tensor) in self.recv_index:
            self.items[self.recv_index[id(tensor)]]["label"] = label

    def forward_step(self, forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                     forward_data_store, config, cp_group_size=1, collect_non_loss_data=False,
                     checkpoint_activations_microbatch=None, is_first_microbatch=False,
                     current_microbatch=None, vp_stage=None, is_last_stage=True):
        chunk = vp_stage or 0
        self.consumed(input_tensor, ("act", current_microbatch, chunk))
        out = torch.zeros(1)
        self.keep.append(out)
        last = self.rank == self.pp - 1
        self.send_label[id(out)] = ("act", current_microbatch, chunk + 1 if last else chunk)
        self.made_by[id(out)] = (current_microbatch, chunk)
        return out, torch.tensor(1)

    def backward_step(self, input_tensor, output_tensor, output_tensor_grad, config):
        out = output_tensor[0] if isinstance(output_tensor, (list, tuple)) else output_tensor
        mb, chunk = self.made_by[id(out)]
        self.consumed(output_tensor_grad, ("grad", mb, chunk))
        x = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor
        if x is None:
            return None
        grad = torch.zeros(1)
        self.keep.append(grad)
        self.send_label[id(grad)] = ("grad", mb, chunk - 1 if self.rank == 0 else chunk)
        return [grad] if isinstance(input_tensor, list) else grad

    def program(self) -> list:
        prog, index = [], {}
        for i, item in enumerate(self.items):
            if isinstance(item, tuple):
                prog.append(Wait(index[item[1]]))
            else:
                index[i] = len(prog)
                prog.append(Op(item["kind"], item["peer"], item["comm"], item["label"], item["group"]))
        return prog


@contextlib.contextmanager
def _recording(rec: _Recorder):
    """torch.distributed's p2p calls -> the recorder; a single pipeline whose ranks are 0..pp-1."""
    import torch.distributed as dist

    from megatron_ext.seams.schedules import plain_schedule_steps

    names = ("is_initialized", "get_global_rank", "get_backend", "isend", "irecv",
             "batch_isend_irecv", "P2POp")
    saved = {n: getattr(dist, n) for n in names}

    def isend(tensor, dst=None, group=None, tag=0, **_):
        return rec.op("send", tensor, dst, group)

    def irecv(tensor, src=None, group=None, tag=0, **_):
        return rec.op("recv", tensor, src, group)

    def batch_isend_irecv(ops):
        rec.batches += 1
        rec.batch = rec.batches
        try:
            return [o.op(o.tensor, o.peer, o.group) for o in ops]
        finally:
            rec.batch = None

    dist.is_initialized = lambda: True  # megatron's get_pg_rank/size read the group only then
    dist.get_global_rank = lambda group, rank: rank
    dist.get_backend = lambda group=None: "nccl"
    dist.isend, dist.irecv, dist.batch_isend_irecv, dist.P2POp = isend, irecv, batch_isend_irecv, _P2POp
    try:
        with plain_schedule_steps(rec.forward_step, rec.backward_step):
            yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class _Chunk(torch.nn.Module):
    def __init__(self, config):
        from megatron.core.enums import ModelType

        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder


def megatron_program(pp: int, vpp: int, num_microbatches: int, rank: int,
                     overlap_p2p_comm=None, batch_p2p_comm=None) -> list:
    """Pipeline rank `rank`'s messages under megatron's plain schedule. p2p options default to
    what megatron's arguments choose: overlap_p2p_comm with virtual stages (else off), and
    batch_p2p_comm = not overlap_p2p_comm. Raises what megatron raises for a combination it
    refuses."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    interleaved = vpp > 1
    overlap_p2p_comm = interleaved if overlap_p2p_comm is None else overlap_p2p_comm
    batch_p2p_comm = (not overlap_p2p_comm) if batch_p2p_comm is None else batch_p2p_comm
    config = ModelParallelConfig(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if interleaved else None,
        pipeline_dtype=torch.float32, overlap_p2p_comm=overlap_p2p_comm,
        batch_p2p_comm=batch_p2p_comm,
    )
    rec = _Recorder(pp, rank, vpp)
    run_schedule(rec, config, pp, rank, vpp, num_microbatches)
    return rec.program()


def run_schedule(rec, config, pp: int, rank: int, vpp: int, num_microbatches: int) -> None:
    """Run megatron's plain schedule (interleaved when vpp > 1) for pipeline rank ``rank`` on the
    stand-ins, every point-to-point call going to the recorder ``rec``."""
    from megatron.core.pipeline_parallel import schedules as S
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection

    config.hidden_size = 1  # read by the schedules for the message shape (a TransformerConfig field)
    with _recording(rec):
        communicator = P2PCommunicator(_Group("pp", pp, rank), config)
        groups = ProcessGroupCollection()
        groups.tp, groups.cp = _Group("tp", 1, 0), _Group("cp", 1, 0)
        chunks = [_Chunk(config) for _ in range(vpp)]
        if vpp > 1:
            S.forward_backward_pipelining_with_interleaving(
                forward_step_func=None, data_iterator=[None] * vpp, model=chunks,
                num_microbatches=num_microbatches, seq_length=1, micro_batch_size=1,
                p2p_communicator=communicator, pg_collection=groups)
        else:
            S.forward_backward_pipelining_without_interleaving(
                forward_step_func=None, data_iterator=None, model=chunks[0],
                num_microbatches=num_microbatches, seq_length=1, micro_batch_size=1,
                p2p_communicator=communicator, pg_collection=groups)
