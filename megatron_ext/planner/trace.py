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

import contextlib
import copy
import dataclasses
import math

import torch

FACTORS = ("width", "vocab", "seq", "mbs", "experts")
# the width fields: scaled together by the width factor (per TP rank where megatron shards them)
_WIDTH_FIELDS = ("hidden_size", "ffn_hidden_size", "moe_ffn_hidden_size", "kv_channels",
                 "moe_shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                 "qk_pos_emb_head_dim", "v_head_dim")
_TP_SHARDED = ("ffn_hidden_size", "moe_shared_expert_intermediate_size")
BASE = dict(vocab=64, seq=16, mbs=2)  # mbs 1 would skip copies (a transpose of one sample is contiguous)
MIN_HEAD_DIM = 4  # smallest traced head / rope dimension
MIN_EXPERTS = 16  # fewest routed experts a trace of a model with more keeps


@dataclasses.dataclass
class Item:
    """One traced quantity: bytes at the base shape and its exponent per factor."""
    nbytes: float
    exps: dict
    module: str | None = None   # offload module that saved it (saved tensors only)
    routed: bool = False        # belongs to the routed experts: x 1/EP at the target
    name: str = ""

    def at(self, factors: dict) -> float:
        return self.nbytes * math.prod(factors[f] ** self.exps.get(f, 0.0) for f in FACTORS)


def width_divisor(args) -> int:
    """Largest power of two W (trace hidden >= 16) such that every width field / W still divides
    by the tensor (expert) parallel size, with head dimensions >= MIN_HEAD_DIM after division (the
    width-doubled trace, at W / 2, only grows them)."""
    tp = args.tensor_model_parallel_size
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    values = []
    for f in _WIDTH_FIELDS:
        v = getattr(args, f, None)
        if not v:
            continue
        if f in _TP_SHARDED:
            v //= tp
        elif f == "moe_ffn_hidden_size":
            v //= etp
        values.append((f, v))
    w = 1
    while True:
        nxt = w * 2
        ok = all(v % nxt == 0 for _, v in values) and args.hidden_size // nxt >= 16
        ok = ok and all(v // nxt >= MIN_HEAD_DIM for f, v in values if f not in ("hidden_size",))
        if not ok:
            return w
        w = nxt


def traced_experts(args) -> int:
    """Routed experts of the trace: the fewest (a divisor of the run's count, twice it still a
    divisor, at least MIN_EXPERTS or half the run's count) that the router's top-k and expert groups
    allow; the run's when none does. Experts are identical, so what the run's count changes (expert
    parameters, the router's [tokens, experts] tensors, fewer tokens per expert, copies of the local
    experts' weights) is measured by a trace at twice the traced count and scaled (the ``experts``
    factor)."""
    n = args.num_experts or 0
    k = args.moe_router_topk or 1
    groups = getattr(args, "moe_router_num_groups", None) or 1
    group_topk = getattr(args, "moe_router_group_topk", None) or groups
    for e in range(min(MIN_EXPERTS, n // 2), n // 2 + 1):
        if e and n % (2 * e) == 0 and e % groups == 0 and e * group_topk // groups >= k:
            return e
    return n


def trace_args(args, divisor: int, vocab: int, seq: int, mbs: int, experts: int, kinds: list, recompute=None):
    """A copy of the run's arguments for the tiny model: one layer per kind, the run's tensor
    parallelism (and sequence parallelism), no pipeline, expert or context parallelism, ``experts``
    routed experts."""
    a = copy.deepcopy(args)
    if args.num_experts:
        a.num_experts = experts
        from megatron_ext.planner.memory import fixed_budget_rows

        rows = fixed_budget_rows(args, args.expert_model_parallel_size, args.tensor_model_parallel_size)
        # the fixed-budget dispatcher's experts run on every row of its buffers, padding included: the
        # trace (one rank, no expert parallelism) sizes them as the run does, per token
        a.planner_budget_rows_per_token = rows / (args.seq_length * args.micro_batch_size
                                                  // args.tensor_model_parallel_size) if rows else None
    for f in _WIDTH_FIELDS:
        v = getattr(a, f, None)
        if v:
            setattr(a, f, v // divisor)
    a.pipeline_model_parallel_size = a.expert_model_parallel_size = 1
    a.context_parallel_size = 1
    a.virtual_pipeline_model_parallel_size = None
    a.num_layers_per_virtual_pipeline_stage = None
    a.decoder_first_pipeline_num_layers = a.decoder_last_pipeline_num_layers = None
    a.account_for_embedding_in_pipeline_split = a.account_for_loss_in_pipeline_split = False
    a.pipeline_model_parallel_layout = None
    a.num_layers = len(kinds)
    if args.num_experts:
        a.moe_layer_freq = [1 if k == "moe" else 0 for k in kinds]
        a.moe_layer_freq = a.moe_layer_freq if len(set(kinds)) > 1 else 1
    a.mtp_num_layers = None
    a.padded_vocab_size = a.vocab_size = vocab
    a.seq_length = seq
    a.max_position_embeddings = max(seq, 2)
    a.micro_batch_size = mbs
    a.activation_offload_modules = None
    a.fp8 = None
    modules = ["core_attn"]
    if recompute is None:  # as the run (full recompute: of every traced layer)
        recompute = recompute_of(args)
        modules = list(getattr(args, "recompute_modules", None) or modules)
    a.recompute_granularity = a.recompute_method = a.recompute_num_layers = None
    a.recompute_modules = None
    if recompute == "selective":
        a.recompute_granularity, a.recompute_modules = "selective", modules
    elif recompute == "full":
        a.recompute_granularity, a.recompute_method, a.recompute_num_layers = "full", "uniform", 1
    a.overlap_tp_comm_1f1b = False
    _local_unfused(a)
    a.overlap_grad_reduce = a.overlap_param_gather = False
    a.use_distributed_optimizer = False
    a.cross_entropy_loss_fusion = False
    a.moe_layer_recompute = False
    return a


def _local_unfused(a) -> None:
    """In place: the local spec without fused kernels (what this machine builds). The tiny copy
    runs so; the transformer-engine spec saves differently (its fused attention keeps no score
    matrix), which the trace does not see."""
    a.transformer_impl = "local"
    for name, value in list(vars(a).items()):
        if name.startswith("no_") and ("fusion" in name or "persist" in name):
            setattr(a, name, True)
        elif value is True and ("fusion" in name or name in ("persist_layer_norm", "moe_grouped_gemm",
                                                           "moe_use_legacy_grouped_gemm", "tp_comm_overlap")):
            setattr(a, name, False)


def buildable_here(args):
    """A copy of the arguments whose TransformerConfig this machine can build (sizes unchanged)."""
    a = copy.copy(args)
    _local_unfused(a)
    return a


def recompute_of(args) -> str:
    """The run's recompute: "none", "selective" (its --recompute-modules) or "full"."""
    g = getattr(args, "recompute_granularity", None)
    return g if g in ("selective", "full") else "none"


def layer_kinds(args) -> list:
    """Kinds of the run's decoder layers, in layer order ("dense" / "moe")."""
    n = args.num_layers
    if not args.num_experts:
        return ["dense"] * n
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(n)]
    else:
        pattern = list(freq)
    return ["moe" if p else "dense" for p in pattern]


class _Tagger:
    """Which component runs, forward and backward; every storage saved outside the offload
    manager's hooks is recorded with it."""

    def __init__(self, model, exclude):
        from megatron_ext.seams import offload_layers

        self.exclude = exclude
        self.current = "embedding"
        self.saved: dict = {}  # the tracker's storage index -> [component, offload module]
        self.handles = []
        self.marks: list = []  # (tracker op index, component, "F"/"B")
        self.tracker = None
        self.layers = offload_layers(model)
        for i, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: self._enter(f"layer{i}")))
            self.handles.append(layer.register_forward_hook(lambda m, a, o, i=i: self._leave_layer(i, o)))
        emb = getattr(model, "embedding", None)
        if emb is not None:
            self.handles.append(emb.register_forward_hook(lambda m, a, o: self._grad_mark(o, "embedding")))

    def _enter(self, name):
        self.current = name
        self.marks.append((self.tracker.ops, name, "F"))

    def _leave_layer(self, i, out):
        nxt = "head" if i == len(self.layers) - 1 else f"layer{i + 1}"
        self._grad_mark(out, f"layer{i}")
        self.current = nxt
        self.marks.append((self.tracker.ops, nxt, "F"))

    def _grad_mark(self, out, name):
        t = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda g: self.marks.append((self.tracker.ops, name, "B")))

    def pack(self, t):
        if isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
            return t
        st = t.untyped_storage()
        ptr = st.data_ptr()
        self.record(ptr, None)
        return t

    def record(self, ptr, module) -> None:
        """A storage saved for backward (keyed by the tracker's index: a freed address may be reused)."""
        k = self.tracker.ids.get(ptr)
        if k is None:  # not allocated by the step (its inputs) or excluded (parameters)
            return
        rec = self.saved.get(k)
        if rec is None:
            self.saved[k] = [self.current, module]
        elif rec[1] != module:
            rec[1] = "shared"  # saved by two places: offloading one frees nothing

    def remove(self):
        """Unhook, and drop what the hooks reach: a model keeps tensors of its last forward (the MoE
        dispatcher's probabilities), whose graph holds the tensor hooks and, through them, this
        object; the model and its process groups must not be reachable from there."""
        for h in self.handles:
            h.remove()
        self.handles, self.layers, self.tracker = [], [], None


def _trace_manager_class():
    from megatron_ext.offload.manager import OffloadManager

    class _SeeingManager(OffloadManager):
        """The offload manager's hook placement, recording instead of offloading."""

        tagger: _Tagger = None

        def _pack(self, t):
            if self._group is None or isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
                return t
            st = t.untyped_storage()
            ptr = st.data_ptr()
            self.tagger.record(ptr, self._saving[-1][0] if self._saving else None)
            return t

    return _SeeingManager


def _component_of(param_name: str) -> str:
    if ".layers." in param_name:
        return "layer" + param_name.split(".layers.")[1].split(".")[0]
    if param_name.startswith("embedding"):
        return "embedding"
    return "head"


class _AllocTracker:
    """The live-bytes tracker, also keeping every storage's life as [first op, op at which it was
    found dead, bytes] in the order storages appear, so that the timeline can be replayed with each
    storage re-sized."""

    def __new__(cls, exclude, device_type):
        from megatron_ext.measure.memtrack import LiveBytesTracker

        class Tracker(LiveBytesTracker):
            def __init__(self):
                super().__init__(exclude, device_type)
                self.allocs: list = []
                self.ids: dict = {}  # ptr -> index in allocs, while alive

            def _sweep(self):
                for ptr, (ref, _n) in list(self.live.items()):
                    if ref.expired():
                        self.current -= self.live.pop(ptr)[1]
                        k = self.ids.pop(ptr, None)
                        if k is not None:
                            self.allocs[k][1] = self.ops

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.func = func.__name__
                return super().__torch_dispatch__(func, types, args, kwargs)

            def _see(self, t):
                before = len(self.live)
                super()._see(t)
                if len(self.live) > before:
                    ptr = t.untyped_storage().data_ptr()
                    self.ids[ptr] = len(self.allocs)
                    self.allocs.append([self.ops, None, self.live[ptr][1], self.func])

        return Tracker()


def global_buffer_bytes() -> int:
    """Bytes of megatron's global memory buffer (sequence-parallel all-gathers reuse it; it stays)."""
    from megatron.core import parallel_state

    try:
        buf = parallel_state.get_global_memory_buffer()
    except AssertionError:
        return 0
    return sum(t.untyped_storage().nbytes() for t in buf.buffer.values())


def run_once(args, kinds, seed: int = 1234) -> dict:
    """Build the tiny model from ``args`` (already shrunk), run one micro-batch forward and backward.
    Returns the storages' lives (allocs), which of them are saved (by component and offload
    module), the component phases (op ranges, forward and backward) and the parameters. A MoE
    model routes balanced (``megatron_ext.seams.planner``): every expert gets the same tokens."""
    from megatron_ext.seams.planner import balanced_routing
    from megatron_ext.training import model as models
    from megatron_ext.training import parallel

    parallel.initialize(tensor=args.tensor_model_parallel_size,
                        expert_tensor=getattr(args, "expert_tensor_parallel_size", None), seed=seed)
    routing = balanced_routing() if args.num_experts else contextlib.nullcontext()
    try:
        with routing, _budget_as_the_run(getattr(args, "planner_budget_rows_per_token", None)):
            return _run_built(args, kinds, seed)
    finally:
        models.release_models()
        parallel.destroy()


@contextlib.contextmanager
def _budget_as_the_run(rows_per_token):
    """The fixed-budget dispatcher's buffer rows per token as the run's (None: unchanged)."""
    if rows_per_token is None:
        yield
        return
    from megatron_ext.moe import fixed_dispatch
    from megatron_ext.patching import set_attr

    def budget_rows(tokens, topk, num_experts, num_local, factor):
        return max(1, math.ceil(rows_per_token * tokens)), tokens * topk * num_local / num_experts

    undo = set_attr(fixed_dispatch, "budget_rows", budget_rows)
    try:
        yield
    finally:
        undo()


def _run_built(args, kinds, seed: int) -> dict:
    from megatron_ext.measure.memtrack import model_state_ptrs
    from megatron_ext.offload.manager import MODULES, Options
    from megatron_ext.seams.planner import buffer_requests
    from megatron_ext.training import model as models

    config = models.transformer_config(args)
    chunks = models.build_model(args, config, wrap_with_ddp=False)
    model = chunks[0]
    root = model
    while hasattr(root, "module") and isinstance(root.module, torch.nn.Module):
        root = root.module
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    exclude = model_state_ptrs(chunks)
    params = {}
    for name, p in root.named_parameters():
        params.setdefault(_component_of(name), []).append(
            (name, p.numel() * p.element_size(), ".experts." in name and "shared_experts" not in name))
    g = torch.Generator().manual_seed(seed)
    s, b = args.seq_length, args.micro_batch_size
    dev = next(model.parameters()).device
    tokens = torch.randint(0, args.padded_vocab_size, (b, s + 1), generator=g).to(dev)
    pos = torch.arange(s, device=dev).unsqueeze(0).expand(b, -1).contiguous()
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=dev), diagonal=1)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    tagger = _Tagger(root, exclude)
    manager = _trace_manager_class()(Options(modules=MODULES, min_tensor_bytes=0))
    manager.tagger = tagger
    manager.attach(chunks)
    tracker = _AllocTracker(exclude, dev.type)
    tagger.tracker = tracker
    # a first step untracked, as a run's measured step follows others: what persists across
    # steps (megatron's global buffer for sequence-parallel gathers, cached rotary tables) exists
    # before it and is counted once, as buffers
    model(inputs, pos, mask, labels=labels).float().mean().backward()
    for p in model.parameters():
        p.grad.zero_()
    tagger.marks.clear()
    try:
        with tracker, buffer_requests() as requests:
            with torch.autograd.graph.saved_tensors_hooks(tagger.pack, lambda x: x):
                tagger.marks.append((0, "embedding", "F"))
                out = model(inputs, pos, mask, labels=labels)
                loss = out.float().mean()
            end_fwd = tracker.ops
            tagger.marks.append((end_fwd, "head", "B"))
            del out
            loss.backward()
            tracker._sweep()
            end = tracker.ops
    finally:
        manager.detach()
        manager.tagger = None
        tagger.remove()
    comps = ["embedding"] + [f"layer{i}" for i in range(len(kinds))] + ["head"]
    saved = {}  # alloc index -> (component, offload module or None)
    saved = {k: (comp, None if module == "shared" else module) for k, (comp, module) in tagger.saved.items()}
    phases = {(w, c): [] for w in "FB" for c in comps}
    for which, stop in (("F", end_fwd), ("B", end)):
        marks = [(i, c) for i, c, k in tagger.marks if k == which] + [(stop, None)]
        for (i0, c), (i1, _) in zip(marks, marks[1:]):
            if c is not None and i1 > i0:
                phases[(which, c)].append((i0, i1))
    return dict(allocs=[tuple(a) for a in tracker.allocs], saved=saved, phases=phases, params=params,
                comps=comps, ops=end, peak=tracker.peak, kinds=list(kinds), buffers=global_buffer_bytes(),
                requests=list(requests))


