"""Sync audit of one megatron-core MoELayer (router, dispatch, experts, combine), forward and
backward, with the standard or the multihot dispatcher: what CUDA would see, on a machine with no GPU
(megatron_ext/moe/sync_detector.py: host reads of device values, host tensors entering device ops,
ops that sync in the layer's dtype). Used by tests/moe, scripts/bench_dispatcher.py and
scripts/gpu_check.py. Run inside an initialised model-parallel world
(megatron_ext.training.parallel.initialize).

:func:`audit_sync_free` runs every (dispatcher, mode) this package claims sync-free (:data:`SYNC_FREE`)
and returns what the detector flagged; :func:`run_transformer_layer` does the same for the whole
transformer layer around the MoE layer (attention included)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from megatron_ext import platform
from megatron_ext.moe.sync_detector import SyncDetector, run_backward

# dropless-syncfree: dropless; ours runs the fixed-budget dispatcher with grouped experts
MODES = ("dropless", "capacity", "capacity-nopad", "dropless-syncfree")
DISPATCHERS = ("alltoall", "allgather")
# What this package claims runs with no host synchronisation (and so can be captured in a CUDA graph):
# the sync-free dispatcher with a capacity factor (any precision) and the zero-sync dropless mode (bf16:
# on CUDA, torch's grouped GEMM reads its offsets on the host in other precisions; the flag refuses them)
SYNC_FREE = tuple((d, m) for d in DISPATCHERS for m in ("capacity", "capacity-nopad", "dropless-syncfree"))
SYNC_FREE_DTYPE = "bfloat16"


@dataclass(frozen=True)
class LayerSpec:
    dispatcher: str = "alltoall"  # megatron's --moe-token-dispatcher-type: alltoall | allgather
    mode: str = "dropless"  # dropless | capacity (factor 1.0, pad to capacity) | capacity-nopad
    experts: int = 4
    topk: int = 2
    hidden: int = 32
    ffn: int = 64
    tp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    budget_factor: Optional[float] = None  # dropless-syncfree only (None: the worst case)
    shared_expert: bool = False  # a shared expert, overlapped with the dispatch (alltoall)
    routing: tuple = ()  # extra TransformerConfig fields, (name, value) pairs (router options)
    dtype: str = "float32"  # parameters and activations: float32 | bfloat16

    def config(self):
        from megatron.core.transformer.transformer_config import TransformerConfig

        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: expected one of {MODES}")
        capacity = self.mode.startswith("capacity")
        fields = dict(
            num_layers=1,
            hidden_size=self.hidden,
            num_attention_heads=4,
            ffn_hidden_size=self.ffn,
            moe_ffn_hidden_size=self.ffn,
            num_moe_experts=self.experts,
            moe_router_topk=self.topk,
            moe_token_dispatcher_type=self.dispatcher,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.01,
            moe_expert_capacity_factor=1.0 if capacity else None,
            moe_pad_expert_input_to_capacity=self.mode == "capacity",
            tensor_model_parallel_size=self.tp,
            sequence_parallel=self.tp > 1,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            use_cpu_initialization=not platform.current().is_cuda,  # on a GPU the weights are drawn there
            add_bias_linear=False,
            moe_shared_expert_intermediate_size=self.ffn if self.shared_expert else None,
            moe_shared_expert_overlap=self.shared_expert and self.dispatcher == "alltoall",
            params_dtype=getattr(torch, self.dtype),
            bf16=self.dtype == "bfloat16",
        )
        return TransformerConfig(**{**fields, **dict(self.routing)})


def build_layer(spec: LayerSpec, seed: int = 1234, ours: bool = False, grouped=None, whole: bool = False):
    """One MoELayer (``whole``: the transformer layer around it, attention included) of the local spec,
    with megatron's or (``ours``) the sync-free dispatcher; ``grouped``: the module whose ``attach`` runs
    the zero-sync experts (megatron_ext.moe.grouped_experts by default)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext import moe

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.experts, moe_grouped_gemm=False)
    config = spec.config()
    if whole:
        layer = layer_spec.module(config=config, submodules=layer_spec.submodules, layer_number=1)
    else:
        layer = layer_spec.submodules.mlp(config=config)
    if platform.current().is_cuda:
        layer = layer.cuda()
    zero_sync = spec.mode == "dropless-syncfree"
    layer.replaced = moe.install(layer, zero_sync=zero_sync, budget_factor=spec.budget_factor,
                                 grouped=grouped) if ours else 0
    return layer


