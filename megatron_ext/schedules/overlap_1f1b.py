"""The 1F1B schedule with backward-forward overlap.

One function covers no pipelining (PP=1), 1F1B (PP>1) and interleaved 1F1B (PP>1 with model
chunks). Per rank, with V = num_microbatches x num_chunks virtual micro-batches in megatron's
schedule-table order:

    warmup    W forwards, two at a time where they may interleave (F[2i] || F[2i+1])
    steady    (F[k+W] || B[k]) for every k while forwards remain   <- the overlapped pairs
    cooldown  the remaining backwards

W = 2 (PP - rank - 1) + (chunks - 1) * group + 1 is megatron's interleaved warmup plus one
(upstream's combined 1F1B uses the same "+1", `schedules.py:937-943`): the extra forward makes the
forward and backward of every steady pair independent, on the last stage too (plain 1F1B pairs
F[k] with B[k] there), and the factor 2 lets adjacent stages run their pairs concurrently
(stage r's pair k needs stage r+1's pair k and stage r+1's pair k needs stage r's pair k-2).
Without pipelining this is simply F0, (F1||B0), (F2||B1), ..., B[n-1].

Warmup forwards pair when nothing makes two interleaved forwards differ from two in a row
(`warmup_pairs_why_not`): no dropout or router jitter (their random draws would come in another
order), no FP8 (its weights are cached by the first micro-batch's forward), no activation offload
(its hooks follow one forward at a time). The earlier forward starts and stays ahead (lanes.Pair);
a pair's receives come before it and its sends after it, in the schedule table's order. A pair
whose earlier forward drew random numbers all the same is an error, raised, never a silent change.

Inside a pair the two passes run as cooperative lanes (lanes.py) that switch at TP collectives.
Each pass is megatron's own `forward_step` / `backward_step` on the same inputs; the backwards run
in the plain order (B0, B1, ... per chunk) and never overlap each other, so every gradient is
accumulated into main_grad in the same order as in the plain schedule: bit-identical results.

Pipeline p2p (pipeline_plan.py: `steps`, a pure function the schedule executes and `program`
hands to the NCCL-rules checker in p2p.py): activations and gradients travel on communicators of
their own, one per kind and direction, so that on each one rank only sends and the other only
receives, in the schedule table's order (NCCL runs a communicator's ops in issue order and
matches sends to receives by that order alone). Before an event its receives are posted and waited
for; after it its sends are issued (activation first), never waited on eagerly: a send is waited
for only when its output is about to be back-propagated (its receiver has consumed it by then), the
rest at the end. Each message is also tagged with (kind, receiving chunk, micro-batch), for gloo
and for the reports.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Union

import torch
import torch.distributed as dist

from megatron_ext.schedules import group_kinds, lane_state, lanes
from megatron_ext.schedules.pipeline_plan import COMMS, DIRECTIONAL, comm_name, steps


STATS = {"calls": 0, "pairs": 0, "forward_pairs": 0, "pair_warmup": False}  # tests, logs
# the pipeline communicators' layout (pipeline_plan.py); tests set SHARED to show why not
P2P_LAYOUT = DIRECTIONAL
_P2P_GROUPS: dict = {}


def _p2p_groups(pp_group, layout: str) -> dict:
    """The pipeline's communicators ({name: group}, names from comm_name). Every rank creates
    every pipeline's set, in the same order (new_group is collective)."""
    world = dist.get_world_size()
    mine = tuple(dist.get_process_group_ranks(pp_group))
    names = COMMS if layout == DIRECTIONAL else ("act", "grad")
    key = (world, mine, layout)
    if key not in _P2P_GROUPS:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        for ranks in sorted(set(gathered)):
            _P2P_GROUPS[(world, ranks, layout)] = {n: dist.new_group(list(ranks)) for n in names}
    return _P2P_GROUPS[key]


def group_names() -> dict:
    """{process group name: communicator name} of this rank's pipeline communicators."""
    return {g.group_name: n for groups in _P2P_GROUPS.values() for n, g in groups.items()
            if isinstance(g, dist.ProcessGroup)}  # other pipelines' groups: NON_GROUP_MEMBER here


