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
    (megatron/core/num_microbatches_calculator.py:_GLOBAL_NUM_MICROBATCHES_CALCULATOR), and the
    MoE aux-loss scale a previous run's schedule set (moe/moe_utils.py MoEAuxLossAutoScaler), and the
    MoE metrics tracker, whose per-layer entries keep the previous model's layer count
    (moe/moe_logging.py:49; a deeper model then indexes past them at :125), and the process groups
    parallel_state.destroy_model_parallel (parallel_state.py:2506) leaves referenced
    (parallel_state.py:129, 131, 146-147), which keeps each gloo group's threads alive, and the
    lru_cache on RotaryEmbedding.forward (models/common/embeddings/rotary_pos_embedding.py:177,
    yarn_rotary_pos_embedding.py:159), keyed by the module, so it keeps the last 32 models' rotary
    embeddings and with them their context-parallel groups."""
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    parallel_state.destroy_global_memory_buffer()
    nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
    # destroy_model_parallel forgets these; a reference left here keeps a destroyed group's threads
    parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
    parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
    parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    parallel_state._HYBRID_DP_CP_GROUPS = {}
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    # the cache key is the module itself: it keeps finished runs' modules (and their cp_group) alive
    rotary_pos_embedding.RotaryEmbedding.forward.cache_clear()
    yarn_rotary_pos_embedding.YarnRotaryEmbedding.forward.cache_clear()
    reset_moe_aux_loss_scale()
    destroy_moe_metrics_tracker()


# ---------------------------------------------------------------------------------------------
# schedules (issue 5: 1F1B backward-forward overlap hiding TP communication)
#
# Every TP collective megatron-core's local layers issue is routed through
# megatron_ext.schedules.lanes.collective(), which (only while one of our schedules runs, or a
# benchmark records) issues it async and hands the baton to the other micro-batch's lane before
# waiting. Outside those, each wrapper is a pass-through to the original. Wrapped:
#   torch.distributed.all_reduce, reached from
#     megatron/core/tensor_parallel/mappings.py:35    _reduce (row-parallel fwd, column-parallel bwd)
#     megatron/core/tensor_parallel/layers.py:639     async dgrad all-reduce (kept async: megatron
#                                                     still overlaps it with the wgrad GEMM)
#     megatron/core/tensor_parallel/layers.py:441     frozen-weight dgrad all-reduce
#     megatron/core/tensor_parallel/cross_entropy.py:130,146,150  vocab-parallel loss
#   mappings.dist_all_gather_func / dist_reduce_scatter_func (bound at mappings.py:12-13; used at
#     :96, :146, :186): sequence-parallel gather / reduce-scatter
#   layers.dist_all_gather_func / dist_reduce_scatter_func (bound at layers.py:85-86; used at
#     :571 fwd SP all-gather, :617 bwd SP all-gather, :650 bwd SP reduce-scatter)
#   torch.distributed.all_to_all_single (mappings.py:450/460 _AllToAll; EP token dispatch)
#   torch.distributed.all_gather list form (mappings.py:154, uneven splits of the MoE token
#     dispatch): padded, gathered async into one buffer, sliced back (a copy: bit-identical)
#   torch.distributed.reduce_scatter list form (mappings.py:197): recorded only (run inline, as
#     upstream; a different reduction primitive could change the summation order for TP > 2)
#   get_global_memory_buffer in mappings.py:5, layers.py:20 and parallel_state.py:2480: one
#     buffer per lane, since the "mpu" scratch buffer (layers.py:570/614, mappings.py:143-192)
#     is held across a collective and the other lane would overwrite it.
# ---------------------------------------------------------------------------------------------
def install_schedules_seams() -> None:
    """Idempotent (re-wraps any attribute someone else has replaced since); pass-through unless
    megatron_ext.schedules.lanes is active."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers, mappings

    from megatron_ext.schedules import lanes

    def _nbytes(t):
        return t.numel() * t.element_size()

    def _mark(fn, orig):
        fn._megatron_ext_schedules = True
        fn.__wrapped__ = orig
        return fn

    def _ours(fn):
        return getattr(fn, "_megatron_ext_schedules", False)

    def _wrap_all_reduce(orig):
        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if lanes.active():
                got = lanes.collective(
                    "all_reduce", group, _nbytes(tensor),
                    lambda: orig(tensor, op=op, group=group, async_op=True), async_op,
                )
                if got is not None:
                    return None if got is lanes.SYNC_DONE else got
            return orig(tensor, op=op, group=group, async_op=async_op)

        return _mark(all_reduce, orig)

    def _wrap_base(op_name, orig):
        def fn(output, input, group=None, async_op=False, **kw):
            if lanes.active():
                got = lanes.collective(
                    op_name, group, _nbytes(output if op_name == "all_gather" else input),
                    lambda: orig(output, input, group=group, async_op=True, **kw), async_op,
                )
                if got is not None:
                    return None if got is lanes.SYNC_DONE else got
            return orig(output, input, group=group, async_op=async_op, **kw)

        return _mark(fn, orig)

    def _wrap_a2a(orig):
        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                              group=None, async_op=False):
            if lanes.active():
                got = lanes.collective(
                    "all_to_all", group, _nbytes(input),
                    lambda: orig(output, input, output_split_sizes, input_split_sizes,
                                 group=group, async_op=True),
                    async_op,
                )
                if got is not None:
                    return None if got is lanes.SYNC_DONE else got
            return orig(output, input, output_split_sizes, input_split_sizes, group=group,
                        async_op=async_op)

        return _mark(all_to_all_single, orig)

    def _wrap_record_only(op_name, orig):
        def fn(a, b, *args, group=None, async_op=False, **kw):
            if lanes.active() and not async_op:
                return lanes.record_sync(op_name, group, lambda: orig(a, b, *args, group=group, **kw))
            return orig(a, b, *args, group=group, async_op=async_op, **kw)

        return _mark(fn, orig)

    gather_into_tensor = getattr(dist.all_gather_into_tensor, "__wrapped__", dist.all_gather_into_tensor)

    def _wrap_list_all_gather(orig):
        # mappings.py:154 (_gather_along_first_dim with output_split_sizes, the MoE token dispatch
        # under TP): uneven pieces, which gloo cannot gather. In a lane: pad each piece to the
        # largest, gather async into one flat buffer (a pure copy, so bit-identical), slice back.
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
                )
                if got is not None:
                    for i, out in enumerate(tensor_list):
                        out.copy_(flat[i * pad: i * pad + out.shape[0]])
                    return None
            return orig(tensor_list, tensor, group=group, async_op=async_op)

        return _mark(all_gather, orig)

    orig_get_buffer = getattr(parallel_state.get_global_memory_buffer, "__wrapped__",
                              parallel_state.get_global_memory_buffer)

    def get_global_memory_buffer():
        return lanes.lane_memory_buffer() or orig_get_buffer()

    _mark(get_global_memory_buffer, orig_get_buffer)

    if not _ours(dist.all_reduce):
        dist.all_reduce = _wrap_all_reduce(dist.all_reduce)
    if not _ours(dist.all_to_all_single):
        dist.all_to_all_single = _wrap_a2a(dist.all_to_all_single)
    if not _ours(dist.all_gather):
        dist.all_gather = _wrap_list_all_gather(dist.all_gather)
    if not _ours(dist.reduce_scatter):
        dist.reduce_scatter = _wrap_record_only("reduce_scatter_list", dist.reduce_scatter)
    for mod in (mappings, layers):
        if not _ours(mod.dist_all_gather_func):
            mod.dist_all_gather_func = _wrap_base("all_gather", mod.dist_all_gather_func)
        if not _ours(mod.dist_reduce_scatter_func):
            mod.dist_reduce_scatter_func = _wrap_base("reduce_scatter", mod.dist_reduce_scatter_func)
        if not _ours(mod.get_global_memory_buffer):
            mod.get_global_memory_buffer = get_global_memory_buffer
    if not _ours(parallel_state.get_global_memory_buffer):
        parallel_state.get_global_memory_buffer = get_global_memory_buffer


