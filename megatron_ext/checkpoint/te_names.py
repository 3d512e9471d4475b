"""A checkpoint of one layer spec loaded into the other: the local spec's names and transformer-engine's,
mapped at load through megatron-core's own sharded state dict.

A torch_dist checkpoint is keyed by the storage keys of megatron-core's sharded state dicts, which both
specs mostly share: the local spec writes its input norm and a dense layer's pre-MLP norm under the
names of transformer-engine's fused norm + linear (its ``sharded_state_dict_keys_map``,
models/gpt/gpt_layer_specs.py:459-462), and SequentialMLP (transformer/moe/experts.py:1377) and TEGroupedMLP
(:912, TEGroupedLinear's ``weight{i}`` under --moe-grouped-gemm, extensions/transformer_engine.py:2508)
both write ``experts.experts.linear_fc{1,2}.weight`` with a global expert axis. What differs, found by
building both specs (the transformer-engine one with megatron_ext/seams/te_spec.py's stand-ins where it is
not installed) and comparing every key (tests/hf/test_te_names.py, every family of docs/hf.md):

  a MoE layer's pre-MLP norm     local  mlp.linear_fc1.layer_norm_{weight,bias} (the key map above
                                        applies to every layer)
                                 TE     pre_mlp_layernorm.{weight,bias} (its own norm, :313, :336)
  multi-latent attention's norms local  self_attention.q_layernorm / kv_layernorm.{weight,bias}
                                 TE     self_attention.linear_q_up_proj / linear_kv_up_proj
                                        .layer_norm_{weight,bias} (fused, :246-255)
  its dense layers' pre-MLP norm local  pre_mlp_layernorm.{weight,bias} (no key map in MLA's local spec)
                                 TE     mlp.linear_fc1.layer_norm_{weight,bias}
  FP8 metadata                   ``_extra_state`` objects: transformer-engine's modules and the local
                                 linears both write one (the local ones None), where each has a module

At load, a model key the checkpoint lacks takes its counterpart's (PAIRS) when the checkpoint has that
one and the model has no key of that name itself; an ``_extra_state`` the checkpoint lacks keeps the
model's (FP8 metadata starts fresh, as a BF16 checkpoint's does). Anything else the model asks for and
the checkpoint lacks, or a shape that differs, is refused by name; so is a checkpoint weight the model
has no place for (megatron's default --dist-ckpt-strictness assume_ok_unexpected assumes there is none;
another --dist-ckpt-strictness handles it as megatron does). Only model weights are mapped: the
distributed optimizer's state follows the parameters' order, which differs between the specs, so an
optimizer is not loaded across specs (--finetune or --no-load-optim).

``--dry-run`` with --load builds this run's model on the meta device (transformer-engine's spec with the
stand-ins where it is not installed here) and checks every key the same way, before any compute
(checkpoint/keys.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# the two names one tensor has in the two specs' checkpoints, as the tail of a storage key: which is whose
# depends on the layer (a MoE layer's pre-MLP norm is the first on transformer-engine and the second on the
# local spec, a dense layer's of a multi-latent attention model the other way round)
PAIRS = (
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"),
    ("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"),
    ("self_attention.q_layernorm.bias", "self_attention.linear_q_up_proj.layer_norm_bias"),
    ("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight"),
    ("self_attention.kv_layernorm.bias", "self_attention.linear_kv_up_proj.layer_norm_bias"),
)
EXTRA_STATE = "_extra_state"
# --dist-ckpt-strictness values under which a model key the checkpoint lacks, or a checkpoint weight the
# model has no place for, is an error
STRICT_ABOUT_MODEL_KEYS = ("assume_ok_unexpected", "raise_unexpected", "raise_all")
STRICT_ABOUT_CHECKPOINT_KEYS = ("assume_ok_unexpected", "raise_all")
# the optimizer's tensors in a checkpoint (`optimizer.`, `chained_<i>.optimizer.` of a chained one); the
# model's weights are the other tensors (objects are extra states, RNG states, the common state)
_OPTIMIZER = re.compile(r"^(?:chained_\d+\.)?optimizer\.")


def is_optimizer_key(key: str) -> bool:
    return bool(_OPTIMIZER.match(key))


def _more(keys: list) -> str:
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""


def counterparts(key: str) -> list[str]:
    """The names the same tensor has in the other spec (PAIRS, in either direction)."""
    out = []
    for a, b in PAIRS:
        for mine, other in ((a, b), (b, a)):
            if key == mine or key.endswith("." + mine):
                out.append(key[: len(key) - len(mine)] + other)
    return out


def storage_key(key: str) -> str:
    """A metadata key without a ShardedObject's shard suffix (`..._extra_state/shard_0_2`)."""
    return key.split("/shard_", 1)[0]


