"""What the model itself saves for backward, from a trace of a tiny copy of it, scaled to the target.

The tiny copy is the run's own model (the project's builders, the run's layer spec, attention kind,
norms, activation, router and dispatcher, its tensor and sequence parallelism) with two layers of each
kind the run has (dense / MoE; the second stands for every layer of its kind), no pipeline, expert or
context parallelism (every expert local: a rank's experts receive top-k x its tokens under any EP, in
expectation), and every width divided by a power of two ``W``: hidden, head dimensions, FFN sizes, the
latent ranks of multi-latent attention. Heads, query groups and top-k are the target's; experts too,
or for many of them fewer (``traced_experts``). The router routes balanced while traced
(``megatron_ext.seams.planner``): every expert gets tokens x top-k / experts tokens at every shape.
The tensor-parallel ranks run it on a local world (gloo on CPU), the process's own when it has room.

After one untracked step (what persists across steps, e.g. megatron's global buffer for
sequence-parallel gathers, then exists and is counted once, as buffers), one micro-batch runs forward
and backward under saved-tensor hooks and a live-bytes tracker (``megatron_ext.measure.memtrack``)
that keeps every storage's life (allocated at op i, found dead at op j, n bytes), per component
(embedding, each layer, head = final norm + output layer + loss):

- saved: the storages saved for backward, with the offload module (``megatron_ext.offload``) whose
  hooks saw them (the offload manager's own hook placement; nothing is offloaded);
- forward / backward working sets: the most live bytes during a component's forward above those at its
  start, and during its backward above the saved bytes still held (its own and those before it);
- parameters by component.

The trace runs at a base shape and with each factor doubled: width, vocabulary, sequence length,
micro-batch size, and the expert count when fewer are traced. Storages are matched across traces by
the op that allocated them; each one's size is a monomial ``bytes = b0 * prod(factor ** e)`` (e = 1 for
tokens x hidden, 2 in sequence for attention scores, -1 in experts for one expert's tokens, ...).
Storages that another path allocates are scaled together, by the ratio of their sums. Requests to
megatron's global buffer are scaled one by one (the buffer is the largest). The timeline is then
replayed with every storage re-sized to the target shape (``Scaled``). Nothing here knows an
architecture: the tensors and their exponents are what megatron's modules do.
"""
from __future__ import annotations

from megatron_ext.planner.record import run_once
from megatron_ext.planner.run import fp8_saved_delta, layer_kinds, modeled_saved_delta, recompute_of
from megatron_ext.planner.scale import FACTORS, Scaled, buffer_items, factors_for, param_items, storage_exponents
from megatron_ext.planner.tiny import base_shape, trace_args, traced_experts, width_divisor


def trace(args, recompute=None, base=None) -> dict:
    """Trace the run's model (``args``: the target's parsed arguments) at the base shape and with
    each factor doubled. Needs an initialised default process group; runs on this process alone."""
    kinds = []
    for k in layer_kinds(args):
        if k not in kinds:
            kinds.append(k)
    w = width_divisor(args)
    experts = traced_experts(args)
    b = base_shape(args, experts, base)
    shapes = {}
    for f in (None, *FACTORS):
        if (f == "width" and w == 1) or (f == "experts" and experts == (args.num_experts or 0)):
            continue  # already the target's: nothing to scale
        shapes[f] = (w // 2 if f == "width" else w, b["vocab"] * (2 if f == "vocab" else 1),
                     b["seq"] * (2 if f == "seq" else 1), b["mbs"] * (2 if f == "mbs" else 1),
                     experts * (2 if f == "experts" else 1))
    # two layers of each kind: the second one stands for every layer of its kind (the first after
    # the embedding saves its input differently)
    runs = _run_shapes(args, shapes, [k for k in kinds for _ in range(2)], recompute)
    for f in ("width", "experts"):
        runs.setdefault(f, runs[None])
    doubled = {f: runs[f] for f in FACTORS}
    buffers = buffer_items(runs[None], doubled)
    return dict(raw=runs[None], exps=storage_exponents(runs[None], doubled), buffers=buffers,
                params=param_items(runs[None], doubled), kinds=kinds, divisor=w, experts=experts,
                base=dict(width=1, **b), recompute=recompute or recompute_of(args))


def run_shapes(args, shapes: dict, kinds: list, recompute) -> dict:
    """Job (every rank of a world of TP ranks, or more): the traces of ``shapes``, this rank's."""
    seed = args.seed
    return {f: run_once(trace_args(args, *shape, kinds, recompute), kinds, seed=seed) for f, shape in shapes.items()}


def _run_shapes(args, shapes: dict, kinds: list, recompute) -> dict:
    """On this process's world when it has room for the run's tensor parallelism (a benchmark or
    test world), else on a local world of TP processes started for it (gloo on CPU)."""
    import torch.distributed as dist

    tp = args.tensor_model_parallel_size
    if dist.is_initialized() and dist.get_world_size() % tp == 0:
        return run_shapes(args, shapes, kinds, recompute)
    import pickle

    from megatron_ext.measure.launch import run_world

    # pickled here, unpickled by the job: the arguments hold megatron objects, which a worker may
    # import only after its platform is set up
    return run_world(tp, _run_pickled, payload=pickle.dumps((args, shapes, kinds, recompute)))[0]


def _run_pickled(payload: bytes) -> dict:
    import pickle

    return run_shapes(*pickle.loads(payload))


def scaled(args, traced: dict) -> Scaled:
    """The trace at the run's shape, per rank (expert parameters / EP; a context-parallel rank's
    tokens), with what the local copy could not build modeled on top: FP8's saved GEMM inputs
    (``run.fp8_saved_delta``) and the recompute modules it lacks (``run.modeled_saved_delta``;
    recompute as the trace had it)."""
    out = Scaled(traced, factors_for(args, traced), ep=args.expert_model_parallel_size)
    for comp in out.comps:
        out.saved[comp] += fp8_saved_delta(args, out.gemm_inputs[comp], out.gemm_inputs_shared[comp])
    if traced.get("recompute") == recompute_of(args):
        for kind in out.kinds:
            delta = modeled_saved_delta(args, kind)
            if delta:
                comp = out.kind(kind)
                out.saved[comp] = max(0.0, out.saved[comp] + delta)
    return out
