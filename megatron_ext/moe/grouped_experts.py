"""megatron-core's SequentialMLP run as one grouped GEMM per linear, over per-expert row offsets that
stay on the device.

SequentialMLP (transformer/moe/experts.py:1318) splits its input by ``tokens_per_expert.tolist()``
(:1352), a host read of device counts. Here the rows of every local expert are contiguous, in
expert order, followed by padding rows up to a size fixed by host arithmetic, and each linear is
``torch._grouped_mm(x, w, offs=offsets)`` with ``offsets`` (the running row count, int32) a device
tensor: no host read, every shape fixed. Rows past the last offset are padding: excluded from the
products, their outputs and input gradients are zeros.

The rest of the expert is megatron's own ``MLP.forward`` (transformer/mlp.py:258: bias, activation,
GLU, probabilities, fc2 bias), called with grouped linears in place of the expert's linear_fc1 /
linear_fc2; its element-wise ops give the same values on one big buffer as on per-expert slices.
The products are the ones megatron's local linear computes per expert (tensor_parallel/layers.py:576
``x @ W.t()``, :626 ``dy @ W``, :677 ``dy.t() @ x``), with the same operand layouts, so on the
same rows in the same order they are bit-identical. LoRA adapters on the experts' linears run here
as grouped GEMMs too (their products are megatron's local linear's as well). Expert biases (gpt-oss) are gathered per row;
their gradient is a per-expert sum whose order the grouped path does not reproduce (equal to
rounding).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch


def _valid_rows(num_rows: int, offsets: torch.Tensor) -> torch.Tensor:
    """[rows, 1] bool: the row is one of an expert's (not padding). Device comparison, no read."""
    return (torch.arange(num_rows, device=offsets.device) < offsets[-1]).unsqueeze(1)


class _GroupedMatmul(torch.autograd.Function):
    """``y[rows of g] = x[rows of g] @ W_g.t()`` for every local expert g; padding rows -> 0."""

    @staticmethod
    def forward(ctx, x, offsets, *weights):
        w = torch.stack([wi.detach() for wi in weights])  # [G, out, in]
        valid = _valid_rows(x.shape[0], offsets)
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
        ctx.save_for_backward(x, offsets, w)
        return torch.where(valid, y, torch.zeros((), dtype=y.dtype, device=y.device))

    @staticmethod
    def backward(ctx, dy):
        x, offsets, w = ctx.saved_tensors
        valid = _valid_rows(x.shape[0], offsets)
        dy = torch.where(valid, dy, torch.zeros((), dtype=dy.dtype, device=dy.device)).contiguous()
        dx = torch.where(valid, torch._grouped_mm(dy, w, offs=offsets), torch.zeros((), dtype=x.dtype, device=x.device))
        if not any(ctx.needs_input_grad[2:]):  # frozen weights (LoRA's base): no weight gradient
            return (dx, None, *[None] * w.shape[0])
        dw = torch._grouped_mm(dy.t(), x, offs=offsets)  # [G, out, in]: dy_g.t() @ x_g, as layers.py:677
        return (dx, None, *dw.unbind(0))


class GroupedLinear(torch.nn.Module):
    """One linear of every local expert, as a module (offload hooks attach here). Holds the experts'
    linears in a plain list: not registered, so state dicts and parameter lists are unchanged."""

    def __init__(self, linears, name: str, owner):
        super().__init__()
        self._linears = list(linears)
        self.name = name
        self._owner = [owner]  # the SequentialMLP (in a list: not a registered child)
        self.offsets = self.row_expert = self.probs = None  # set per call by GroupedExperts

    def path_in(self, names: dict) -> str:
        """Its name under a module whose ``{id(module): name}`` map is ``names``."""
        return f"{names[id(self._owner[0])]}.grouped_experts.{self.name}"

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        float8 = getattr(self._linears[0], "float8", None)  # FP8 (megatron_ext/fp8, seams/fp8.py)
        if float8 is not None:
            from megatron_ext.seams.fp8 import float8_grouped_matmul

            y = float8_grouped_matmul(x2, self.offsets, self._linears)
        else:
            y = _GroupedMatmul.apply(x2, self.offsets, *[lin.weight for lin in self._linears])
        adapter = getattr(self._linears[0], "lora", None)  # LoRA (megatron_ext/lora/adapters.py)
        if adapter is not None:  # added before any bias, as on the expert's own linear
            y = y + adapter.grouped_delta(x2, self.offsets, self._linears, _GroupedMatmul.apply)
        y = y.view(*shape[:-1], y.shape[-1])
        if self._linears[0].bias is None:
            return y, None
        bias = torch.stack([lin.bias for lin in self._linears]).index_select(0, self.row_expert)
        if self.probs is None:  # fc1: the activation adds it (mlp.py:270/327)
            return y, bias
        # fc2: MLP.forward adds ``bias * probs`` to the output (mlp.py:345), which broadcasts only
        # for one bias vector; the same sum, per row, here
        return y + bias * self.probs.unsqueeze(-1), None


class GroupedExperts:
    """Attached to a SequentialMLP as ``experts.grouped_experts`` (a plain attribute): runs its
    forward on a fixed-size buffer with device-side per-expert counts."""

    def __init__(self, experts):
        self.experts = experts
        local = experts.local_experts
        self.linear_fc1 = GroupedLinear([e.linear_fc1 for e in local], "linear_fc1", experts)
        self.linear_fc2 = GroupedLinear([e.linear_fc2 for e in local], "linear_fc2", experts)
        first = local[0]
        # megatron's MLP.forward reads only these attributes of its module
        self._mlp = SimpleNamespace(config=first.config, activation_func=first.activation_func,
                                    linear_fc1=self.linear_fc1, linear_fc2=self.linear_fc2)

    def __call__(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        """``tokens_per_expert``: device counts [local experts]; rows beyond their sum are padding."""
        from megatron.core.transformer.mlp import MLP

        config = self._mlp.config
        if config.moe_apply_probs_on_input:  # as SequentialMLP.forward, experts.py:1326
            dtype = hidden.dtype
            hidden = (probs.unsqueeze(-1) * hidden).to(dtype)
            probs = torch.ones_like(probs)
        counts = tokens_per_expert.to(torch.int64)
        offsets = counts.cumsum(0).to(torch.int32)
        rows = hidden.shape[0]
        # expert of every row (padding rows: the last expert; their values never reach a product)
        row_expert = torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=torch.int32),
                                        right=True).clamp_(max=counts.numel() - 1)
        for lin in (self.linear_fc1, self.linear_fc2):
            lin.offsets, lin.row_expert = offsets, row_expert
        self.linear_fc2.probs = probs
        try:
            output, bias = MLP.forward(self._mlp, hidden, probs)
        finally:
            for lin in (self.linear_fc1, self.linear_fc2):
                lin.offsets = lin.row_expert = lin.probs = None
        assert bias is None
        # padding rows leave as zeros whatever a bias added (their probabilities are zero anyway)
        return torch.where(_valid_rows(rows, offsets), output, output.new_zeros(())), None


def attach(experts) -> GroupedExperts:
    grouped = getattr(experts, "grouped_experts", None)
    if grouped is None:
        grouped = GroupedExperts(experts)
        object.__setattr__(experts, "grouped_experts", grouped)
    return grouped
