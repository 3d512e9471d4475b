"""Seams of the sync-free MoE token dispatch and its sync audit.

Replaced (per instance, by --moe-sync-free-dispatcher, after the model is built):
  MoELayer.token_dispatcher        transformer/moe/moe_layer.py:299-324 (built there; called at
                                   :484 dispatch_preprocess, :498 token_dispatch, :541
                                   dispatch_postprocess, :562 combine_preprocess, :572
                                   token_combine, :583 combine_postprocess) and
                                   MoELayer._training_token_dispatcher (:399, restored at :644)
    -> megatron_ext.moe.dispatcher.MultihotTokenDispatcher, a subclass of MoETokenDispatcher
       (token_dispatcher.py:61) standing in for MoEAllGatherTokenDispatcher (:230) and
       MoEAlltoAllTokenDispatcher (:372). It reuses, unchanged: moe_utils.permute (:337),
       unpermute (:470), get_capacity (:241); tensor_parallel all_to_all (mappings.py:558),
       gather_from_sequence_parallel_region (:522), reduce_scatter_to_sequence_parallel_region (:536).
Replaced per instance by --moe-zero-sync-dropless (after the model is built):
  SequentialMLP.forward            transformer/moe/experts.py:1318 (its tokens_per_expert.tolist()
                                   at :1352 is the host read) -> megatron_ext.moe.grouped_experts:
                                   the same experts' weights as grouped GEMMs over device offsets,
                                   megatron's MLP.forward (transformer/mlp.py:258) called unbound on
                                   a namespace holding grouped linear_fc1 / linear_fc2
Wrapped per instance by --cuda-graph-impl local --cuda-graph-modules moe with --moe-zero-sync-dropless
(megatron_ext/moe/graphs.py), after the model is built:
  MoELayer.forward                 transformer/moe/moe_layer.py (an instance attribute shadowing it)
                                   -> megatron's CudaGraphManager(config, layer, function_name="forward")
                                   (transformer/cuda_graphs.py:1763, :1799-1811), registered as the layer's
                                   child ``cudagraph_manager_forward``, as megatron binds one to an MoE
                                   transformer layer's router (transformer_layer.py:1580); during its graph
                                   warmup (cuda_graphs.py:1259) the MoE metrics tracker's values are kept,
                                   as megatron keeps them for MoETransformerLayer (:1176-1185)
  the CUDA RNG tracker             tensor_parallel/random.py:238 CudaRNGStatesTracker: its states converted
                                   to graph-safe generators (random.py:177 convert_cuda_rng_state), what
                                   megatron's initialize does for CUDA graphs (training/initialize.py:119);
                                   CudaGraphManager asserts it (cuda_graphs.py:1821-1825)
Read: cuda_graphs.is_graph_warmup (cuda_graphs.py:204): the zero-sync overflow counters skip megatron's
  warmup passes.
Reference only (called unbound, never replaced): _DeepepManager._indices_to_multihot
  (token_dispatcher.py:1328), the bit-equality oracle for megatron_ext.moe.indices_to_multihot.
Wrapped only while a SyncDetector is active (CPU only, restored on exit):
  token_dispatcher.maybe_move_tensor_to_cpu (imported token_dispatcher.py:39, defined
    moe_utils.py:1169): on CPU it never copies; emulated as CUDA's non-blocking D2H copy
  torch.cuda.Event / torch.cuda.Stream .synchronize and torch.cuda.synchronize (the platform's
    CPU stand-ins; upstream waits at token_dispatcher.py:950): counted as explicit syncs
Wrapped for a run with biased experts (--num-experts with megatron's default --add-bias-linear: gpt-oss),
on every platform (EXPERT_OUTPUT_NOT_A_VIEW):
  reduce_from_tensor_model_parallel_region / reduce_scatter_to_sequence_parallel_region, the names
    tensor_parallel/layers.py imports (:42, :43) and RowParallelLinear.forward calls (:1480, :1476):
    over a group of one rank they return their input itself instead of through the autograd
    Function. megatron's Functions return the input as-is there (mappings.py:28 _reduce, :172
    _reduce_scatter_along_first_dim), which autograd marks a view that may not be modified in place,
    and an expert MLP adds its bias times the routing score in place into that output
    (transformer/mlp.py:354) whenever its linear_fc2 communicates itself (explicit_expert_comm
    False, layers.py:1326: expert TP and EP both 1; TP1, or TP>1 with expert TP 1 and EP 1).
    Forward and backward of the Function are the identity at one rank: nothing else changes.
Process-global state reset between jobs of a persistent worker:
  MoEAuxLossAutoScaler.main_loss_backward_scale (moe_utils.py:287; created lazily as a 0-d tensor
    by a bare MoELayer backward at :316, copied into by the schedule's set_loss_scale at :334 with
    a [1] tensor -> a shape error when a training run follows a layer-only run, or vice versa)
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.moe import token_dispatcher as td
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_ext.patching import Patch, set_attr, undo_all


def replace_token_dispatcher(moe_layer, make) -> bool:
    """Swap ``moe_layer``'s token dispatcher for ``make(old_dispatcher)``; False if already ``make``'s."""
    old = moe_layer.token_dispatcher
    new = make(old)
    if new is old:
        return False
    moe_layer.token_dispatcher = new
    if getattr(moe_layer, "_training_token_dispatcher", None) is old:
        moe_layer._training_token_dispatcher = new
    return True


def run_experts_grouped(moe_layer, attach) -> None:
    """The layer's SequentialMLP runs through ``attach(experts)`` (megatron_ext.moe.grouped_experts,
    handed in by the moe package, which sits above the seams): an instance attribute shadowing
    SequentialMLP.forward, experts.py:1318; ``del experts.forward`` undoes it."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = moe_layer.experts
    if type(experts) is not SequentialMLP:
        raise ValueError(f"zero-sync dropless MoE needs SequentialMLP experts, got {type(experts).__name__}")
    experts.forward = attach(experts)