@dataclass
class Placement:
    """How a model's sharded state dict was placed on a checkpoint's keys."""

    renamed: dict = field(default_factory=dict)  # model's storage key -> the checkpoint's
    kept: list = field(default_factory=list)  # _extra_state keys the checkpoint lacks: the model's kept
    missing: list = field(default_factory=list)  # the model's keys the checkpoint has under no name
    shapes: list = field(default_factory=list)  # (key, model's global shape, checkpoint's)
    unplaced: list = field(default_factory=list)  # checkpoint weights the model has no place for
    matched: int = 0  # checkpoint weights placed

    @staticmethod
    def over_ranks(parts: list) -> "Placement":
        """Every rank's placement of its part of the model as one: what any rank misses or places
        wrong, what no rank places (each pipeline stage holds its own layers)."""
        unplaced = set.intersection(*(set(p.unplaced) for p in parts))
        return Placement(
            renamed={k: v for p in parts for k, v in p.renamed.items()},
            kept=sorted({k for p in parts for k in p.kept}), missing=sorted({k for p in parts for k in p.missing}),
            shapes=sorted({s for p in parts for s in p.shapes}), unplaced=sorted(unplaced),
            matched=parts[0].matched + len(parts[0].unplaced) - len(unplaced))

    def refusal(self, load: str, spec: str, strictness: str = "assume_ok_unexpected",
                with_optimizer: bool = False) -> str | None:
        """The one line refusing this placement, or None (``with_optimizer``: the load takes the
        optimizer's state too). --dist-ckpt-strictness as megatron reads it
        (dist_checkpointing/validation.py:45; its "unexpected" keys are the model's the checkpoint
        lacks, its "missing" ones the checkpoint's the model lacks): the *_UNEXPECTED group ignores
        the checkpoint's extra keys, except the default, under which a weight would be dropped without
        a word: refused here."""
        where = f"--load={load}"
        if self.shapes:
            key, mine, theirs = self.shapes[0]
            return (f"{where}: {key} is {tuple(theirs)} in the checkpoint, {tuple(mine)} in this run's model "
                    f"({spec} spec)")
        if self.missing and strictness in STRICT_ABOUT_MODEL_KEYS:
            return (f"{where}: the checkpoint has no {self.missing[0]}{_more(self.missing)}, which this run's "
                    f"model ({spec} spec) loads, under its own name or the other spec's")
        if self.unplaced and strictness in STRICT_ABOUT_CHECKPOINT_KEYS:
            return (f"{where}: the checkpoint's {self.unplaced[0]}{_more(self.unplaced)} has no place in this "
                    f"run's model ({spec} spec); --dist-ckpt-strictness log_all loads without it")
        if self.renamed and with_optimizer:
            return (f"{where}: the checkpoint was saved by the other layer spec than this run's ({spec}), whose "
                    "optimizer state does not follow its parameters: load its weights with --finetune or "
                    "--no-load-optim")
        return None

    def describe(self, spec: str) -> str:
        """What was placed, the renamed keys counted by name (their common tail)."""
        line = f"every weight placed in the {spec} spec: {self.matched}"
        if self.renamed:
            tails: dict = {}
            for mine, theirs in self.renamed.items():
                tail = next((x, y) for a, b in PAIRS for x, y in ((a, b), (b, a))
                            if mine.endswith(x) and theirs.endswith(y))
                tails[tail] = tails.get(tail, 0) + 1
            line += ", " + ", ".join(f"{n} {a} from {b}" for (a, b), n in sorted(tails.items()))
        if self.kept:
            line += f"; {len(self.kept)} {EXTRA_STATE} (FP8 metadata) as built"
        return line