def label_plain_schedule_passes():
    """Benchmark-only context: wrap megatron's per-micro-batch passes
    (megatron/core/pipeline_parallel/schedules.py:397 forward_step and :532 backward_step, looked up
    as module globals by every plain schedule) so recorded segments and collectives name their
    micro-batch ("F3" / "B1"), for the timeline of the plain schedule."""
    import contextlib

    from megatron.core.pipeline_parallel import schedules as S

    from megatron_ext.schedules import lanes

    @contextlib.contextmanager
    def ctx():
        fwd, bwd = S.forward_step, S.backward_step
        count = {"b": 0}

        def forward_step(*args, **kwargs):
            with lanes.owner(f"F{kwargs.get('current_microbatch', '?')}"):
                return fwd(*args, **kwargs)

        def backward_step(*args, **kwargs):
            label = f"B{count['b']}"
            count["b"] += 1
            with lanes.owner(label):
                return bwd(*args, **kwargs)

        S.forward_step, S.backward_step = forward_step, backward_step
        try:
            yield
        finally:
            S.forward_step, S.backward_step = fwd, bwd

    return ctx()


# ---------------------------------------------------------------------------------------------
# offload (issue 3: chunked, race-free activation offload)
#
# Nothing of megatron-core is replaced. megatron_ext.offload.manager attaches torch module hooks to
# megatron-core modules and pushes torch's saved-tensor hooks around their forward. The modules it
# finds, by the names of the flag --activation-offload-modules:
#   pass  (one micro-batch of one chunk): pre-hook on GPTModel      models/gpt/gpt_model.py:519
#   group (one layer of one pass): pre/post hooks on TransformerLayer
#                                            transformer/transformer_layer.py:304 (forward :747);
#     its backward begins when the gradient of the layer's output (:1012, make_viewless_tensor)
#     arrives: a Tensor.register_hook on that output.
#   core_attention  layer.self_attention.core_attention      transformer/attention.py:382
#                   (local: DotProductAttention, transformer/dot_product_attention.py:142)
#   qkv_linear      layer.self_attention.linear_qkv          transformer/attention.py:1681
#   attn_proj       layer.self_attention.linear_proj         transformer/attention.py:413
#   router_fc1      MoE expert fc1: layer.mlp.experts.local_experts[i].linear_fc1 (SequentialMLP,
#                   transformer/moe/experts.py:1260; MLP fc1 transformer/mlp.py:222) or
#                   layer.mlp.experts.linear_fc1 (TEGroupedMLP, transformer/moe/experts.py:216)
#   router_fc2      the same with linear_fc2 (transformer/mlp.py:242, transformer/moe/experts.py:235)
#   moe_act         the expert activation: everything saved between the expert's fc1 returning and
#                   its fc2 starting (MLP.forward transformer/mlp.py:267-336, TEGroupedMLP.forward
#                   transformer/moe/experts.py:815-876), so fused, GLU and TE activations are all
#                   covered without wrapping config.activation_func
#   shared_experts  layer.mlp.shared_experts                 transformer/moe/moe_layer.py:338
# Module paths are the same in the local and the transformer-engine layer specs.
# ---------------------------------------------------------------------------------------------
def offload_unwrap(chunk):
    """DDP / Float16Module wrappers (megatron/core/distributed/data_parallel_base.py,
    megatron/core/transformer/module.py Float16Module) keep the model in `.module`."""
    while hasattr(chunk, "module") and isinstance(chunk.module, __import__("torch").nn.Module):
        chunk = chunk.module
    return chunk


