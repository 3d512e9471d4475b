"""Seams of the 1F1B backward-forward overlap that hides tensor-parallel communication.

Every TP collective megatron-core's local layers issue (and every collective of context-parallel
attention) is routed through
megatron_ext.schedules.lanes.collective() (bound here by the lanes themselves: bind_lanes), which
(only while one of our schedules runs, or a benchmark records) issues it async and hands the baton to
the other micro-batch's lane before waiting. Outside those, each wrapper is a pass-through to the original. Wrapped:
  torch.distributed.all_reduce, reached from
    megatron/core/tensor_parallel/mappings.py:35    _reduce (row-parallel fwd, column-parallel bwd)
    megatron/core/tensor_parallel/layers.py:639     async dgrad all-reduce (kept async: megatron
                                                    still overlaps it with the wgrad GEMM)
    megatron/core/tensor_parallel/layers.py:441     frozen-weight dgrad all-reduce
    megatron/core/tensor_parallel/cross_entropy.py:130,146,150  vocab-parallel loss
  mappings.dist_all_gather_func / dist_reduce_scatter_func (bound at mappings.py:12-13; used at
    :96, :146, :186): sequence-parallel gather / reduce-scatter
  layers.dist_all_gather_func / dist_reduce_scatter_func (bound at layers.py:85-86; used at
    :571 fwd SP all-gather, :617 bwd SP all-gather, :650 bwd SP reduce-scatter)
  torch.distributed.all_to_all_single (mappings.py:450/460 _AllToAll; EP token dispatch; and
    context-parallel attention's a2a, megatron_ext/attention/context_parallel.py)
  torch.distributed.all_gather_single / reduce_scatter_tensor: context-parallel attention's K/V
    all-gather and its backward reduce-scatter (context_parallel.py; on gloo an all_reduce, above)
  torch.distributed.all_gather list form (mappings.py:154, uneven splits of the MoE token
    dispatch): padded, gathered async into one buffer, sliced back (a copy: bit-identical)
  torch.distributed.reduce_scatter list form (mappings.py:197, uneven splits of the MoE token
    combine): issued async as the same primitive (on CPU padded exactly as the CPU shim pads the
    plain schedule's blocking call), waited after the hand-off
  get_global_memory_buffer in mappings.py:5, layers.py:20 and parallel_state.py:2480: one
    buffer per lane, since the "mpu" scratch buffer (layers.py:570/614, mappings.py:143-192)
    is held across a collective and the other lane would overwrite it.
Benchmark and test only (scoped): megatron's per-micro-batch passes, labelled for the plain
schedule's timeline, or replaced by stand-ins that let megatron_ext.measure.p2p_programs run a plain
schedule without a model and record its pipeline messages.
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as S
from megatron.core.tensor_parallel import layers, mappings

from megatron_ext.patching import Patch, set_attr, undo_all
from megatron_ext.platform.cpu_shims.gloo import pad_reduce_scatter_pieces


class _Idle:
    """The lanes as the wrappers see them until the overlap binds its own: none active, so every
    wrapper passes through to megatron-core's call and a plain pass goes unlabelled."""

    SYNC_DONE = object()
    PassLabel = contextlib.nullcontext

    @staticmethod
    def active() -> bool:
        return False

    @staticmethod
    def lane_memory_buffer():
        return None


# What the seams route to, handed down by the capabilities (a seam imports no capability package):
# the overlap's lanes (megatron_ext/schedules/lanes.py binds itself before a pair runs or a recorder
# is set, the only ways it becomes active), and the activation-offload manager a run attached
# (megatron_ext/offload/manager.py, attach / detach).
lanes = _Idle
offload_manager = None


def bind_lanes(module) -> None:
    global lanes
    lanes = module


def bind_offload_manager(manager) -> None:
    global offload_manager
    offload_manager = manager


def _nbytes(t):
    return t.numel() * t.element_size()


def _wrap_all_reduce(orig):
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if lanes.active():
            got = lanes.collective(
                "all_reduce", group, _nbytes(tensor),
                lambda: orig(tensor, op=op, group=group, async_op=True), async_op, lanes.row_width(tensor),
            )
            if got is not None:
                return None if got is lanes.SYNC_DONE else got
        return orig(tensor, op=op, group=group, async_op=async_op)

    return all_reduce


def _wrap_base(op_name, orig):
    def fn(output, input, group=None, async_op=False, **kw):
        if lanes.active():
            got = lanes.collective(
                op_name, group, _nbytes(output if op_name == "all_gather" else input),
                lambda: orig(output, input, group=group, async_op=True, **kw), async_op, lanes.row_width(input),
            )
            if got is not None:
                return None if got is lanes.SYNC_DONE else got
        return orig(output, input, group=group, async_op=async_op, **kw)

    return fn


