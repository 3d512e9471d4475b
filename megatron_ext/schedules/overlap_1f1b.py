"""The 1F1B schedule with backward-forward overlap.

One function covers no pipelining (PP=1), 1F1B (PP>1) and interleaved 1F1B (PP>1 with model
chunks). Per rank, with V = num_microbatches x num_chunks virtual micro-batches in megatron's
schedule-table order:

    warmup    W forwards
    steady    (F[k+W] || B[k]) for every k while forwards remain   <- the overlapped pairs
    cooldown  the remaining backwards

W = 2 (PP - rank - 1) + (chunks - 1) * group + 1 is megatron's interleaved warmup plus one
(upstream's combined 1F1B uses the same "+1", `schedules.py:937-943`): the extra forward makes the
forward and backward of every steady pair independent, on the last stage too (plain 1F1B pairs
F[k] with B[k] there), and the factor 2 lets adjacent stages run their pairs concurrently
(stage r's pair k needs stage r+1's pair k and stage r+1's pair k needs stage r's pair k-2).
Without pipelining this is simply F0, (F1||B0), (F2||B1), ..., B[n-1].

Inside a pair the two passes run as cooperative lanes (lanes.py) that switch at TP collectives.
Each pass is megatron's own `forward_step` / `backward_step` on the same inputs; the backwards run
in the plain order (B0, B1, ... per chunk) and never overlap each other, so every gradient is
accumulated into main_grad in the same order as in the plain schedule: bit-identical results.

Pipeline p2p: activations and gradients travel on two communicators of their own (_p2p_groups),
each message also tagged with (kind, receiving chunk, micro-batch). Receives are posted before a
pair starts; sends are issued as soon as a pass ends and never waited on eagerly.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Union

import torch
import torch.distributed as dist

from megatron_ext.schedules import lanes


STATS = {"calls": 0, "pairs": 0}  # how often the overlapped schedule ran (tests, logs)
_P2P_GROUPS: dict = {}


def _p2p_groups(pp_group):
    """Two communicators over the ranks of this pipeline: one for activations, one for gradients.
    Within one of them, messages between two ranks flow in one direction per kind and in the same
    order on both sides, so they match without tags (NCCL ignores tags; gloo uses them too).
    Every rank creates every pipeline's pair, in the same order (new_group is collective)."""
    world = dist.get_world_size()
    mine = tuple(dist.get_process_group_ranks(pp_group))
    key = (world, mine)
    if key not in _P2P_GROUPS:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        for ranks in sorted(set(gathered)):
            pair = (dist.new_group(list(ranks)), dist.new_group(list(ranks)))
            _P2P_GROUPS[(world, ranks)] = pair
    return _P2P_GROUPS[key]


def _warmup(pp: int, rank: int, chunks: int, group: int, total: int) -> int:
    return min(total, 2 * (pp - rank - 1) + (chunks - 1) * group + 1)