def offload_layers(model) -> list:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


def _expert_linears(experts, which: str) -> list:
    if experts is None:
        return []
    if hasattr(experts, "local_experts"):  # SequentialMLP
        return [getattr(e, which) for e in experts.local_experts]
    lin = getattr(experts, which, None)
    return [lin] if lin is not None else []


def offload_targets(layer, names) -> list:
    """[(name, "module", [modules])] or [(name, "window", [(fc1, fc2)])] present in this layer."""
    attn = getattr(layer, "self_attention", None)
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    out = []
    for name in names:
        if name == "core_attention":
            mods = [getattr(attn, "core_attention", None)]
        elif name == "qkv_linear":
            mods = [getattr(attn, "linear_qkv", None)]
        elif name == "attn_proj":
            mods = [getattr(attn, "linear_proj", None)]
        elif name == "router_fc1":
            mods = _expert_linears(experts, "linear_fc1")
        elif name == "router_fc2":
            mods = _expert_linears(experts, "linear_fc2")
        elif name == "shared_experts":
            mods = [getattr(mlp, "shared_experts", None)]
        elif name == "moe_act":
            pairs = list(zip(_expert_linears(experts, "linear_fc1"), _expert_linears(experts, "linear_fc2")))
            if pairs:
                out.append((name, "window", pairs))
            continue
        else:
            raise ValueError(name)
        mods = [m for m in mods if m is not None]
        if mods:
            out.append((name, "module", mods))
    return out