def _wrap_a2a(orig):
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        if lanes.active():
            got = lanes.collective(
                "all_to_all", group, _nbytes(input),
                lambda: orig(output, input, output_split_sizes, input_split_sizes,
                             group=group, async_op=True),
                async_op, lanes.row_width(input),
            )
            if got is not None:
                return None if got is lanes.SYNC_DONE else got
        return orig(output, input, output_split_sizes, input_split_sizes, group=group,
                    async_op=async_op)

    return all_to_all_single


def _wrap_reduce_scatter_tensor(orig):
    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if lanes.active():
            got = lanes.collective(
                "reduce_scatter", group, _nbytes(input),
                lambda: orig(output, input, op=op, group=group, async_op=True), async_op, lanes.row_width(input),
            )
            if got is not None:
                return None if got is lanes.SYNC_DONE else got
        return orig(output, input, op=op, group=group, async_op=async_op)

    return reduce_scatter_tensor


def _wrap_list_reduce_scatter(orig):
    # mappings.py:197 (_reduce_scatter_along_first_dim with input_split_sizes, the MoE token
    # combine under TP): uneven pieces. In a lane it is issued async as the same primitive:
    # natively where the backend takes uneven pieces (NCCL); on CPU padded to the largest piece
    # exactly as the CPU shim pads the blocking call the plain schedule makes
    # (platform/cpu_shims/gloo.py, uneven_collectives), then sliced back.
    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if lanes.active() and not async_op and lanes.group_kind(group) is not None:
            sizes = [t.shape[0] for t in input_list]
            if output.is_cuda or len(set(sizes)) <= 1:
                out, inputs = output, input_list
            else:
                out, inputs = pad_reduce_scatter_pieces(output, input_list)
            got = lanes.collective(
                "reduce_scatter", group, sum(_nbytes(t) for t in inputs),
                lambda: orig(out, inputs, op=op, group=group, async_op=True), False,
                lanes.row_width(input_list[0]),
            )
            if got is not None:
                if out is not output:
                    output.copy_(out[: output.shape[0]])
                return None
        return orig(output, input_list, op=op, group=group, async_op=async_op)

    return reduce_scatter


def _wrap_list_all_gather(orig):
    # mappings.py:154 (_gather_along_first_dim with output_split_sizes, the MoE token dispatch
    # under TP): uneven pieces, which gloo cannot gather. In a lane: pad each piece to the
    # largest, gather async into one flat buffer (a pure copy, so bit-identical), slice back.
    gather_into_tensor = dist.all_gather_into_tensor

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if lanes.active() and not async_op and lanes.group_kind(group) is not None:
            pad = max(t.shape[0] for t in tensor_list)
            rest = tuple(tensor.shape[1:])
            padded = tensor.new_zeros((pad,) + rest)
            padded[: tensor.shape[0]] = tensor
            flat = tensor.new_empty((len(tensor_list) * pad,) + rest)
            got = lanes.collective(
                "all_gather", group, _nbytes(flat),
                lambda: gather_into_tensor(flat, padded, group=group, async_op=True), False,
                lanes.row_width(tensor),
            )
            if got is not None:
                for i, out in enumerate(tensor_list):
                    out.copy_(flat[i * pad: i * pad + out.shape[0]])
                return None
        return orig(tensor_list, tensor, group=group, async_op=async_op)

    return all_gather


def _install_tp_collectives():
    undos = [
        set_attr(dist, "all_reduce", _wrap_all_reduce(dist.all_reduce)),
        set_attr(dist, "all_to_all_single", _wrap_a2a(dist.all_to_all_single)),
        set_attr(dist, "all_gather", _wrap_list_all_gather(dist.all_gather)),
        set_attr(dist, "reduce_scatter", _wrap_list_reduce_scatter(dist.reduce_scatter)),
        # context-parallel attention's (megatron_ext/attention/context_parallel.py): torch.distributed's
        # names only; megatron's bound dist_*_func below and torch's own callers keep theirs
        set_attr(dist, "reduce_scatter_tensor", _wrap_reduce_scatter_tensor(dist.reduce_scatter_tensor)),
    ]
    if hasattr(dist, "all_gather_single"):  # torch's name for all_gather_into_tensor since its deprecation
        undos.append(set_attr(dist, "all_gather_single", _wrap_base("all_gather", dist.all_gather_single)))
    for mod in (mappings, layers):
        undos.append(set_attr(mod, "dist_all_gather_func", _wrap_base("all_gather", mod.dist_all_gather_func)))
        undos.append(set_attr(mod, "dist_reduce_scatter_func",
                              _wrap_base("reduce_scatter", mod.dist_reduce_scatter_func)))
    return undo_all(undos)