def _exp(a: float, b: float) -> float:
    if a <= 0 or b <= 0:
        return 0.0
    return math.log2(b / a)


def _match(mine: list, other: list) -> dict:
    """Storage k of ``mine`` -> its counterpart in ``other``: aligned on the op that allocated them
    (one code path allocates in the same order at every shape)."""
    import difflib

    matcher = difflib.SequenceMatcher(a=[a[3] for a in mine], b=[a[3] for a in other], autojunk=False)
    return {i + d: j + d for i, j, n in matcher.get_matching_blocks() for d in range(n)}


def _storage_exponents(base: dict, doubled: dict) -> list:
    """Per storage, its exponent per factor. A size is a product of the factors, so an exponent is a
    multiple of 1/2. Storages that one trace has and the other not, or whose ratio is no such
    multiple (another path taken), are scaled together, by the ratio of their sums. (Sizes do not
    depend on the values: the trace's MoE routing is balanced.)"""
    mine = base["allocs"]
    out = [dict() for _ in mine]
    for f in FACTORS:
        other = doubled[f]["allocs"]
        matched = _match(mine, other)
        # twice the experts: the added experts' storages are the extra copies, not growth; a
        # storage of one expert's tokens halves (exponent -1)
        low = -1.0 if f == "experts" else 0.0
        exact, a_sum, b_sum = {}, 0, 0
        for k, j in matched.items():
            e = _exp(mine[k][2], other[j][2])
            if abs(e - round(2 * e) / 2) < 0.05:
                exact[k] = round(2 * e) / 2
            else:
                a_sum += mine[k][2]
                b_sum += other[j][2]
        seen = set(matched.values())
        a_sum += sum(a[2] for k, a in enumerate(mine) if k not in matched)
        if f != "experts":
            b_sum += sum(a[2] for j, a in enumerate(other) if j not in seen)
        # no tensor grows faster than the square of a factor (attention scores in sequence): a ratio
        # beyond that is another path taken (experts that got tokens in one trace and none in the other)
        rest = min(2.0, max(low, _exp(a_sum, b_sum))) if a_sum and b_sum else 1.0
        for k in range(len(mine)):
            out[k][f] = min(2.0, max(low, exact.get(k, rest)))
    return out