# ---------------------------------------------------------------------------------------------
# checkpointing (issue 7)
#
# megatron_ext/training/checkpointing.py drives megatron.core.dist_checkpointing itself (not
# megatron.training.checkpointing, which needs megatron's global args). Replaced or wrapped:
#   distrib_optimizer.py:838 / :1032 / :1193-1225  torch-Adam `step` handling (the two functions below)
#   filesystem_async.py:53-66 (get_write_results_queue)  the writer's result queue (set_write_results_queue)
# ---------------------------------------------------------------------------------------------
def _torch_optimizers(optimizer):
    """(megatron optimizer, inner torch optimizer) pairs under a possibly chained optimizer."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            yield opt, inner


def ensure_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer (no step taken yet) its Adam state before the load template is built.

    megatron/core/optimizer/distrib_optimizer.py:838-840 (DistributedOptimizer.state_dict, reached
    from sharded_state_dict(is_loading=True) at :1460) reads `step` from every param's torch-Adam
    state and asserts it is one value: a fresh optimizer has no state. The optimizer's own
    init_state_fn (megatron/core/optimizer/__init__.py:588) creates exp_avg/exp_avg_sq but no
    `step`; we add step=0 (overwritten by the load). Non-distributed optimizers call init_state_fn
    themselves (optimizer.py:1362) and are left alone."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt, inner in _torch_optimizers(optimizer):
        if not isinstance(opt, DistributedOptimizer) or len(inner.state) > 0:
            continue
        if opt.init_state_fn is not None:
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0))


def restore_optimizer_step(optimizer, loaded_state) -> None:
    """After DistributedOptimizer.load_state_dict, make every param's torch-Adam `step` the
    checkpoint's step.

    megatron/core/optimizer/distrib_optimizer.py:1032 puts the checkpoint's step (saved in
    param_groups, :838) into the packed state, but the parameter-state load that follows (:1084
    load_parameter_state_from_dp_reshardable -> :1193-1225 _set_main_param_and_optimizer_states)
    copies every tensor of the current per-param state, `step` included, from the loaded shards, and
    the per-param step does not come back as the true one: without this, the tiny GPT's losses after
    a resume differ from iteration 2 after the resume on (measured). The step held in the loaded
    param_groups is the true one."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    del loaded_state  # the loaded param_groups are already in the inner optimizer
    for opt, inner in _torch_optimizers(optimizer):
        if not isinstance(opt, DistributedOptimizer):
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if p in inner.state:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]))