def _entries(sharded_state_dict):
    """Every ShardedTensor, ShardedTensorFactory and ShardedObject of a nested sharded state dict,
    with the container and index holding it."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    todo = [sharded_state_dict]
    while todo:
        container = todo.pop()
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for index, value in list(items):
            if isinstance(value, ShardedBase):
                yield container, index, value
            elif isinstance(value, (dict, list)):
                todo.append(value)


def _global_shape(entry):
    """A ShardedTensor's global shape; a factory's from the tensors it builds (SwiGLU's fc1 halves
    fill the same global tensor); None for objects."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(entry, ShardedTensorFactory):
        built = entry.build()
        first = next(v for _, _, v in _entries(built if isinstance(built, (dict, list)) else {"x": built}))
        return tuple(first.global_shape)
    return tuple(entry.global_shape) if isinstance(entry, ShardedTensor) else None


def onto_checkpoint(model_state: dict, metadata: dict) -> Placement:
    """Retarget ``model_state`` (the model chunks' part of a load template, megatron-core's sharded
    state dicts) in place onto the names ``metadata`` (dist_checkpointing's load_sharded_metadata of
    the checkpoint) holds, and say how (PAIRS; module docstring)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor

    stored = {storage_key(k): v for k, v in metadata.items()}
    entries = list(_entries(model_state))
    own = {e.key for _, _, e in entries}
    placed, out = set(), Placement()
    for container, index, entry in entries:
        key = entry.key
        if key not in stored:
            if key.endswith(EXTRA_STATE) and isinstance(entry, ShardedObject):
                container[index] = LocalNonpersistentObject(entry.data)
                out.kept.append(key)
                continue
            found = [c for c in counterparts(key) if c in stored and c not in own]
            if not found:
                out.missing.append(key)
                continue
            out.renamed[key] = found[0]
            entry.key = key = found[0]
        placed.add(key)
        mine, theirs = _global_shape(entry), getattr(stored[key], "global_shape", None)
        if mine is not None and theirs is not None and tuple(theirs) != mine:
            out.shapes.append((key, mine, tuple(theirs)))
    weights = {k for k, v in stored.items() if isinstance(v, ShardedTensor) and not is_optimizer_key(k)}
    out.unplaced = sorted(weights - placed)
    out.matched = len(weights & placed)
    out.missing, out.kept = sorted(set(out.missing)), sorted(set(out.kept))  # one entry per key, not per shard
    return out


def with_own_extra_states(module, state: dict) -> dict:
    """``state`` (a loaded state dict of ``module``) with the module's own ``_extra_state`` where the
    load brought none: megatron-core's sharded state dicts leave some out (TEDotProductAttention's
    without a learnable softmax offset, extensions/transformer_engine.py:2090-2093; those a checkpoint of
    the other spec lacks), and torch's strict load would refuse the module's own as missing (megatron's
    loader retries without strict, megatron/training/checkpointing.py:2524)."""
    own = {k: v for k, v in module.state_dict(keep_vars=True).items() if k.endswith(EXTRA_STATE) and k not in state}
    return {**state, **own} if own else state


def spec_name(args) -> str:
    return "transformer_engine" if args.transformer_impl == "transformer_engine" else "local"