def storage_scale(exps: dict, factors: dict) -> float:
    """A traced storage's size at the target over its traced size. A storage of one expert's
    tokens (exponent -1 in experts) stands for target / traced experts like it, each that much
    smaller: together the same bytes (an upper bound where they do not coexist). A storage that
    grows with the experts but not with the tokens is one per local expert (a copy of the experts'
    weights, their gradients): the run's rank has experts / EP of them (``local``); one that grows
    with both (the router's [tokens, experts]) sees every expert."""
    out = 1.0
    for f in FACTORS:
        e = exps.get(f, 0.0)
        if f == "experts":
            tokens = exps.get("seq", 0.0) or exps.get("mbs", 0.0)
            out *= (factors[f] if tokens else factors.get("local", factors[f])) ** max(0.0, e)
        else:
            out *= factors[f] ** e
    return out


def _buffer_items(base: dict, doubled: dict) -> dict:
    """Per key of megatron's global memory buffer, its requests as items (matched by order: one code
    path requests in the same order at every shape); the buffer is the largest request."""
    out: dict = {}
    for i, (key, n) in enumerate(base["requests"]):
        exps = {}
        for f in FACTORS:
            other = doubled[f]["requests"]
            m = other[i][1] if i < len(other) and other[i][0] == key else n
            exps[f] = min(2.0, max(0.0, round(2 * _exp(n, m)) / 2))
        items = out.setdefault(key, [])
        if not any(it.nbytes == n and it.exps == exps for it in items):  # repeated per layer
            items.append(Item(n, exps, name=key))
    return out