def capture_forward(moe_layer) -> None:
    """``moe_layer``'s forward captured and replayed by megatron's CudaGraphManager (see the module's
    docstring). Idempotent."""
    from megatron.core.transformer.cuda_graphs import CudaGraphManager, is_graph_warmup
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    if getattr(moe_layer, "cudagraph_manager_forward", None) is not None:
        return
    forward = moe_layer.forward

    def forward_keeping_metrics(*args, **kwargs):
        if not is_graph_warmup():
            return forward(*args, **kwargs)
        metrics = get_moe_metrics_tracker().metrics
        kept = {name: entry.values.clone() for name, entry in metrics.items()}
        try:
            return forward(*args, **kwargs)
        finally:
            for name, values in kept.items():
                metrics[name].values.copy_(values)

    moe_layer.forward = forward_keeping_metrics
    moe_layer.cudagraph_manager_forward = CudaGraphManager(moe_layer.config, moe_layer, function_name="forward")


def graph_safe_rng() -> None:
    """megatron's CUDA RNG tracker with graph-safe states (the same streams, now capturable)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    if mrandom.is_graph_safe_cuda_rng_tracker(tracker):
        return
    states = {name: mrandom.convert_cuda_rng_state(state, to_graphable=True)
              for name, state in tracker.get_states().items()}
    tracker.use_cudagraphable_rng = True
    tracker.set_states(states)


def release_graphs() -> None:
    """After a run that captured: megatron's graphs and their memory pool released (cuda_graphs.py:681
    delete_cuda_graphs), the default stream current again (the manager made a side stream current,
    :1845) and the RNG tracker's states back to plain ones, so the next run in this process starts clean."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    delete_cuda_graphs()
    torch.cuda.set_stream(torch.cuda.default_stream())
    tracker = mrandom.get_cuda_rng_tracker()
    if getattr(tracker, "use_cudagraphable_rng", False):
        tracker.set_states({name: mrandom.convert_cuda_rng_state(state, to_graphable=False)
                            for name, state in tracker.get_states().items()})
        tracker.use_cudagraphable_rng = False


def in_graph_warmup() -> bool:
    """Is megatron's CUDA-graph manager running its warmup passes (cuda_graphs.py:1259)?"""
    from megatron.core.transformer.cuda_graphs import is_graph_warmup

    return is_graph_warmup()


def reset_moe_aux_loss_scale() -> None:
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


_DETECTORS: list = []  # the active SyncDetectors, innermost last


