"""Peak device memory of each pipeline stage, from the scaled trace and megatron's schedule.

Buffers: megatron's global memory buffer (reused by sequence-parallel all-gathers), as traced.

Model state per stage: parameters (the trace's, scaled; expert parameters / EP; with tied embeddings
the last stage holds the word embeddings too), gradients (fp32 when megatron accumulates in fp32,
else the parameter dtype) and Adam state (an fp32 main copy when parameters are 16-bit, two fp32
moments), sharded over data-parallel ranks by the distributed optimizer (expert parameters over the
expert-data-parallel ranks); Megatron-FSDP shards parameters and gradients too. With LoRA the base is
frozen: gradients and optimizer state are the adapters' only (counted from the flags).

Activations: the pass order of megatron's schedule on this rank (``schedule.passes``) is replayed;
every pass holds what its components save (embedding on the first chunk, its layers, head on the
last). At a forward inside component i of a pass the live bytes are the other passes' saved bytes,
this pass's saved bytes of components before i and i's forward working set; in the backward of
component i they are the other passes', this pass's still held (components up to i) and i's
backward working set; receive buffers the schedule has posted and no pass consumed yet, and sent
tensors whose send was not waited for, add one boundary tensor each. The peak is the largest over the step.
Under expert parallelism a MoE layer's forward and backward also hold the exchange's receive buffer,
which the trace (no expert parallelism) lacks: ``moe_dispatch`` (``dispatch_rows``). Per model chunk:
its layers, parameters, what one micro-batch saves in it and what its passes hold at the peak.

Offload (``megatron_ext.offload``): what the chosen modules save in a layer (storages of at least
``--activation-offload-min-tensor-kb``) leaves the device one layer late in forward (the previous
layer's group is resident while a layer runs) and comes back in backward with the prefetch window
(the layer being back-propagated and ``depth`` earlier ones); other passes' groups are on the host,
the last layer of a pass whose backward follows its forward is never copied, and is resident anyway
when that backward starts. The host pool bounds what can be off the device at once.
"""
from __future__ import annotations

import dataclasses
import math

from megatron_ext import lora
from megatron_ext.offload.vocabulary import OffloadOptions
from megatron_ext.planner import schedule
from megatron_ext.planner.run import fixed_budget_rows, fp8_gemms, layer_kinds, local_seq