def _param_items(base: dict, doubled: dict) -> dict:
    """Per component, its parameters with their exponents; a routed expert's parameters grow with
    the experts as all routed parameters of the component do (the traced experts stand for all)."""
    out = {}
    for c, plist in base["params"].items():
        items = []
        more = {name: n for name, n, _ in doubled["experts"]["params"].get(c, [])}
        routed_base = sum(n for _, n, r in plist if r)
        routed_more = sum(n for _, n, r in doubled["experts"]["params"].get(c, []) if r)
        for j, (name, n, routed) in enumerate(plist):
            exps = {f: round(2 * _exp(n, doubled[f]["params"][c][j][1])) / 2 for f in FACTORS if f != "experts"}
            ratio = _exp(routed_base, routed_more) if routed else _exp(n, more.get(name, n))
            exps["experts"] = round(2 * ratio) / 2
            items.append(Item(n, exps, None, routed, name))
        out[c] = items
    return out


class Scaled:
    """The base trace replayed at a target shape, each storage re-sized by its exponents: per
    component, saved bytes (per offload module: ``offloadable_at``), forward and backward working
    sets, parameter bytes (expert parameters / ``ep``)."""

    def __init__(self, tr: dict, factors: dict, ep: int = 1):
        base = tr["raw"]
        self.kinds = list(dict.fromkeys(base["kinds"]))
        self.comps = base["comps"]
        self.sizes = [a[2] * storage_scale(e, factors) for a, e in zip(base["allocs"], tr["exps"])]
        ops = base["ops"] + 1
        diff = [0.0] * (ops + 1)
        for (a0, a1, _n, _f), size in zip(base["allocs"], self.sizes):
            diff[a0] += size
            diff[a1 if a1 is not None else ops] -= size
        live, acc = [], 0.0
        for d in diff[:ops]:
            acc += d
            live.append(acc)
        self.saved = dict.fromkeys(self.comps, 0.0)
        self._saved_items = []  # (component, offload module, bytes)
        for k, (comp, module) in base["saved"].items():
            self.saved[comp] += self.sizes[k]
            self._saved_items.append((comp, module, self.sizes[k]))
        self.fwd, self.bwd = {}, {}
        for i, c in enumerate(self.comps):
            held = sum(self.saved[x] for x in self.comps[: i + 1])
            f = [max(live[i0:i1]) - (live[i0 - 1] if i0 else 0.0) for i0, i1 in base["phases"][("F", c)]]
            b = [max(live[i0:i1]) - held for i0, i1 in base["phases"][("B", c)]]
            self.fwd[c] = max(f) if f else 0.0
            self.bwd[c] = max(b) if b else 0.0
        self.params_dense = {c: sum(it.at(factors) for it in items if not it.routed)
                             for c, items in tr["params"].items()}
        self.params_expert = {c: sum(it.at(factors) for it in items if it.routed) / ep
                              for c, items in tr["params"].items()}
        self.buffers = sum(max(it.at(factors) for it in items) for items in tr["buffers"].values())
        self.peak = max(live) if live else 0.0

    def offloadable_at(self, comp: str, min_bytes: int) -> dict:
        """{offload module: bytes} that component saves in storages of at least ``min_bytes``."""
        out: dict = {}
        for c, module, size in self._saved_items:
            if c == comp and module is not None and size >= min_bytes:
                out[module] = out.get(module, 0.0) + size
        return out

    def kind(self, kind: str) -> str:
        """The component that stands for a layer kind: its second layer in the trace."""
        return f"layer{2 * self.kinds.index(kind) + 1}"


