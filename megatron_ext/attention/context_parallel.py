"""Core attention over a context-parallel group: plain torch with autograd, gloo (CPU) or NCCL (CUDA).

Every rank holds megatron's load-balanced share of the sequence (megatron.core.utils
get_batch_on_this_cp_rank): the sequence in 2 x CP chunks, rank r holding chunks r and 2·CP−1−r, in
that order. Queries, keys and values arrive [b, heads (or groups), s / CP, d] in that order, and the
output leaves in it. A given mask is megatron's (True = not attended) as the batch split leaves it:
this rank's query rows, every key column in natural order, [b or 1, 1, s / CP, s].

  all_gather   keys and values all-gathered (natural order), this rank's queries attend at their own
               positions: a causal layer without a mask as two kernels, each chunk over the keys up to
               its end with the causal triangle aligned to the bottom right (kernels.attend_lower_right);
               otherwise (a window, a packed row's documents, sinks, dropout: everything kernels.attend
               takes) one mask over the local rows. Backward: dK / dV reduce-scattered.
  p2p          ring attention: key / value blocks travel around the ring (asynchronous send / receive
               issued before each block's attention and waited after it), partial outputs merged by
               their log-sum-exp; backward sends dK / dV around the ring after the blocks. With the
               load-balanced split every block is one unmasked rectangle or the local causal triangle:
               fully masked halves are never computed. Causal layers without a mask, window or sink
               (a packed row's documents and windows: all_gather or a2a express them).
  a2a          Ulysses: an all-to-all from sequence-sharded to head-sharded queries, keys and values,
               full-sequence attention (kernels.attend, everything it takes) on heads / CP heads, an
               all-to-all back. Query groups fewer than CP are repeated to CP (when CP is a multiple of
               them); heads and groups otherwise divisible by CP (config/rules.py checks).

The per-block kernel of p2p is torch's own flash attention returning its log-sum-exp (CPU:
``_scaled_dot_product_flash_attention_for_cpu``; CUDA: the memory-efficient kernel), and its backward
the matching backward op given the merged output and log-sum-exp: exactly the block's share of the
gradients.

``OneRank(cp, rank)`` in place of the group runs one rank's share on one device, each collective
replaced by a local copy of the same size that gives what the rank would receive if every rank held
this rank's inputs: the per-rank kernel time of each comm type on one GPU (scripts/gpu_check.py).
Inside ``simulated(cp)`` the torch attention of a model built without CP attends so, as rank 0 of
``cp``, with its layer's --cp-comm-type: what a CP rank keeps for backward, for the planner's trace.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.attention import kernels

COMM_TYPES = ("p2p", "all_gather", "a2a")


# ------------------------------------------------------------------------------------------ positions
@functools.lru_cache(maxsize=32)
def _positions(local: int, cp: int, rank: int, device: str) -> torch.Tensor:
    """The global positions of a rank's tokens under the load-balanced split."""
    half = local // 2
    chunks = (rank, 2 * cp - 1 - rank)
    return torch.cat([torch.arange(c * half, (c + 1) * half) for c in chunks]).to(device)


def positions(local: int, cp: int, rank: int, device) -> torch.Tensor:
    return _positions(local, cp, rank, str(torch.device(device)))


@functools.lru_cache(maxsize=32)
def _natural(local: int, cp: int, device: str) -> torch.Tensor:
    """Index putting the rank-ordered concatenation of every rank's tokens in sequence order."""
    gathered = torch.cat([_positions(local, cp, r, "cpu") for r in range(cp)])
    return torch.argsort(gathered).to(device)


def _keep_rows(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, window) -> torch.Tensor | None:
    """[sq, sk] bool (True = attended) of a causal layer / window at the given positions, as
    kernels.attend applies them (a window replaces the triangle); None for neither."""
    q, k = qpos.view(-1, 1), kpos.view(1, -1)
    if window is not None:
        return (k >= q - int(window[0])) & (k <= q + int(window[1]))
    if causal:
        return k <= q
    return None


# -------------------------------------------------------------------------------------- collectives
@dataclasses.dataclass(frozen=True)
class OneRank:
    """Rank ``rank`` of a CP group of ``cp`` simulated on one device (see the module doc)."""
    cp: int
    rank: int


_SIMULATED: contextvars.ContextVar = contextvars.ContextVar("megatron_ext_simulated_cp_rank", default=None)


@contextlib.contextmanager
def simulated(cp: int):
    """Torch attention built without CP attends as rank 0 of ``cp`` (``OneRank``) inside the block."""
    token = _SIMULATED.set(OneRank(cp, 0) if cp > 1 else None)
    try:
        yield
    finally:
        _SIMULATED.reset(token)


def simulated_group() -> OneRank | None:
    return _SIMULATED.get()