def _install_emulated_dtoh():
    """The CUDA meaning of megatron's host transfers, for the innermost active SyncDetector
    (megatron_ext/moe/sync_detector.py): a non-blocking device-to-host copy, and the event wait that
    follows it (token_dispatcher.py:952) counted as the sync."""
    original_move = td.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        det = _DETECTORS[-1]
        if torch.is_tensor(tensor) and det.is_device(tensor):
            det.pending_copies += 1  # non_blocking=True upstream: no sync until the event waits
            with det._suppressed():
                host = tensor.detach().clone()
            det._set(host, False)
            return host.numpy() if as_numpy else host
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    def counted(owner, name, label):
        original = getattr(owner, name)

        def sync(*a, **k):
            _DETECTORS[-1]._record("explicit-sync", label)
            return original(*a, **k)

        return set_attr(owner, name, sync)

    return undo_all([
        set_attr(td, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu),
        counted(torch.cuda.Event, "synchronize", "Event.synchronize"),
        counted(torch.cuda.Stream, "synchronize", "Stream.synchronize"),
        counted(torch.cuda, "synchronize", "torch.cuda.synchronize"),
    ])


EMULATED_DTOH = Patch(
    "moe.emulated_dtoh",
    [
        "megatron/core/transformer/moe/token_dispatcher.py:39",
        "megatron/core/transformer/moe/moe_utils.py:1169",
        "megatron/core/transformer/moe/token_dispatcher.py:950",
    ],
    "sync audit on CPU only: megatron's host transfers counted as they happen on CUDA",
    _install_emulated_dtoh,
)
def _install_expert_output_not_a_view():
    from megatron.core.tensor_parallel import layers
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    def at_one_rank_the_input(original):
        def reduction(input_, group=None, *args, **kwargs):
            resolved = get_tensor_model_parallel_group_if_none(group)
            if resolved is not None and resolved.size() == 1:
                return input_
            return original(input_, group, *args, **kwargs)

        return reduction

    return undo_all([
        set_attr(layers, name, at_one_rank_the_input(getattr(layers, name)))
        for name in ("reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region")
    ])


EXPERT_OUTPUT_NOT_A_VIEW = Patch(
    "moe.expert_output_not_a_view",
    ["megatron/core/transformer/mlp.py:354", "megatron/core/tensor_parallel/layers.py:1476",
     "megatron/core/tensor_parallel/layers.py:1480", "megatron/core/tensor_parallel/mappings.py:28",
     "megatron/core/tensor_parallel/mappings.py:172"],
    "an expert MLP with biases adds its bias in place into linear_fc2's output, which at one expert "
    "TP rank without EP is the input a one-rank reduction returned as-is (a view autograd forbids "
    "modifying in place); the identity reductions return the tensor itself",
    _install_expert_output_not_a_view,
)
SEAMS = [EMULATED_DTOH, EXPERT_OUTPUT_NOT_A_VIEW]


def for_run(args) -> list:
    """Biased experts (gpt-oss) reach the in-place add of transformer/mlp.py:354."""
    biased_experts = args.num_experts and args.add_bias_linear
    return [EXPERT_OUTPUT_NOT_A_VIEW] if biased_experts else []


@contextlib.contextmanager
def emulated_dtoh(detector):
    """EMULATED_DTOH applied for the lifetime of one SyncDetector."""
    _DETECTORS.append(detector)
    try:
        with EMULATED_DTOH.applied():
            yield
    finally:
        _DETECTORS.pop()


# Per-call attributes of megatron's shared-expert overlap (transformer/moe/shared_experts.py:185-189
# set, :228-361 pre_forward_comm .. get_output advance the state machine and fill the caches).
SHARED_EXPERT_STATE = ("_overlap_state", "cached_fc1_input", "cached_fc2_input", "cached_fc2_output",
                       "cached_output", "gate_score")


def per_pass_state(model_chunks) -> list:
    """(object, attributes) that keep state between the calls of one pass, for lane_state.set_stateful:
    every MoE layer's token dispatcher (MoELayer.token_dispatcher, moe_layer.py:299-324, ours or
    megatron's: every attribute, they are all per-call or constant) and every SharedExpertMLP
    with --moe-shared-expert-overlap (SHARED_EXPERT_STATE)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    out, seen = [], set()
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                for d in (module.token_dispatcher, getattr(module, "_training_token_dispatcher", None)):
                    if d is not None and id(d) not in seen:
                        seen.add(id(d))
                        out.append((d, None))
            elif isinstance(module, SharedExpertMLP) and module.config.moe_shared_expert_overlap:
                out.append((module, SHARED_EXPERT_STATE))
    return out