def warmup_pairs_why_not(config) -> Optional[str]:
    """Why the warmup's forwards may not interleave (None: they may); see the module doc."""
    from megatron_ext import offload

    if config.hidden_dropout > 0 or config.attention_dropout > 0:
        return "dropout draws random numbers in the forward: interleaved, two forwards would draw them in another order"
    if getattr(config, "moe_input_jitter_eps", None):
        return "--moe-input-jitter-eps draws random numbers in the forward"
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return "FP8/FP4 weights are quantised and cached by the first micro-batch's forward"
    if offload.current() is not None:
        return "activation offload follows one forward at a time"
    return None


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
    group_kinds.set_groups()
    from megatron_ext.seams.moe import per_pass_state

    lane_state.set_stateful(per_pass_state(model if isinstance(model, list) else [model]))
    group_kinds.GROUPS.hidden = get_model_config(model[0] if isinstance(model, list) else model).hidden_size

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
    layout = P2P_LAYOUT
    why_not = warmup_pairs_why_not(config)
    STATS["pair_warmup"] = why_not is None
    table, plan_steps = steps(num_microbatches, chunks, pp, rank, group_size, pair_warmup=why_not is None)
    last_stage = rank == pp - 1
    pp_ranks = dist.get_process_group_ranks(pp_group)
    me = pp_ranks[rank]
    comms = _p2p_groups(pp_group, layout) if pp > 1 else {}

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

    def is_last_virtual(c):
        return last_stage and c == chunks - 1

    def tag(kind: str, mb: int, chunk: int) -> int:
        return 1 + ((kind == "grad") * chunks + chunk) * num_microbatches + mb

    # ---- p2p: exactly the messages of `steps` -------------------------------------------------
    pending_sends, act_sends, unsent_outputs, freed = [], {}, set(), set()

    def post_recv(kind, mb, c, peer):
        t = torch.empty(p2p_shape, dtype=p2p_dtype, device=device, requires_grad=kind == "act")
        group = comms[comm_name(kind, pp_ranks[peer], me, layout)]
        return t, dist.irecv(t, src=pp_ranks[peer], group=group, tag=tag(kind, mb, c))

    def send(kind, mb, c, peer, tensor):
        group = comms[comm_name(kind, me, pp_ranks[peer], layout)]
        tensor = tensor.detach().contiguous()
        return dist.isend(tensor, dst=pp_ranks[peer], group=group, tag=tag(kind, mb, c)), tensor

    def release_outputs(force_key=None):
        """megatron frees an output's data once it is sent (deallocate_pipeline_outputs); its
        backward then needs only the graph. Sends are not waited on eagerly: completed ones are
        freed here, and the one a backward is about to use is waited for (its receiver has
        consumed it: our gradient for it comes from there)."""
        for key, work in list(act_sends.items()):
            forced = key == force_key
            if forced:
                work.wait()
                del act_sends[key]
            if key not in freed and (forced or work.is_completed()):
                freed.add(key)
                S.deallocate_output_tensor(outputs[key], config.deallocate_pipeline_outputs)
            if forced:
                freed.discard(key)
        if force_key is not None and force_key in unsent_outputs:
            unsent_outputs.discard(force_key)
            S.deallocate_output_tensor(outputs[force_key], config.deallocate_pipeline_outputs)

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

    def pass_label(kind: str, mb: int, c: int) -> str:
        return f"{kind}{mb}" + (f".c{c}" if chunks > 1 else "")

    def run_forward(v, input_tensor, store=forward_data_store):
        mb, c = fwd_id(v)
        with lanes.PassLabel(pass_label("F", mb, c)):
            out, num_tokens = S.forward_step(
                forward_step_func,
                iters[c],
                models[c],
                num_microbatches,
                input_tensor,
                store,
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
        if is_last_virtual(c):
            unsent_outputs.add((mb, c))
        return num_tokens

    def run_backward(v, output_grad):
        mb, c = bwd_id(v)
        input_tensor = inputs.pop((mb, c))
        out = outputs.pop((mb, c))
        with lanes.PassLabel(pass_label("B", mb, c)):
            return S.backward_step(input_tensor, out, output_grad, config)

    def label(v):
        return pass_label("F", *fwd_id(v))

    def run_forward_pair(va, vb, got):
        """Two warmup forwards interleaved; their losses stored in the table's order."""
        stores = ([], [])
        xa, xb = got.get(("act", *fwd_id(va))), got.get(("act", *fwd_id(vb)))
        pair = lanes.Pair(label(va), label(vb), two_forwards=True)
        STATS["forward_pairs"] += 1
        na, nb = pair.run(lambda: run_forward(va, xa, stores[0]), lambda: run_forward(vb, xb, stores[1]))
        if pair.earlier_drew_random():
            raise RuntimeError(
                f"--overlap-tp-comm-1f1b: the forward of {label(va)} drew random numbers, so {label(vb)} "
                "interleaved with it drew other ones than after it; warmup_pairs_why_not "
                "(schedules/overlap_1f1b.py) must name what draws them")
        forward_data_store.extend(stores[0] + stores[1])
        return na + nb

    def before_backward(v):
        mb, _ = bwd_id(v)
        if grad_sync_func is None and mb == num_microbatches - 1:
            enable_grad_sync()

    for step in plan_steps:
        ev = step.event
        posted = [(m[:3], post_recv(*m)) for m in step.recv]
        got = {}  # (kind, micro-batch, chunk) -> the received tensor
        for key, (t, work) in posted:
            work.wait()
            got[key] = t
        if ev[0] in ("B", "FB"):
            key = bwd_id(ev[-1])
            assert [("act",) + key] == step.await_sent or key not in act_sends, (key, step)
            release_outputs(force_key=key)
        grad = None
        if ev[0] == "F":
            total_num_tokens += run_forward(ev[1], got.get(("act", *fwd_id(ev[1]))))
        elif ev[0] == "FF":
            total_num_tokens += run_forward_pair(ev[1], ev[2], got)
        elif ev[0] == "B":
            before_backward(ev[1])
            grad = run_backward(ev[1], got.get(("grad", *bwd_id(ev[1]))))
            disable_grad_sync()
        else:
            _, vf, vb = ev
            mbf, cf = fwd_id(vf)
            mbb, cb = bwd_id(vb)
            before_backward(vb)
            pair = lanes.Pair(
                pass_label("F", mbf, cf),
                pass_label("B", mbb, cb),
            )
            STATS["pairs"] += 1
            x = got.get(("act", mbf, cf))
            g = got.get(("grad", mbb, cb))
            num_tokens, grad = pair.run(lambda: run_forward(vf, x), lambda: run_backward(vb, g))
            total_num_tokens += num_tokens
            disable_grad_sync()
        for kind, mb, c, peer, own in step.send:
            if kind == "act":
                act_sends[(mb, own)], _ = send(kind, mb, c, peer, outputs[(mb, own)])
            else:
                assert grad is not None, f"no input gradient to send for micro-batch {mb}"
                pending_sends.append(send(kind, mb, c, peer, grad))
        release_outputs()

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
    lane_state.set_stateful(())
    return forward_data_store