def _size_rank(group) -> tuple:
    if isinstance(group, OneRank):
        return group.cp, group.rank
    return dist.get_world_size(group), dist.get_rank(group)


def _gloo(group) -> bool:
    return not isinstance(group, OneRank) and dist.get_backend(group) == "gloo"


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """[*] -> [cp, *]."""
    cp, _ = _size_rank(group)
    if isinstance(group, OneRank):
        return x.unsqueeze(0).expand(cp, *x.shape).contiguous()
    out = x.new_empty((cp * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out.view(cp, *x.shape)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """[cp, *] -> [*]: this rank's slot summed over ranks."""
    if isinstance(group, OneRank):
        return x[group.rank] * group.cp
    if _gloo(group):  # gloo has no reduce-scatter
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x[dist.get_rank(group)].clone()
    out = x.new_empty(x.shape[1:])
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """x [b, g, s / CP, d] -> [cp, b, g, s / CP, d]; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """[cp, *]: slot j sent to rank j; slot i of the result came from rank i."""
    if isinstance(group, OneRank):
        return x[group.rank].unsqueeze(0).expand_as(x).contiguous()
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _Blocks(torch.autograd.Function):
    """Blocks of ``x`` copied into a new tensor of ``shape``: ``moves``, pairs (destination index, source
    index), cover both once. Backward the same moves reversed. One pass each way with no zero fill
    (index_select's backward is an index_add into zeros)."""

    @staticmethod
    def forward(ctx, x, shape, moves):
        ctx.moves, ctx.shape = moves, x.shape
        out = x.new_empty(shape)
        for dst, src in moves:
            out[dst].copy_(x[src])
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(ctx.shape)
        for dst, src in ctx.moves:
            out[src].copy_(grad[dst])
        return out, None, None


def _chunks_in_order(cp: int, local: int) -> list:
    """(chunk, rank, slot) for the 2·CP chunks of the sequence in order: chunk c is rank c's first
    half (slot 0) or rank 2·CP−1−c's second (slot 1), each ``local // 2`` long."""
    return [(c, c, 0) if c < cp else (c, 2 * cp - 1 - c, 1) for c in range(2 * cp)]


def _rank_major_to_sequence(x: torch.Tensor) -> torch.Tensor:
    """[cp, b, n, local, d] (every rank's tokens, rank by rank) -> [b, n, cp·local, d] in sequence order."""
    cp, b, n, local, d = x.shape
    half, every = local // 2, slice(None)
    moves = [((every, every, slice(c * half, (c + 1) * half)), (r, every, every, slice(j * half, (j + 1) * half)))
             for c, r, j in _chunks_in_order(cp, local)]
    return _Blocks.apply(x, (b, n, cp * local, d), moves)


def _sequence_to_rank_major(x: torch.Tensor, cp: int) -> torch.Tensor:
    """The inverse of _rank_major_to_sequence: [b, n, s, d] -> [cp, b, n, s / cp, d]."""
    b, n, s, d = x.shape
    local = s // cp
    half, every = local // 2, slice(None)
    moves = [((r, every, every, slice(j * half, (j + 1) * half)), (every, every, slice(c * half, (c + 1) * half)))
             for c, r, j in _chunks_in_order(cp, local)]
    return _Blocks.apply(x, (cp, b, n, local, d), moves)


class _AllToAll(torch.autograd.Function):
    """All-to-all over stacked slots; its adjoint is the same all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


# ---------------------------------------------------------------------------------------- all_gather
def _local_mask(mask, local, cp, rank, causal, window, device):
    """megatron's mask (True = not attended) for this rank's query rows over the natural keys."""
    qpos, kpos = positions(local, cp, rank, device), torch.arange(local * cp, device=device)
    keep = _keep_rows(qpos, kpos, causal and mask is None, window)
    if mask is None:
        return None if keep is None else ~keep.view(1, 1, local, local * cp)
    if keep is None:
        return mask
    return kernels._derived(mask, ("cp_window", window), lambda: mask | ~keep.view(1, 1, local, local * cp))


@functools.lru_cache(maxsize=16)
def _causal_mask(local, cp, rank, window, device):
    return _local_mask(None, local, cp, rank, True, window, device)


def all_gather_attention(q, k, v, *, group, scale, causal, mask=None, window=None, sink=None, dropout_p=0.0):
    (cp, rank), local = _size_rank(group), q.shape[2]

    def gather(x):  # [b, g, local, d] -> [b, g, s, d] in sequence order
        return _rank_major_to_sequence(_GatherSequence.apply(x, group))  # from [cp, b, g, local, d]

    window = None if window is None else (int(window[0]), int(window[1]))
    if causal and mask is None and window is None and sink is None and dropout_p == 0.0:
        return _causal_chunks(q, gather(k), gather(v), cp, rank, scale)
    if mask is None:
        given = _causal_mask(local, cp, rank, window, str(q.device)) if (causal or window) else None
    else:
        given = _local_mask(mask, local, cp, rank, causal, window, q.device)
    return kernels.attend(q, gather(k), gather(v), scale=scale, causal=False, mask=given, sink=sink,
                          dropout_p=dropout_p)


class _Prefixes(torch.autograd.Function):
    """The prefixes ``x[:, :, :end]`` for each of ``ends`` (ascending), as views; backward sums their
    gradients into one tensor: the longest's, the others added to its start (slicing's own backward
    would make a zero-filled whole tensor per prefix and add them)."""

    @staticmethod
    def forward(ctx, x, ends):
        ctx.ends, ctx.length = ends, x.shape[2]
        return tuple(x[:, :, :end] for end in ends)

    @staticmethod
    def backward(ctx, *grads):
        longest = grads[-1]
        if ctx.ends[-1] == ctx.length:
            out = longest.clone()
        else:
            out = longest.new_zeros(*longest.shape[:2], ctx.length, longest.shape[3])
            out[:, :, :ctx.ends[-1]].copy_(longest)
        for end, grad in zip(ctx.ends[:-1], grads[:-1]):
            out[:, :, :end].add_(grad)
        return out, None


def _causal_chunks(q, k, v, cp, rank, scale):
    """A causal layer's all_gather attention without a mask: each of the rank's two chunks (r, then
    2·CP−1−r) attends the keys up to its own end, causal aligned to the bottom right. Two kernels over
    exactly the rank's share of the causal pairs, no mask tensor (flash's own causal on CUDA)."""
    half = q.shape[2] // 2
    chunks = (rank, 2 * cp - 1 - rank)
    ends = tuple((c + 1) * half for c in chunks)
    keys, values = _Prefixes.apply(k, ends), _Prefixes.apply(v, ends)
    queries = q.split(half, dim=2)  # its backward concatenates the chunks' gradients, one pass
    return torch.cat([kernels.attend_lower_right(queries[i], keys[i], values[i], scale=scale) for i in range(2)],
                     dim=2)


# ----------------------------------------------------------------------------------------------- a2a
def _to_heads(x, group):
    """[b, h, local, d] (sequence-sharded) -> [b, h / cp, s, d] (head-sharded), sequence order."""
    (cp, _), (b, h, local, d) = _size_rank(group), x.shape
    send = x.view(b, cp, h // cp, local, d).transpose(0, 1)  # slot j: heads of rank j
    recv = _AllToAll.apply(send, group)  # slot i: rank i's tokens of my heads
    return _rank_major_to_sequence(recv)


def _to_sequence(x, group):
    """The inverse of _to_heads: [b, h / cp, s, d] -> [b, h, local, d]."""
    (cp, _), (b, hp, s, d) = _size_rank(group), x.shape
    send = _sequence_to_rank_major(x, cp)  # slot j: rank j's tokens
    recv = _AllToAll.apply(send, group)  # slot i: heads of rank i
    return recv.transpose(0, 1).reshape(b, cp * hp, s // cp, d)


def _full_mask(mask, group, local, cp):
    """The whole [b or 1, 1, s, s] mask from every rank's query rows (once per micro-batch)."""
    def make():
        rows = _all_gather(mask.to(torch.uint8), group)  # [cp, b, 1, local, s]
        full = rows.permute(1, 2, 0, 3, 4).reshape(*mask.shape[:2], cp * local, mask.shape[-1])
        return full.index_select(2, _natural(local, cp, str(mask.device))).bool()
    return kernels._derived(mask, ("cp_full", cp), make)


def a2a_attention(q, k, v, *, group, scale, causal, mask=None, window=None, sink=None, dropout_p=0.0):
    (cp, rank), h, g, local = _size_rank(group), q.shape[1], k.shape[1], q.shape[2]
    if g < cp:  # each rank's heads read one group: the groups repeated to CP
        k, v = k.repeat_interleave(cp // g, dim=1), v.repeat_interleave(cp // g, dim=1)
    if sink is not None:
        sink = sink.view(cp, h // cp)[rank]
    full = None if mask is None else _full_mask(mask, group, local, cp)
    out = kernels.attend(_to_heads(q, group), _to_heads(k, group), _to_heads(v, group), scale=scale,
                         causal=causal, mask=full, window=window, sink=sink, dropout_p=dropout_p)
    return _to_sequence(out, group)


# ----------------------------------------------------------------------------------------------- p2p
def _block_forward(q, k, v, scale, causal):
    """One block: (output, log-sum-exp fp32 [b, h, sq])."""
    if q.is_cuda:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]].float()
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float()


def token_major(x: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] over a [b, s, h, d]-contiguous buffer: the layout the CUDA memory-efficient kernel
    gives its output, and the only one its backward reads the output in (it assumes the output's
    row stride is heads x head size; a [b, h, s, d]-contiguous output is read out of bounds)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def efficient_backward_args(dout, q, k, v, out, lse):
    """The memory-efficient backward's tensors: the output and its gradient token-major, the
    log-sum-exp padded to a multiple of 32 rows (as its forward returns it), no dropout's seed."""
    padded = F.pad(lse, (0, -(-lse.shape[-1] // 32) * 32 - lse.shape[-1]))
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    return token_major(dout), q, k, v, None, token_major(out), padded, zero, zero


def _block_backward(dout, q, k, v, out, lse, scale, causal):
    """The block's share of dq, dk, dv given the merged output and log-sum-exp."""
    if q.is_cuda:
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            *efficient_backward_args(dout, q, k, v, out, lse), 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _ring_exchange(tensor, group):
    """Send ``tensor`` to the next rank, receive the previous rank's: (buffer, requests to wait)."""
    if isinstance(group, OneRank):
        return tensor.clone(), ()
    cp, rank = _size_rank(group)
    buffer = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % cp), group),
           dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, (rank - 1) % cp), group)]
    return buffer, dist.batch_isend_irecv(ops)