def rank_inputs(spec: LayerSpec, seq: int = 16, batch: int = 2, seed: int = 0):
    """This rank's [seq/TP, batch, hidden] input and output-gradient (different on every rank)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    shape = (seq // spec.tp, batch, spec.hidden)
    device = platform.current().device
    dtype = getattr(torch, spec.dtype)
    x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    g = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return x, g


@dataclass
class LayerRun:
    out: torch.Tensor
    dx: torch.Tensor
    dw: Dict[str, torch.Tensor]
    syncs_forward: int
    syncs_backward: int
    sites: List[str] = field(default_factory=list)
    replaced: int = 0


def host_tensors(dispatcher) -> list:
    """Tensors the upstream alltoall dispatcher keeps on the host on a CUDA machine too
    (token_dispatcher.py:424: permute_idx_device is "cpu" without permute fusion)."""
    if getattr(dispatcher, "permute_idx_device", None) != "cpu":
        return []
    return [getattr(dispatcher, a) for a in ("sort_input_by_local_experts", "restore_output_by_local_experts")
            if hasattr(dispatcher, a)]


def run_layer(layer, x: torch.Tensor, g: torch.Tensor, detect: bool = True, padding_mask=None) -> LayerRun:
    """One forward + backward of ``layer`` (an MoELayer, or a transformer layer around one) under a
    :class:`SyncDetector`. ``padding_mask``: [batch, seq] bool, True = padding (megatron's MoELayer.forward
    argument)."""
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    det = SyncDetector()
    moe_layer = getattr(layer, "mlp", layer)
    with det if detect else _null():
        det.mark_host(*host_tensors(moe_layer.token_dispatcher))
        with det.phase("forward"):
            if moe_layer is layer:
                out, _ = layer(x, padding_mask=padding_mask)
            else:  # a transformer layer: causal self-attention (the local spec's default mask), then the MoE
                out, _ = layer(x, attention_mask=None)
        with det.phase("backward"):
            run_backward(out, g)
    dw = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return LayerRun(
        out=out.detach(),
        dx=x.grad.detach(),
        dw=dw,
        syncs_forward=det.count("forward"),
        syncs_backward=det.count("backward"),
        sites=[str(e) for e in det.events],
        replaced=getattr(layer, "replaced", 0),
    )


def audit_sync_free(ep: int = 1, dtype: str = SYNC_FREE_DTYPE, grouped=None, modes=SYNC_FREE, whole: bool = False,
                    **spec_fields) -> Dict[str, List[str]]:
    """What the detector flags, per ``"dispatcher/mode"``, in one forward + backward of our layer in each
    mode claimed sync-free, on this rank (world of ``ep`` ranks, expert parallel). Empty lists: CUDA would
    see no sync and nothing that breaks graph capture. ``grouped``: see :func:`build_layer`."""
    from megatron_ext import seams

    flagged = {}
    for dispatcher, mode in modes:
        spec = LayerSpec(dispatcher=dispatcher, mode=mode, ep=ep, dtype=dtype, **spec_fields)
        seams.reset_moe_aux_loss_scale()
        layer = build_layer(spec, seed=5, ours=True, grouped=grouped, whole=whole)
        x, g = rank_inputs(spec, seed=3)
        flagged[f"{dispatcher}/{mode}"] = run_layer(layer, x, g).sites
    seams.reset_moe_aux_loss_scale()
    return flagged


class ShapeTrace:
    """Every aten op a block runs, with its output shapes, forward and backward. Two runs with
    different routings giving the same trace = nothing in the layer depends on the data's routing:
    what a CUDA graph needs, checked without a GPU."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        trace = self.ops = []

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outs = out if isinstance(out, (list, tuple)) else [out]
                trace.append((str(func), tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor))))
                return out

        self._mode = _Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def trace_layer(layer, x: torch.Tensor, g: torch.Tensor) -> list:
    """Trace of one forward+backward (an MoELayer, or a transformer layer around one). Call once
    untraced first: the first backward creates megatron's aux-loss scale (moe_utils.py:316); grads are
    reset so none is accumulated."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    with ShapeTrace() as tr:
        out, _ = layer(x) if getattr(layer, "mlp", None) is None else layer(x, attention_mask=None)
        run_backward(out, g)
    return tr.ops


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
