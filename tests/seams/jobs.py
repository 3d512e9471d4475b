"""Job functions for the seam tests (run on every rank of a gloo world, see tests/dist.py)."""
from __future__ import annotations

import math

import torch

import arguments


def latent_attention_against_formula() -> dict:
    """MLA's core attention on the local spec (seams.architectures.LocalLatentAttention), against
    causal softmax attention written out from its definition, with key and value head sizes that
    differ from each other and from --kv-channels; and megatron's own DotProductAttention refusing
    them without the seam."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.seams import architectures
    from megatron_ext.training import parallel

    parallel.initialize()
    try:
        heads, dk, dv, sq, b = 4, 24, 16, 8, 2
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, kv_channels=16,
                                   attention_dropout=0.0, masked_softmax_fusion=False)
        kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                      softmax_scale=0.125, k_channels=dk, v_channels=dv)
        try:
            LocalSpecProvider().core_attention()(**kwargs)
            refused = False
        except TypeError:
            refused = True
        with architectures.LOCAL_LATENT_ATTENTION.applied():
            attention = LocalSpecProvider().core_attention()(**kwargs)
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(sq, b, heads, dk, generator=g) for _ in range(2))
        v = torch.randn(sq, b, heads, dv, generator=g)
        mask = torch.ones(sq, sq, dtype=torch.bool).triu(1)[None, None]
        out = attention(q, k, v, mask)
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) * 0.125
        probs = scores.masked_fill(mask, -math.inf).softmax(-1)
        ref = torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(sq, b, heads * dv)
        return dict(refused_without_seam=refused, shape=tuple(out.shape),
                    max_err=(out - ref).abs().max().item())
    finally:
        parallel.destroy()


def global_gradients(argv: list[str], seed: int = 7, without: str | None = None) -> dict:
    """One forward and backward of the run's model (local spec, no wrapper) on the same batch on every
    rank; every parameter's gradient assembled to its global shape from the model's own checkpoint
    entries (keys and offsets), as numpy arrays, on every rank. ``without``: a seam of
    megatron_ext.seams.architectures removed after the build (a negative control)."""
    import contextlib
    import io

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_ext.training.run import Run

    with contextlib.redirect_stdout(io.StringIO()):
        run = Run.from_argv(argv, exit_on_dry_run=False, parse=arguments.parse)
    with run:
        args = run.args
        chunk = run.build(wrap=False)[0]
        if without is not None:
            from megatron_ext.seams import architectures

            getattr(architectures, without).remove()  # the run's teardown removes nothing more
        g = torch.Generator().manual_seed(seed)
        s, b = args.seq_length, args.micro_batch_size
        tokens = torch.randint(0, args.padded_vocab_size, (b, s + 1), generator=g)
        positions = torch.arange(s).unsqueeze(0).expand(b, -1)
        chunk(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).sum().backward()
        from megatron.core import parallel_state

        for p in chunk.parameters():  # sequence-parallel replicas: summed over TP, as finalize_model_grads does
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                torch.distributed.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
        pieces = []
        for sh in chunk.sharded_state_dict().values():
            if isinstance(sh, ShardedTensor) and sh.data.grad is not None and sh.replica_id in (0, (0, 0, 0)):
                pieces.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), sh.prepend_axis_num,
                               sh.data.grad.detach().float().clone()))
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, pieces)
    full = {}
    for rank_pieces in gathered:
        for key, shape, offset, prepend, grad in rank_pieces:
            out = full.setdefault(key, torch.zeros(shape))
            index = tuple(slice(o, o + (1 if axis < prepend else grad.shape[axis - prepend]))
                          for axis, o in enumerate(offset))
            out[index] = grad.reshape(out[index].shape)
    return {k: v.numpy() for k, v in full.items()}