def _install_lane_memory_buffers():
    orig = parallel_state.get_global_memory_buffer

    def get_global_memory_buffer():
        return lanes.lane_memory_buffer() or orig()

    return undo_all([set_attr(mod, "get_global_memory_buffer", get_global_memory_buffer)
                     for mod in (mappings, layers, parallel_state)])


def _install_plain_pass_labels():
    """megatron/core/pipeline_parallel/schedules.py:397 forward_step and :532 backward_step, looked
    up as module globals by every plain schedule: recorded segments and collectives name their
    micro-batch ("F3" / "B1"), for the timeline of the plain schedule."""
    fwd, bwd = S.forward_step, S.backward_step
    count = {"b": 0}

    def forward_step(*args, **kwargs):
        with lanes.PassLabel(f"F{kwargs.get('current_microbatch', '?')}"):
            return fwd(*args, **kwargs)

    def backward_step(*args, **kwargs):
        label = f"B{count['b']}"
        count["b"] += 1
        with lanes.PassLabel(label):
            return bwd(*args, **kwargs)

    return undo_all([set_attr(S, "forward_step", forward_step), set_attr(S, "backward_step", backward_step)])


TP_COLLECTIVES = Patch(
    "schedules.tp_collectives",
    [
        "megatron/core/tensor_parallel/mappings.py:35",
        "megatron/core/tensor_parallel/layers.py:639",
        "megatron/core/tensor_parallel/layers.py:441",
        "megatron/core/tensor_parallel/cross_entropy.py:130",
        "megatron/core/tensor_parallel/mappings.py:12",
        "megatron/core/tensor_parallel/layers.py:85",
        "megatron/core/tensor_parallel/mappings.py:450",
        "megatron/core/tensor_parallel/mappings.py:154",
        "megatron/core/tensor_parallel/mappings.py:197",
    ],
    "TP (and EP) collectives are issued async and hand the baton to the other micro-batch's lane",
    _install_tp_collectives,
)
LANE_MEMORY_BUFFERS = Patch(
    "schedules.lane_memory_buffers",
    [
        "megatron/core/tensor_parallel/mappings.py:5",
        "megatron/core/tensor_parallel/layers.py:20",
        "megatron/core/parallel_state.py:2480",
    ],
    "the global 'mpu' scratch buffer is held across a collective: one per lane",
    _install_lane_memory_buffers,
)
PLAIN_PASS_LABELS = Patch(
    "schedules.plain_pass_labels",
    [
        "megatron/core/pipeline_parallel/schedules.py:397",
        "megatron/core/pipeline_parallel/schedules.py:532",
    ],
    "benchmark only: the plain schedule's passes named by micro-batch in the recorded timeline",
    _install_plain_pass_labels,
)



_STAND_INS: dict = {}


def _install_plain_schedule_steps():
    """megatron/core/pipeline_parallel/schedules.py:397 forward_step and :532 backward_step (module
    globals of every plain schedule, called at :1367, :2313, :2356): replaced by the stand-ins
    given to plain_schedule_steps()."""

    def forward_step(*args, **kwargs):
        return _STAND_INS["forward_step"](*args, **kwargs)

    def backward_step(*args, **kwargs):
        return _STAND_INS["backward_step"](*args, **kwargs)

    return undo_all([set_attr(S, "forward_step", forward_step), set_attr(S, "backward_step", backward_step)])


PLAIN_SCHEDULE_STEPS = Patch(
    "schedules.plain_schedule_steps",
    [
        "megatron/core/pipeline_parallel/schedules.py:397",
        "megatron/core/pipeline_parallel/schedules.py:532",
        "megatron/core/pipeline_parallel/schedules.py:1367",
        "megatron/core/pipeline_parallel/schedules.py:2313",
    ],
    "test only: a plain schedule run on stand-in passes, to record its pipeline messages",
    _install_plain_schedule_steps,
)


@contextlib.contextmanager
def plain_schedule_steps(forward_step, backward_step):
    """Scoped: megatron's plain schedules call these instead of their per-micro-batch passes, so
    that megatron_ext.measure.p2p_programs can run one without a model and record its messages."""
    _STAND_INS.update(forward_step=forward_step, backward_step=backward_step)
    try:
        with PLAIN_SCHEDULE_STEPS.applied():
            yield
    finally:
        _STAND_INS.clear()