@dataclasses.dataclass(frozen=True)
class Offload:
    modules: tuple = ()
    prefetch_depth: int = OffloadOptions.prefetch_depth
    min_tensor_bytes: int = OffloadOptions().min_tensor_bytes
    pool_bytes: float = math.inf

    @classmethod
    def from_args(cls, args) -> "Offload":
        """The run's offload, as the offload package reads its validated options."""
        if not args.activation_offload_modules:
            return cls()
        from megatron_ext.offload import OffloadOptions

        o = OffloadOptions.from_args(args)
        return cls(tuple(o.modules), o.prefetch_depth, o.min_tensor_bytes, float(o.pool_bytes))


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int | None
    ep: int
    etp: int
    cp: int
    dp: int
    edp: int
    mbs: int
    microbatches: int
    world: int

    @classmethod
    def from_args(cls, args) -> "Layout":
        tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
        ep = args.expert_model_parallel_size
        etp = args.expert_tensor_parallel_size or tp
        world = args.world_size
        dp = world // (tp * pp * cp)
        return cls(tp, pp, args.virtual_pipeline_model_parallel_size, ep, etp, cp, dp,
                   max(1, world // (ep * etp * pp)), args.micro_batch_size,
                   args.global_batch_size // (args.micro_batch_size * dp), world)

    def describe(self) -> str:
        return (f"TP{self.tp} PP{self.pp}" + (f" VPP{self.vpp}" if self.vpp else "")
                + (f" EP{self.ep}" if self.ep > 1 else "") + f" DP{self.dp} mbs{self.mbs} x{self.microbatches}")


def chunk_layers(args, config, pp_rank: int, vp_stage: int | None) -> list:
    """The layer kinds megatron builds in this model chunk (its own layer-count and offset rules)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None and not isinstance(layout, str):
        # --pipeline-model-parallel-layout: its per-stage lists, counted as megatron's
        # PipelineParallelLayerLayout.get_num_layers_to_build / get_layer_offset count them
        # (transformer/pipeline_parallel_layer_layout.py:152, :170), which read the pipeline rank
        # from the model-parallel state this process does not have
        from megatron.core.transformer.enums import LayerType

        v = vp_stage or 0
        stages = layout.layout
        n = stages[pp_rank][v].count(LayerType.decoder)
        offset = sum(stages[p][u].count(LayerType.decoder) for u in range(v + 1)
                     for p in range(layout.pipeline_model_parallel_size if u < v else pp_rank))
    else:
        n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return layer_kinds(args)[offset: offset + n]


def chunk_components(args, config, layout: Layout, pp_rank: int, v: int) -> list:
    vpp = layout.vpp or 1
    first = pp_rank == 0 and v == 0
    last = pp_rank == layout.pp - 1 and v == vpp - 1
    comps = ["embedding"] if first else []
    comps += [("layer", k) for k in chunk_layers(args, config, pp_rank, v if layout.vpp else None)]
    if last:
        comps.append("head")
        for _ in range(args.mtp_num_layers or 0):  # MTP: one more layer and head each
            comps += [("layer", layer_kinds(args)[-1]), "head"]
    return comps


def _name(scaled, comp) -> str:
    return scaled.kind(comp[1]) if isinstance(comp, tuple) else comp


def model_state(args, scaled, layout: Layout, comps_per_chunk: list, pp_rank: int) -> dict:
    """Bytes of parameters, gradients and optimizer state on one rank of this stage."""
    dense = expert = gemm = 0.0
    seen_head = False
    for comps in comps_per_chunk:
        for comp in comps:
            name = _name(scaled, comp)
            if comp == "head" and seen_head:
                continue  # MTP heads share the output layer
            seen_head |= comp == "head"
            dense += scaled.params_dense[name]
            expert += scaled.params_expert[name]
            gemm += scaled.gemm_weights.get(name, 0.0)
    tied = not args.untie_embeddings_and_output_weights
    if tied and layout.pp > 1 and pp_rank == layout.pp - 1:
        dense += scaled.params_dense["embedding"]  # the last stage's copy of the word embeddings
    elem = 2 if (args.bf16 or args.fp16) else 4
    count = (dense + expert) / elem
    grad_elem = 4 if args.accumulate_allreduce_grads_in_fp32 or elem == 4 else elem
    opt_per_param = (4 if elem == 2 else 0) + 8  # fp32 main copy for 16-bit parameters, Adam moments
    fsdp = args.use_megatron_fsdp or args.use_torch_fsdp2
    sharded = args.use_distributed_optimizer or fsdp
    opt = opt_per_param * (dense / elem / (layout.dp if sharded else 1) + expert / elem / (layout.edp if sharded else 1))
    params = dense + expert
    grads = count * grad_elem
    if fsdp:
        params = dense / layout.dp + expert / layout.edp
        grads = grad_elem * (dense / elem / layout.dp + expert / elem / layout.edp)
    if lora.enabled(args):  # the base frozen: gradients and optimizer state of the adapters only
        params, grads, opt, count = _lora_state(args, layout, comps_per_chunk, params, elem, grad_elem,
                                                opt_per_param, sharded, fsdp, count)
    # FP8 GEMMs on 16-bit weights: transformer-engine casts each weight once per step and keeps the
    # FP8 copy across micro-batches (row-wise for the forward and dgrad, column-wise for Hopper's
    # wgrad: 2 bytes per weight); with --fp8-param-gather the parameters are those FP8 tensors
    fp8 = 2 * gemm / elem if fp8_gemms(args) and not args.fp8_param_gather else 0.0
    return dict(parameters=params, gradients=grads, optimizer=opt, param_count=count, fp8_weights=fp8)


def _lora_state(args, layout: Layout, comps_per_chunk: list, base_params: float, elem: int, grad_elem: int,
                opt_per_param: int, sharded: bool, fsdp: bool, base_count: float) -> tuple:
    """(parameters, gradients, optimizer, element count) of a LoRA run's stage: the base's parameters
    as they are (frozen: no gradient, no main copy, no optimizer state), the adapters' elements
    (megatron_ext.lora.adapter_elements) with their gradients and optimizer state."""
    per_layer = lora.adapter_elements(args)
    dense = expert = 0.0
    for comps in comps_per_chunk:
        for comp in comps:
            if isinstance(comp, tuple):
                dense += per_layer[comp[1]][0]
                expert += per_layer[comp[1]][1]
    dp, edp = (layout.dp, layout.edp) if sharded else (1, 1)
    on_rank = (dense / layout.dp + expert / layout.edp) if fsdp else dense + expert
    params = base_params + elem * on_rank
    grads = grad_elem * on_rank
    opt = opt_per_param * (dense / dp + expert / edp)
    return params, grads, opt, base_count + dense + expert


def boundary_bytes(args, layout: Layout) -> float:
    """One tensor megatron sends between pipeline stages: (sequence / TP under sequence parallelism,
    micro-batch, hidden) in the pipeline dtype."""
    elem = 2 if (args.bf16 or args.fp16) else 4
    seq = local_seq(args) // (layout.tp if args.sequence_parallel else 1)
    return float(seq * args.micro_batch_size * args.hidden_size * elem)


def dispatch_rows(args, layout: Layout) -> float:
    """Rows a rank receives from the expert-parallel exchange of one MoE layer: the buffer the trace
    lacks (it has no expert parallelism, its dispatch exchanges nothing). Per rank, tokens =
    sequence x micro-batch / TP (megatron requires sequence parallelism for MoE under TP).
    Dropless: the expectation, tokens x top-k; with a capacity factor c, padded to capacity:
    tokens x top-k x c; the fixed-budget buffers of --moe-zero-sync-dropless: EP x the budget per
    destination (``fixed_budget_rows``; the trace sized its own buffers so, per token)."""
    if not args.num_experts or layout.ep * layout.etp == 1:
        return 0.0
    tokens = local_seq(args) * args.micro_batch_size // layout.tp
    k = args.moe_router_topk or 1
    routed = tokens * k
    rows = fixed_budget_rows(args, layout.ep, layout.tp)
    if rows is not None:  # the trace ran its experts on as many rows per token (see trace_args)
        return float(rows * layout.etp)
    factor = args.moe_expert_capacity_factor
    if factor is not None and args.moe_pad_expert_input_to_capacity:
        routed = args.num_experts * math.ceil(routed / args.num_experts * factor)
    return float(routed * layout.etp)


def dispatch_bytes(args, layout: Layout) -> float:
    """Bytes of the expert-parallel exchange's buffers the trace does not have, live while a MoE
    layer dispatches or combines (forward) and while their gradients are exchanged (backward)."""
    elem = 2 if (args.bf16 or args.fp16) else 4
    return dispatch_rows(args, layout) * args.hidden_size * elem


def packed_mask_bytes(args) -> float:
    """--sft on the local spec: the per-conversation attention mask of a packed micro-batch (bool
    [micro-batch, 1, S / CP, S], megatron_ext/sft/attention.py), made by each chunk's forward step and held
    until its backward (the softmax's masked fill keeps it). Transformer-engine's packed sequences
    carry only their cu_seqlens."""
    if not args.sft or args.transformer_impl != "local":
        return 0.0
    return float(args.micro_batch_size * local_seq(args) * args.seq_length)  # this CP rank's query rows


def activation_peak(scaled, layout: Layout, comps_per_chunk: list, pp_rank: int, offload: Offload,
                    boundary: float = 0.0, dispatch: float = 0.0, per_pass: float = 0.0) -> dict:
    """Replay the rank's pass order; the most live activation bytes and what they were at that moment
    (boundary tensors the schedule holds, receives posted ahead and sends in flight, count as
    ``boundary`` bytes each; a MoE layer's forward and backward add ``dispatch`` bytes, the
    expert-parallel exchange's buffers; every pass from its forward to its backward holds ``per_pass``
    bytes the trace does not see, ``packed_mask_bytes``). Also, per model chunk, the bytes its passes
    hold at that moment."""
    names = [[_name(scaled, c) for c in comps] for comps in comps_per_chunk]
    saved = [[scaled.saved[n] for n in ns] for ns in names]
    mods = set(offload.modules)
    off = [[sum(v for m, v in scaled.offloadable_at(n, offload.min_tensor_bytes).items() if m in mods)
            if isinstance(c, tuple) else 0.0 for n, c in zip(ns, comps)]
           for ns, comps in zip(names, comps_per_chunk)]
    total = [sum(s) + per_pass for s in saved]
    total_off = [sum(o) for o in off]
    alive: list = []
    best = dict(peak=-1.0)
    events = schedule.passes(layout.pp, layout.vpp, layout.microbatches, pp_rank)

    def consider(value, saved_now, working, removed, where, current=None, current_saved=0.0, moe=False):
        value += dispatch if moe else 0.0
        if value > best["peak"]:
            held = [0.0] * len(total)
            for _m, c in alive:
                held[c] += total[c]
            if current is not None:
                held[current] += current_saved
            best.update(peak=value, saved=saved_now, working=working, offload_removed=removed, where=where,
                        dispatch=dispatch if moe else 0.0, chunk_held=held)

    for kind, mb, v, posted in events:
        others = sum(total[c] for _m, c in alive) + posted * boundary
        others_off = min(sum(total_off[c] for _m, c in alive), offload.pool_bytes)
        ns, ss, oo = names[v], saved[v], off[v]
        if kind == "F":
            prefix = per_pass
            for j, n in enumerate(ns):
                held_off = sum(oo[:max(0, j - 1)])  # one group late: the previous layer is still resident
                removed = min(others_off + held_off, offload.pool_bytes)
                consider(others + prefix + scaled.fwd[n] - removed, others + prefix + ss[j], scaled.fwd[n] - ss[j],
                         removed, f"forward {n} of micro-batch {mb} chunk {v}", v, prefix + ss[j],
                         comps_per_chunk[v][j] == ("layer", "moe"))
                prefix += ss[j]
            alive.append((mb, v))
        else:
            alive.remove((mb, v))
            others = sum(total[c] for _m, c in alive) + posted * boundary
            others_off = min(sum(total_off[c] for _m, c in alive), offload.pool_bytes)
            # the layer being back-propagated and the prefetch window are on the device, earlier
            # layers still on the host
            for j in range(len(ns) - 1, -1, -1):
                n = ns[j]
                held = per_pass + sum(ss[: j + 1])
                held_off = sum(oo[: max(0, j - offload.prefetch_depth)])
                removed = min(others_off + held_off, offload.pool_bytes)
                consider(others + held + scaled.bwd[n] - removed, others + held, scaled.bwd[n], removed,
                         f"backward {n} of micro-batch {mb} chunk {v}", v, held,
                         comps_per_chunk[v][j] == ("layer", "moe"))
    in_flight = schedule.max_in_flight(layout.pp, layout.vpp, layout.microbatches, pp_rank)
    return dict(best, in_flight=in_flight)


def predict_stage(args, config, scaled, layout: Layout, pp_rank: int, offload: Offload, backend: str = "nccl") -> dict:
    vpp = layout.vpp or 1
    comps_per_chunk = [chunk_components(args, config, layout, pp_rank, v) for v in range(vpp)]
    state = model_state(args, scaled, layout, comps_per_chunk, pp_rank)
    act = activation_peak(scaled, layout, comps_per_chunk, pp_rank, offload, boundary_bytes(args, layout),
                          dispatch_bytes(args, layout), packed_mask_bytes(args))
    if backend == "gloo" and args.use_distributed_optimizer:
        # the distributed optimizer reduce-scatters the gradient buckets under torch's coalescing
        # manager, which on gloo (no coalesced collectives) gathers them into one flat copy at the
        # end of the backward; NCCL reduces them in place
        copy = state["gradients"]
        if copy > act["peak"]:
            act = dict(act, peak=copy, saved=0.0, working=copy, offload_removed=0.0, dispatch=0.0,
                       chunk_held=[0.0] * vpp,
                       where="gradient reduce-scatter (gloo's flat copy of the gradient buffers)")
    fp8 = {"fp8_weights": state["fp8_weights"]} if state["fp8_weights"] else {}
    components = dict(parameters=state["parameters"], gradients=state["gradients"], optimizer=state["optimizer"],
                      **fp8, buffers=scaled.buffers, activations=act["saved"], working_set=act["working"],
                      moe_dispatch=act["dispatch"], offload_removed=-act["offload_removed"] or 0.0)
    chunks = []
    for v, comps in enumerate(comps_per_chunk):
        names = [_name(scaled, c) for c in comps]
        unique = [n for i, n in enumerate(names) if n != "head" or "head" not in names[:i]]  # MTP heads share one
        params = sum(scaled.params_dense[n] + scaled.params_expert[n] for n in unique)
        chunks.append(dict(chunk=v, layers=[(c[1] if isinstance(c, tuple) else c) for c in comps],
                           parameters=params,
                           activations_per_microbatch=sum(scaled.saved[n] for n in names) + packed_mask_bytes(args),
                           activations_at_peak=act["chunk_held"][v]))
    return dict(stage=pp_rank, peak_bytes=sum(components.values()), activation_peak_bytes=act["peak"],
                components=components, at=act["where"], in_flight=act["in_flight"],
                layers=[[(c[1] if isinstance(c, tuple) else c) for c in comps] for comps in comps_per_chunk],
                param_count=state["param_count"], chunks=chunks)


def predict(args, config, scaled, offload: Offload | None = None, backend: str = "nccl") -> list:
    """Per stage, for a run on ``backend`` (the GPU cluster's NCCL, or gloo where the benchmark measures)."""
    layout = Layout.from_args(args)
    offload = offload if offload is not None else Offload.from_args(args)
    return [predict_stage(args, config, scaled, layout, r, offload, backend) for r in range(layout.pp)]
