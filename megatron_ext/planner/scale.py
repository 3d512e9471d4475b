"""The traces at a base shape and with each factor doubled, turned into sizes at the target: each
storage's exponent per factor, matched across traces by the op that allocated it, and the base
trace replayed with every storage re-sized (``Scaled``). See megatron_ext/planner/trace.py."""
from __future__ import annotations

import dataclasses
import math

FACTORS = ("width", "vocab", "seq", "mbs", "experts")


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


def storage_exponents(base: dict, doubled: dict) -> list:
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


def buffer_items(base: dict, doubled: dict) -> dict:
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


def param_items(base: dict, doubled: dict) -> dict:
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


def is_gemm_weight(name: str) -> bool:
    """A decoder layer's linear weight (attention, MLP, experts, latent projections), not a norm's or
    the router's."""
    parts = name.split(".")
    return ".layers." in f".{name}" and parts[-1] == "weight" and len(parts) > 1 and parts[-2].startswith("linear")


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
        self.gemm_inputs = dict.fromkeys(self.comps, 0.0)  # saved only as a layer linear's input
        self.gemm_inputs_shared = dict.fromkeys(self.comps, 0.0)  # ... and by something else too
        for k, (comp, module, gemm) in base["saved"].items():
            self.saved[comp] += self.sizes[k]
            self._saved_items.append((comp, module, self.sizes[k]))
            if gemm:
                (self.gemm_inputs if gemm == "only" else self.gemm_inputs_shared)[comp] += self.sizes[k]
        self.fwd, self.bwd = {}, {}
        for i, c in enumerate(self.comps):
            held = sum(self.saved[x] for x in self.comps[: i + 1])
            f = [max(live[i0:i1]) - (live[i0 - 1] if i0 else 0.0) for i0, i1 in base["phases"][("F", c)]]
            b = [max(live[i0:i1]) - held for i0, i1 in base["phases"][("B", c)]]
            self.fwd[c] = max(f) if f else 0.0
            self.bwd[c] = max(b) if b else 0.0
        whole = dict(factors, seq=factors.get("whole_seq", factors["seq"]))  # parameters see every position
        self.params_dense = {c: sum(it.at(whole) for it in items if not it.routed)
                             for c, items in tr["params"].items()}
        self.params_expert = {c: sum(it.at(whole) for it in items if it.routed) / ep
                              for c, items in tr["params"].items()}
        # the layers' linear weights (the GEMMs transformer-engine runs in FP8 when asked)
        self.gemm_weights = {c: sum(it.at(whole) / (ep if it.routed else 1) for it in items if is_gemm_weight(it.name))
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


def factors_for(args, tr: dict) -> dict:
    """The factors from the trace's base shape to the target's (per rank: a context-parallel rank's
    share of the sequence; ``whole_seq`` the whole one, for parameters)."""
    experts, traced = args.num_experts or 1, tr.get("experts") or args.num_experts or 1
    seq = args.seq_length / tr["base"]["seq"]
    return dict(width=float(tr["divisor"]), vocab=args.padded_vocab_size / tr["base"]["vocab"],
                seq=seq / (args.context_parallel_size or 1), whole_seq=seq, mbs=args.micro_batch_size / tr["base"]["mbs"],
                experts=experts / traced, local=experts / args.expert_model_parallel_size / traced)