def plan(num_microbatches: int, chunks: int, pp: int, rank: int, group: Optional[int] = None):
    """The per-rank event list: ("F", v) / ("B", v) / ("FB", v_f, v_b). Pure; tested directly."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    group = group if (group and chunks > 1) else num_microbatches
    table = get_schedule_table(num_microbatches, chunks, group)
    total = len(table)
    w = _warmup(pp, rank, chunks, group, total)
    events = [("F", v) for v in range(w)]
    f, b = w, 0
    while b < total:
        if f < total:
            events.append(("FB", f, b))
            f += 1
        else:
            events.append(("B", b))
        b += 1
    return table, events


def forward_backward_overlap(
    *,
    forward_step_func,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: Optional[bool] = False,
):
    """Same keyword arguments and return value as megatron's forward_backward_* functions."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules as S
    from megatron.core.utils import get_model_config

    kwargs = dict(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=seq_length,
        micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
        forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step, adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
        p2p_communicator=p2p_communicator, pg_collection=pg_collection,
        force_all_reduce=force_all_reduce,
    )
    if forward_only:  # nothing to overlap: evaluation runs the plain schedule
        return S.get_forward_backward_func()(**kwargs)
    if adjust_tensor_shapes_fn is not None or p2p_communicator is not None:
        raise NotImplementedError(
            "--overlap-tp-comm-1f1b: custom p2p_communicator / adjust_tensor_shapes_fn are not supported"
        )

    STATS["calls"] += 1  # its seams were installed with the run (megatron_ext/seams/schedules.py)
    lanes.set_groups()

    models = model if isinstance(model, list) else [model]
    iters = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    if len(iters) == 1 and len(models) > 1:
        iters = iters * len(models)
    chunks = len(models)
    config = get_model_config(models[0])
    if pg_collection is None:
        pg_collection = S._build_default_pg_collection()
    tp_group, cp_group = pg_collection.tp, pg_collection.cp

    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp = pp_group.size()
    rank = pp_group.rank()
    if chunks > 1 and pp == 1:
        raise ValueError("--overlap-tp-comm-1f1b: model chunks need pipeline parallelism")
    group_size = config.microbatch_group_size_per_vp_stage if chunks > 1 else num_microbatches
    if chunks > 1 and not (pp <= group_size <= num_microbatches):
        raise ValueError(
            f"microbatch_group_size_per_vp_stage={group_size} must be in [PP={pp}, M={num_microbatches}]"
        )
    table, events = plan(num_microbatches, chunks, pp, rank, group_size)
    total = len(table)
    first_stage, last_stage = rank == 0, rank == pp - 1
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank() if pp > 1 else None
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank() if pp > 1 else None
    act_group, grad_group = _p2p_groups(pp_group) if pp > 1 else (None, None)

    seq = decoder_seq_length if decoder_seq_length is not None else seq_length
    seq = seq // cp_group.size()
    if config.sequence_parallel:
        seq = seq // tp_group.size()
    p2p_shape = (seq, micro_batch_size, config.hidden_size)
    p2p_dtype = config.pipeline_dtype or config.params_dtype
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def fwd_id(v):
        mb, c = table[v]
        return mb, c

    def bwd_id(v):
        mb, c = table[v]
        return mb, chunks - 1 - c

    def is_first_virtual(c):
        return first_stage and c == 0

    def is_last_virtual(c):
        return last_stage and c == chunks - 1

    def tag(kind: int, chunk: int, mb: int) -> int:
        return 1 + (kind * chunks + chunk) * num_microbatches + mb

    # ---- p2p ---------------------------------------------------------------------------------
    pending_sends, act_sends, unsent_outputs = [], {}, set()

    def recv_act(mb, c):
        if is_first_virtual(c):
            return None
        t = torch.empty(p2p_shape, dtype=p2p_dtype, device=device, requires_grad=True)
        dist.recv(t, src=prev_rank, group=act_group, tag=tag(0, c, mb))
        return t

    def send_act(out, mb, c):
        if is_last_virtual(c):
            unsent_outputs.add((mb, c))
            return
        dst_chunk = c if not last_stage else c + 1
        act_sends[(mb, c)] = dist.isend(out.detach().contiguous(), dst=next_rank, group=act_group,
                                        tag=tag(0, dst_chunk, mb))

    def release_outputs(force_key=None):
        """megatron frees an output's data once it is sent (deallocate_pipeline_outputs); its
        backward then needs only the graph. Sends are never waited on eagerly (a rank blocked on
        a send its peer receives later would deadlock the interleaved order): completed ones are
        released here, and the one a backward is about to use is waited for (its receiver has
        consumed it: our gradient for it comes from there)."""
        for key in list(act_sends):
            work = act_sends[key]
            if key == force_key:
                work.wait()
            elif not work.is_completed():
                continue
            del act_sends[key]
            S.deallocate_output_tensor(outputs[key], config.deallocate_pipeline_outputs)
        if force_key is not None and force_key in unsent_outputs:
            unsent_outputs.discard(force_key)
            S.deallocate_output_tensor(outputs[force_key], config.deallocate_pipeline_outputs)

    def recv_grad(mb, c):
        if is_last_virtual(c):
            return None
        t = torch.empty(p2p_shape, dtype=p2p_dtype, device=device)
        dist.recv(t, src=next_rank, group=grad_group, tag=tag(1, c, mb))
        return t

    def send_grad(g, mb, c):
        if is_first_virtual(c) or g is None:
            return
        dst_chunk = c if not first_stage else c - 1
        g = g.contiguous()
        pending_sends.append((dist.isend(g, dst=prev_rank, group=grad_group, tag=tag(1, dst_chunk, mb)), g))

    # ---- grad sync (DDP no_sync), as megatron's schedules do it ------------------------------
    no_sync_func = config.no_sync_func
    if isinstance(no_sync_func, list):
        funcs = list(no_sync_func)

        def no_sync_func():
            stack = contextlib.ExitStack()
            for f in funcs:
                stack.enter_context(f())
            return stack

    if no_sync_func is None:
        no_sync_func = contextlib.nullcontext
    no_sync_context = None

    def disable_grad_sync():
        nonlocal no_sync_context
        if no_sync_context is None:
            no_sync_context = no_sync_func()
            no_sync_context.__enter__()

    def enable_grad_sync():
        nonlocal no_sync_context
        if no_sync_context is not None:
            no_sync_context.__exit__(None, None, None)
            no_sync_context = None

    grad_sync_func = config.grad_sync_func
    if grad_sync_func is not None and not isinstance(grad_sync_func, list):
        grad_sync_func = [grad_sync_func] * chunks
    if chunks > 1 and config.param_sync_func is not None:
        psf = config.param_sync_func
        psf = psf if isinstance(psf, list) else [psf] * chunks
        for c in range(chunks):
            psf[c](models[c].parameters())

    disable_grad_sync()

    # ---- the passes --------------------------------------------------------------------------
    forward_data_store: list = []
    total_num_tokens = torch.zeros([], dtype=torch.int, device=device)
    inputs, outputs = {}, {}
    cp_size = cp_group.size()

    def run_forward(v, input_tensor):
        mb, c = fwd_id(v)
        with lanes.owner(f"F{mb}" + (f".c{c}" if chunks > 1 else "")):
            out, num_tokens = S.forward_step(
                forward_step_func,
                iters[c],
                models[c],
                num_microbatches,
                input_tensor,
                forward_data_store,
                config,
                cp_size,
                collect_non_loss_data,
                checkpoint_activations_microbatch=None,
                is_first_microbatch=S.check_first_val_step(first_val_step, False, mb == 0),
                current_microbatch=mb,
                vp_stage=c if chunks > 1 else None,
                is_last_stage=is_last_virtual(c),
            )
        inputs[(mb, c)] = input_tensor
        outputs[(mb, c)] = out
        send_act(out, mb, c)
        return num_tokens

    def run_backward(v, output_grad):
        mb, c = bwd_id(v)
        input_tensor = inputs.pop((mb, c))
        out = outputs.pop((mb, c))
        with lanes.owner(f"B{mb}" + (f".c{c}" if chunks > 1 else "")):
            grad = S.backward_step(input_tensor, out, output_grad, config)
        send_grad(grad, mb, c)

    def before_backward(v):
        mb, _ = bwd_id(v)
        if grad_sync_func is None and mb == num_microbatches - 1:
            enable_grad_sync()

    for ev in events:
        if ev[0] == "F":
            mb, c = fwd_id(ev[1])
            total_num_tokens += run_forward(ev[1], recv_act(mb, c))
            release_outputs()
        elif ev[0] == "B":
            mb, c = bwd_id(ev[1])
            g = recv_grad(mb, c)
            release_outputs(force_key=(mb, c))
            before_backward(ev[1])
            run_backward(ev[1], g)
            disable_grad_sync()
        else:
            _, vf, vb = ev
            mbf, cf = fwd_id(vf)
            mbb, cb = bwd_id(vb)
            x = recv_act(mbf, cf)
            g = recv_grad(mbb, cb)
            release_outputs(force_key=(mbb, cb))
            before_backward(vb)
            pair = lanes.Pair(
                f"F{mbf}" + (f".c{cf}" if chunks > 1 else ""),
                f"B{mbb}" + (f".c{cb}" if chunks > 1 else ""),
            )
            STATS["pairs"] += 1
            num_tokens, _ = pair.run(lambda: run_forward(vf, x), lambda: run_backward(vb, g))
            total_num_tokens += num_tokens
            release_outputs()
            disable_grad_sync()

    enable_grad_sync()
    if grad_sync_func is not None:
        for c in range(chunks):
            grad_sync_func[c](models[c].parameters())

    for work, _keep in pending_sends:
        work.wait()
    pending_sends.clear()
    assert not act_sends and not unsent_outputs, "every output is released before its backward"

    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(
            models,
            total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
    lanes.reset_buffers()
    return forward_data_store