# ---------------------------------------------------------------------------------------------
# sharded parameters (issue 6)
#
# megatron-core's distributed optimizer already keeps every parameter as a view into a contiguous
# per-(dtype, expert/dense) buffer and communicates per bucket, coalesced:
#   megatron/core/distributed/param_and_grad_buffer.py:504-521  param all-gather, one
#     all_gather_into_tensor per bucket written straight into bucket.param_data (params are views
#     of it: :1288-1302), inside _coalescing_manager (one c10d allgather_into_tensor_coalesced).
#   param_and_grad_buffer.py:702-730  grad reduce-scatter, one per bucket, coalesced the same way.
# Measured on our MoE recipes (scripts/bench_gather.py), one thing in that path is per PARAMETER:
#   param_and_grad_buffer.py:301-337  _ParamAndGradBucketGroup._post_param_sync, run after every
#     param all-gather (finish_param_sync :592 with overlap_param_gather; via
#     distributed_data_parallel.py:516-532 _start_bucket_group_param_sync without it), scans every
#     param of the bucket group with _param_uses_quantized_storage (:81), whose
#     is_grouped_tensor_with_quantized_storage (megatron/core/fp8_utils.py:144-150) reads
#     `param.data` (fp8_utils.py:112): one aten.detach per parameter per step, 2 per expert per layer
#     with SequentialMLP, so host ops grew linearly with the number of experts.
#   distributed_data_parallel.py:432-466  the forward pre-hook (overlap_param_gather) registered on
#     EVERY module calls finish_param_sync once per parameter of that module, every micro-batch:
#     2 calls per expert per layer per micro-batch, almost all of them no-ops after the first.
# Wrapped (the DeepSpeed lessons: treat a leaf module's many small params as one unit; do no host
# work per parameter once the gathered buffer is in place):
#   _post_param_sync: decides once per bucket group whether it holds any quantized param (a param's
#     storage class does not change after DDP has mapped it into the buffer) and, when none, returns
#     without the scan. With quantized params, or reuse_grad_buf_for_mxfp8_param_ag, the original
#     runs unchanged.
#   DistributedDataParallel._make_forward_pre_hook (:432): the hook maps its module to the distinct
#     bucket groups of its params once (cached per module), and calls finish_param_sync only for a
#     group whose all-gather is not finished yet (dispatched with no handle outstanding is exactly
#     the state in which upstream's call does nothing, :558-592). Same waits, same dispatch order.
#     Hooks already registered are re-registered by install/remove (enable_forward_pre_hook :400).
#   megatron/core/optimizer/distrib_optimizer.py:3129-3156
#     DistributedOptimizer.start_param_sync_for_bucket_group_subset, the synchronous param
#     all-gather after the step (without overlap_param_gather, :3158-3190): it all-gathers EVERY
#     bucket group of its model chunks. An MoE model has two distributed optimizers on the same
#     chunk (dense and expert, chained: optimizer.py:1635-1644), so every buffer was all-gathered
#     twice per step (measured: 4 all-gathers for 2 buffers), the first time before its own
#     optimizer had updated it. Wrapped: each optimizer gathers only the bucket groups whose buckets
#     belong to its own buffers (self.buffers, :710); the layer-wise exclusion is kept.
# ---------------------------------------------------------------------------------------------
def _reregister_forward_pre_hooks(model) -> None:
    for chunk in model or ():
        if getattr(chunk, "use_forward_hook", False) and chunk.remove_forward_pre_hook_handles:
            chunk.disable_forward_pre_hook(param_sync=False)
            chunk.enable_forward_pre_hook()