def _arrived(exchange):
    buffer, requests = exchange
    for request in requests:
        request.wait()
    return buffer


def _ring_blocks(rank, cp, step, half):
    """(query rows, key rows, causal) of step ``step``'s block: the local triangle, all queries over
    the first key chunk (an earlier rank's), or the second query chunk over all keys (a later one's)."""
    source = (rank - step) % cp
    if step == 0:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _repeat(x, n):
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def _fold(dx, n):
    """A repeated-group gradient summed back onto its groups."""
    if n == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // n, n, s, d).sum(2)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        cp, rank = _size_rank(group)
        half, n = q.shape[2] // 2, q.shape[1] // k.shape[1]
        kv = torch.stack([k, v]).contiguous()
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(cp):
            pending = _ring_exchange(kv, group) if step < cp - 1 else None
            rows, cols, causal = _ring_blocks(rank, cp, step, half)
            o, l = _block_forward(q[:, :, rows], _repeat(kv[0][:, :, cols], n), _repeat(kv[1][:, :, cols], n),
                                  scale, causal)
            merged = torch.logaddexp(lse[:, :, rows], l)
            out[:, :, rows] = out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).unsqueeze(-1) \
                + o.float() * torch.exp(l - merged).unsqueeze(-1)
            lse[:, :, rows] = merged
            if pending is not None:
                kv = _arrived(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = _size_rank(group)
        half, n = q.shape[2] // 2, q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        in_flight = None  # the gradients of the block before, travelling one step behind its keys
        for step in range(cp):
            pending = _ring_exchange(kv, group) if step < cp - 1 else None
            rows, cols, causal = _ring_blocks(rank, cp, step, half)
            bq, bk, bv = _block_backward(
                dout[:, :, rows], q[:, :, rows], _repeat(kv[0][:, :, cols], n), _repeat(kv[1][:, :, cols], n),
                out[:, :, rows], lse[:, :, rows].contiguous(), scale, causal)
            dq[:, :, rows] += bq.float()
            if in_flight is not None:
                dkv = _arrived(in_flight)
            dkv[0][:, :, cols] += _fold(bk.float(), n)
            dkv[1][:, :, cols] += _fold(bv.float(), n)
            in_flight = _ring_exchange(dkv, group)
            if pending is not None:
                kv = _arrived(pending)
        dkv = _arrived(in_flight)  # this rank's own, from the previous rank
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q, k, v, *, group, scale):
    dv, d = v.shape[-1], q.shape[-1]
    if dv != d:  # multi-latent attention's narrower values, zero-padded (the kernels take one head size)
        v = F.pad(v, (0, d - dv))
    return _Ring.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, scale)[..., :dv]


def attend(comm_type: str, q, k, v, *, group, scale, causal, mask=None, window=None, sink=None, dropout_p=0.0):
    """kernels.attend's contract over the context-parallel ``group`` (see the module doc)."""
    if comm_type == "p2p":
        assert causal and mask is None and window is None and sink is None and dropout_p == 0.0, (
            "p2p context parallelism takes a causal layer without a mask, window, sink or dropout")
        return ring_attention(q, k, v, group=group, scale=scale)
    fn = {"all_gather": all_gather_attention, "a2a": a2a_attention}[comm_type]
    return fn(q, k, v, group=group, scale=scale, causal=causal, mask=mask, window=window, sink=sink,
              dropout_p=dropout_p)