def base_shape(args, experts: int, base: dict | None = None) -> dict:
    """The trace's base vocabulary, sequence and micro-batch size. With experts, the sequence is the
    smallest (from BASE's) that gives every traced expert the same whole number of tokens under
    balanced routing, at every traced shape and with twice the experts (tokens per rank: sequence x
    micro-batch / TP under sequence parallelism)."""
    b = dict(BASE, **(base or {}))
    if args.num_experts:
        k, tp = args.moe_router_topk or 1, args.tensor_model_parallel_size
        need = 2 * experts * tp
        step = math.lcm(need // math.gcd(need, b["mbs"] * k), tp)  # seq x mbs x k a multiple of need
        b["seq"] = step * math.ceil(b["seq"] / step)
    return b


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
    buffers = _buffer_items(runs[None], doubled)
    return dict(raw=runs[None], exps=_storage_exponents(runs[None], doubled), buffers=buffers,
                params=_param_items(runs[None], doubled), kinds=kinds, divisor=w, experts=experts,
                base=dict(width=1, **b), recompute=recompute or recompute_of(args))


def run_shapes(args, shapes: dict, kinds: list, recompute) -> dict:
    """Job (every rank of a world of TP ranks, or more): the traces of ``shapes``, this rank's."""
    seed = getattr(args, "seed", 1234)
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


def factors_for(args, tr: dict) -> dict:
    """The factors from the trace's base shape to the target's (per rank)."""
    experts, traced = args.num_experts or 1, tr.get("experts") or args.num_experts or 1
    return dict(width=float(tr["divisor"]), vocab=args.padded_vocab_size / tr["base"]["vocab"],
                seq=args.seq_length / tr["base"]["seq"], mbs=args.micro_batch_size / tr["base"]["mbs"],
                experts=experts / traced, local=experts / args.expert_model_parallel_size / traced)