def _install_forward_pre_hook_seam() -> None:
    from megatron.core.distributed import distributed_data_parallel as ddp_mod

    cls = ddp_mod.DistributedDataParallel
    orig = cls.__dict__["_make_forward_pre_hook"]
    if getattr(orig, "_megatron_ext_sharded_params", False):
        return

    def _make_forward_pre_hook(self):
        groups_of = {}  # module -> distinct bucket groups of its params, in param order

        def hook(module, *unused):
            assert self.use_forward_hook, "Should use pre-hook only when overlap_param_gather is True"
            if ddp_mod.is_graph_capturing():
                return
            groups = groups_of.get(module)
            if groups is None:
                seen = {}
                for param in module.parameters(recurse=False):
                    group = self.param_to_bucket_group.get(param)
                    if group is not None:
                        assert param.requires_grad
                        seen.setdefault(id(group), group)
                groups = groups_of[module] = tuple(seen.values())
            if not groups:
                return
            skip_next = self.ddp_config.align_param_gather or self.overlap_param_gather_with_optimizer_step
            for group in groups:
                if group.param_gather_dispatched and group.param_gather_handle is None:
                    continue  # gathered already: upstream's finish_param_sync would do nothing
                group.finish_param_sync(skip_next_bucket_dispatch=skip_next)

        return hook

    _make_forward_pre_hook._megatron_ext_sharded_params = True
    _make_forward_pre_hook.__wrapped__ = orig
    cls._make_forward_pre_hook = _make_forward_pre_hook


def _install_own_buffers_param_sync_seam() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer.__dict__["start_param_sync_for_bucket_group_subset"]
    if getattr(orig, "_megatron_ext_sharded_params", False):
        return

    def start_param_sync_for_bucket_group_subset(self) -> None:
        own = {id(bucket) for buffer in getattr(self, "buffers", ()) for bucket in buffer.buckets}
        if not own:
            return orig(self)
        from megatron.core.optimizer.layer_wise_optimizer import _bucket_is_managed_by_layer_wise_optimizer

        for model_chunk in self.model_chunks:
            for bucket_group in model_chunk.bucket_groups + model_chunk.expert_parallel_bucket_groups:
                if not bucket_group.buckets or id(bucket_group.buckets[0]) not in own:
                    continue
                if _bucket_is_managed_by_layer_wise_optimizer(bucket_group.buckets[0], default_for_untagged=False):
                    continue
                model_chunk._start_bucket_group_param_sync(bucket_group, force_sync=False)

    start_param_sync_for_bucket_group_subset._megatron_ext_sharded_params = True
    start_param_sync_for_bucket_group_subset.__wrapped__ = orig
    DistributedOptimizer.start_param_sync_for_bucket_group_subset = start_param_sync_for_bucket_group_subset


def install_sharded_params_seams(model=None) -> None:
    """Idempotent. `model`: DDP chunks built before the install, whose forward pre-hooks are
    re-registered so they use the seam."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    _install_forward_pre_hook_seam()
    _install_own_buffers_param_sync_seam()
    _reregister_forward_pre_hooks(model)

    cls = pgb._ParamAndGradBucketGroup
    orig = cls.__dict__["_post_param_sync"]
    if getattr(orig, "_megatron_ext_sharded_params", False):
        return

    def _post_param_sync(self):
        if self.ddp_config.reuse_grad_buf_for_mxfp8_param_ag:
            return orig(self)
        quantized = self.__dict__.get("_megatron_ext_has_quantized_params")
        if quantized is None:
            quantized = any(
                pgb._param_uses_quantized_storage(p) for bucket in self.buckets for p in bucket.params_list
            )
            self._megatron_ext_has_quantized_params = quantized
        if quantized:
            return orig(self)
        return None

    _post_param_sync._megatron_ext_sharded_params = True
    _post_param_sync.__wrapped__ = orig
    cls._post_param_sync = _post_param_sync


def remove_sharded_params_seams(model=None) -> None:
    """Back to megatron-core's own code (for side-by-side measurements)."""
    from megatron.core.distributed import distributed_data_parallel as ddp_mod
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for cls, name in ((pgb._ParamAndGradBucketGroup, "_post_param_sync"),
                      (ddp_mod.DistributedDataParallel, "_make_forward_pre_hook"),
                      (DistributedOptimizer, "start_param_sync_for_bucket_group_subset")):
        fn = cls.__dict__[name]
        if getattr(fn, "_megatron_ext_sharded_params", False):
            setattr(cls, name, fn.__wrapped__)
    _reregister_forward_pre_hooks(model)