def _install_combined_plan_offload_groups():
    """megatron/core/models/common/fine_grained_callables.py:159 build_layer_callables (looked up
    at model_chunk_schedule_plan.py:116 when a layer's plan is built, called at :122): a
    TransformerLayer's first node (pre_dispatch_computation, gpt/fine_grained_callables.py:67)
    begins our activation-offload group, its last (moe_combine :209 for a MoE layer, the dense
    mlp :259 otherwise) ends it with its output, as the layer's own forward hooks do outside
    the plan (megatron_ext/offload/manager.py)."""
    import functools

    from megatron.core.models.common import fine_grained_callables as fgc
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    orig = fgc.build_layer_callables

    def build_layer_callables(layer):
        funcs, backward_dw = orig(layer)
        manager = offload_manager
        if manager is None or not isinstance(layer, TransformerLayer) \
                or not manager.plans_layer(layer):
            return funcs, backward_dw
        funcs = list(funcs)
        last = 3 if isinstance(layer.mlp, MoELayer) else 2
        first_fn, last_fn = funcs[0], funcs[last]

        @functools.wraps(first_fn)
        def begin(node, *a, **k):
            manager.plan_layer_begin(layer)
            return first_fn(node, *a, **k)

        @functools.wraps(last_fn)
        def end(node, *a, **k):
            out = last_fn(node, *a, **k)
            manager.plan_layer_end(layer, out)
            return out

        funcs[0], funcs[last] = begin, end
        return funcs, backward_dw

    return set_attr(fgc, "build_layer_callables", build_layer_callables)


COMBINED_PLAN_OFFLOAD_GROUPS = Patch(
    "schedules.combined_plan_offload_groups",
    [
        "megatron/core/models/common/fine_grained_callables.py:159",
        "megatron/core/models/common/model_chunk_schedule_plan.py:116",
        "megatron/core/models/gpt/fine_grained_callables.py:67",
        "megatron/core/models/gpt/fine_grained_callables.py:209",
    ],
    "megatron's combined-1F1B plan runs a layer as nodes: its first and last node delimit the "
    "layer's activation-offload group",
    _install_combined_plan_offload_groups,
)


_NODE_HOOK: list = []  # the benchmark's node recorder while PLAN_NODES is applied


def _install_plan_nodes():
    """megatron/core/pipeline_parallel/utils.py:244 ScheduleNode._forward and :290 _backward (every
    node of megatron's combined-1F1B plan runs through them): each call reported to the
    benchmark's recorder with its node name, direction and micro-batch (the node's chunk state)."""
    from megatron.core.pipeline_parallel.utils import ScheduleNode

    fwd, bwd = ScheduleNode._forward, ScheduleNode._backward

    def _forward(self, *inputs):
        return _NODE_HOOK[-1](self, "F", lambda: fwd(self, *inputs))

    def _backward(self, *grads):
        return _NODE_HOOK[-1](self, "B", lambda: bwd(self, *grads))

    return undo_all([set_attr(ScheduleNode, "_forward", _forward), set_attr(ScheduleNode, "_backward", _backward)])


PLAN_NODES = Patch(
    "schedules.plan_nodes",
    ["megatron/core/pipeline_parallel/utils.py:244", "megatron/core/pipeline_parallel/utils.py:290"],
    "benchmark only: the nodes of megatron's combined-1F1B plan reported as they run",
    _install_plan_nodes,
)


@contextlib.contextmanager
def plan_nodes_recorded(hook):
    """Scoped: hook(node, "F"|"B", run) is called for every node megatron's combined-1F1B plan runs."""
    _NODE_HOOK.append(hook)
    try:
        with PLAN_NODES.applied():
            yield
    finally:
        _NODE_HOOK.pop()


SEAMS = [TP_COLLECTIVES, LANE_MEMORY_BUFFERS, PLAIN_PASS_LABELS, PLAIN_SCHEDULE_STEPS,
         COMBINED_PLAN_OFFLOAD_GROUPS, PLAN_NODES]


RUN = [TP_COLLECTIVES, LANE_MEMORY_BUFFERS]  # pass-through unless megatron_ext.schedules.lanes is active


def for_run(args) -> list:
    records = list(RUN) if args.overlap_tp_comm_1f1b else []
    if args.overlap_moe_expert_parallel_comm and args.activation_offload_modules:
        records.append(COMBINED_PLAN_OFFLOAD_GROUPS)
    return records


def label_plain_schedule_passes():
    """Benchmark-only context: the plain schedule's passes labelled by micro-batch."""
    return PLAIN_PASS_LABELS.applied()