def sharded_params_seams_installed() -> bool:
    from megatron.core.distributed import param_and_grad_buffer as pgb

    return getattr(pgb._ParamAndGradBucketGroup.__dict__["_post_param_sync"], "_megatron_ext_sharded_params", False)


def set_write_results_queue(async_save: bool) -> None:
    """Choose the queue megatron-core's checkpoint writer reports its results through.

    megatron/core/dist_checkpointing/strategies/filesystem_async.py:53-66 (get_write_results_queue,
    called at :200 when a save is planned) creates one process-wide `spawn` Manager queue, built for
    the spawned persistent writer. That starts a server process on the first save (which re-imports
    the launching script, and which a daemonic process may not start at all). Without the persistent
    worker we set the module global `_results_queue` before each save: a plain queue.Queue for a
    synchronous save (the write runs in this process), a fork-context multiprocessing queue for the
    forked async writer. A writer already in flight keeps the queue it was planned with."""
    import multiprocessing as mp
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = mp.get_context("fork").Queue() if async_save else queue.Queue()


# ---------------------------------------------------------------------------------------------
# moe (issue 4: sync-free multihot token dispatcher, sync audit)
#
# Replaced (per instance, by --moe-sync-free-dispatcher, after the model is built):
#   MoELayer.token_dispatcher        transformer/moe/moe_layer.py:299-324 (built there; called at
#                                    :484 dispatch_preprocess, :498 token_dispatch, :541
#                                    dispatch_postprocess, :562 combine_preprocess, :572
#                                    token_combine, :583 combine_postprocess) and
#                                    MoELayer._training_token_dispatcher (:399, restored at :644)
#     -> megatron_ext.moe.dispatcher.MultihotTokenDispatcher, a subclass of MoETokenDispatcher
#        (token_dispatcher.py:61) standing in for MoEAllGatherTokenDispatcher (:230) and
#        MoEAlltoAllTokenDispatcher (:372). It reuses, unchanged: moe_utils.permute (:337),
#        unpermute (:470), get_capacity (:241); tensor_parallel all_to_all (mappings.py:558),
#        gather_from_sequence_parallel_region (:522), reduce_scatter_to_sequence_parallel_region (:536).
# Reference only (called unbound, never replaced): _DeepepManager._indices_to_multihot
#   (token_dispatcher.py:1328), the bit-equality oracle for megatron_ext.moe.indices_to_multihot.
# Wrapped only while a SyncDetector is active (CPU only, restored on exit):
#   token_dispatcher.maybe_move_tensor_to_cpu (imported token_dispatcher.py:39, defined
#     moe_utils.py:1169): on CPU it never copies; emulated as CUDA's non-blocking D2H copy
#   torch.cuda.Event / torch.cuda.Stream .synchronize and torch.cuda.synchronize (the platform's
#     CPU stand-ins; upstream waits at token_dispatcher.py:950): counted as explicit syncs
# Process-global state reset between jobs of a persistent worker:
#   MoEAuxLossAutoScaler.main_loss_backward_scale (moe_utils.py:287; created lazily as a 0-d tensor
#     by a bare MoELayer backward at :316, copied into by the schedule's set_loss_scale at :334 with
#     a [1] tensor -> a shape error when a training run follows a layer-only run, or vice versa)
# ---------------------------------------------------------------------------------------------
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


def reset_moe_aux_loss_scale() -> None:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
