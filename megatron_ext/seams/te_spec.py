"""transformer-engine's layer spec built where transformer-engine is not installed: its module tree and
its checkpoint keys, for a CPU machine that checks what a GPU cluster will load (megatron_ext/training/
checkpoint/keys.py, `--dry-run --platform cuda --assume-te --load`, on the meta device; tests/hf/
test_te_names.py, on CPU). Scoped: applied only around such a build (``standing_in()``); no forward runs.

megatron-core 0.19.2 without transformer-engine defines its wrappers of transformer-engine's modules over a
MagicMock (extensions/transformer_engine.py:74-85), so they cannot be built. The stand-ins below hold
what transformer-engine's modules hold, read from its source:

  te.pytorch.Linear            weight, bias (a parameter only with bias=True), _extra_state
  te.pytorch.LayerNormLinear   layer_norm_weight, layer_norm_bias (LayerNorm only), weight, bias, _extra_state
  te.pytorch.GroupedLinear     weight0..weight{n-1}, bias0..bias{n-1} (with bias), _extra_state
  te.pytorch.LayerNorm/RMSNorm weight, bias (LayerNorm), _extra_state (its fusible operation's)
  te.pytorch.DotProductAttention  softmax_offset with --softmax-type learnable, _extra_state

each sized as megatron's wrapper sizes it for its parallel mode (this rank's shard), and their
``sharded_state_dict`` (with the grouped linear's helpers) is megatron-core's own: the methods of
TELinear, TELayerNormColumnParallelLinear, TEColumnParallelLinear, TERowParallelLinear,
TEDotProductAttention, TEGroupedLinear, TEColumnParallelGroupedLinear and TERowParallelGroupedLinear,
compiled from the installed extensions/transformer_engine.py into these classes (``_megatron_methods``),
so the keys, TP axes, expert axes and replica ids are the ones megatron writes on a cluster.

Replaced while standing in (TE_STAND_INS):
  extensions/transformer_engine_spec_provider.py:8-16  the names TESpecProvider returns (its methods are
      megatron's own: which module for which role, TEGroupedMLP under --moe-grouped-gemm)
  models/gpt/gpt_layer_specs.py:50-54  TENorm (the decoder block's final norm) and TESpecProvider, None
      there without transformer-engine
  transformer/transformer_block.py:53-64  LayerNormImpl, the final norm of a block built from one layer
      spec: TENorm where transformer-engine is installed
  transformer/multi_latent_attention.py:61-75, transformer/attention.py:121-129  the TE classes these
      modules compare a spec's submodules with (MLA's down projections, :525, :572), None there
  utils.py:71 (_te_version, read by is_te_min_version :326): the version the cluster is assumed to have
      (ASSUMED_TE_VERSION), so megatron's version checks answer for it
"""
from __future__ import annotations

import ast
import contextlib
import functools
import inspect

import torch

from megatron_ext.patching import Patch, set_attr, undo_all

# the transformer-engine version the stand-ins answer megatron's version checks for: the newest
# megatron-core 0.19.2 asks about (is_te_min_version("2.14.0"), transformer/moe/experts.py:343)
ASSUMED_TE_VERSION = "2.14.0"
EXTRA_STATE = "_extra_state"


# ------------------------------------------------------------------------------------------------
# megatron-core's own methods of its transformer-engine wrappers
# ------------------------------------------------------------------------------------------------
_METHODS = {
    "TELinear": ("sharded_state_dict",),
    "TELayerNormColumnParallelLinear": ("sharded_state_dict",),
    "TEColumnParallelLinear": ("sharded_state_dict",),
    "TERowParallelLinear": ("sharded_state_dict",),
    "TEDotProductAttention": ("sharded_state_dict",),
    "TEGroupedLinear": ("_sharded_state_dict_grouped", "_split_extra_state", "_split_grouped_checkpoint_tensor"),
    "TEColumnParallelGroupedLinear": ("sharded_state_dict",),
    "TERowParallelGroupedLinear": ("sharded_state_dict",),
}


@functools.lru_cache(maxsize=None)
def _source_classes() -> dict:
    """{class name: its ast.ClassDef} of extensions/transformer_engine.py, nested ones included (the
    grouped linears are defined under an `if`)."""
    from megatron.core.extensions import transformer_engine

    tree = ast.parse(inspect.getsource(transformer_engine))
    return {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name in _METHODS}


def _megatron_methods(name: str, stand_in: type) -> type:
    """A subclass of ``stand_in`` whose methods ``_METHODS[name]`` are megatron-core's, compiled from
    its source in its module's namespace (so `super()` and the module's helpers resolve as upstream)."""
    from megatron.core.extensions import transformer_engine

    source = _source_classes()[name]
    body = [node for node in source.body if isinstance(node, ast.FunctionDef) and node.name in _METHODS[name]]
    missing = set(_METHODS[name]) - {f.name for f in body}
    if missing:
        raise RuntimeError(f"megatron-core's {name} has no {sorted(missing)}: the stand-ins need updating")
    cls = ast.ClassDef(name=name, bases=[ast.Name("_StandIn", ast.Load())], keywords=[], body=body,
                       decorator_list=[], type_params=[])
    module = ast.fix_missing_locations(ast.Module(body=[cls], type_ignores=[]))
    namespace = dict(vars(transformer_engine), _StandIn=stand_in)
    exec(compile(module, transformer_engine.__file__, "exec"), namespace)  # noqa: S102 - megatron-core's code
    made = namespace[name]
    made.__module__ = __name__
    made.__qualname__ = name
    return made


# ------------------------------------------------------------------------------------------------
# what transformer-engine's modules hold
# ------------------------------------------------------------------------------------------------
class _ExtraState(torch.nn.Module):
    """transformer-engine's modules keep their FP8 metadata as extra state (TransformerEngineBaseModule
    .get_extra_state; its fusible operations' likewise): an empty byte tensor without FP8."""

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass


def _parameter(*shape, config):
    return torch.nn.Parameter(torch.empty(*shape, dtype=config.params_dtype))


def _tp_size(group) -> int:
    return group.size() if group is not None else 1


class _Linear(_ExtraState):
    """te.pytorch.Linear as megatron's TELinear sizes it (extensions/transformer_engine.py:975-1015):
    column parallel splits the output, row parallel the input; an expert's TP is its expert-TP group."""

    def __init__(self, input_size, output_size, *, parallel_mode, config, bias, tp_group=None, is_expert=False,
                 skip_bias_add=False, **_unused):
        super().__init__()
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        self.config = config
        if parallel_mode != "duplicated":
            tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
        self._tp_group = tp_group
        tp = _tp_size(tp_group) if parallel_mode != "duplicated" else 1
        out_size = output_size // tp if parallel_mode == "column" else output_size
        in_size = input_size // tp if parallel_mode == "row" else input_size
        self.parallel_mode = None if parallel_mode == "duplicated" else parallel_mode
        self.in_features, self.out_features, self.use_bias = in_size, out_size, bias
        self.te_return_bias = skip_bias_add and bias
        self.weight = _parameter(out_size, in_size, config=config)
        if bias:
            self.bias = _parameter(out_size, config=config)


class _TEColumnParallelLinear(_Linear):
    def __init__(self, input_size, output_size, **kwargs):
        super().__init__(input_size, output_size, parallel_mode="column", **kwargs)


class _TERowParallelLinear(_Linear):
    def __init__(self, input_size, output_size, **kwargs):
        kwargs.pop("input_is_parallel", None)
        super().__init__(input_size, output_size, parallel_mode="row", **kwargs)


class _TELayerNormColumnParallelLinear(_Linear):
    """te.pytorch.LayerNormLinear: the norm's weight (and bias for LayerNorm) over the full input."""

    def __init__(self, input_size, output_size, **kwargs):
        super().__init__(input_size, output_size, parallel_mode="column", **kwargs)
        self.layer_norm_weight = _parameter(input_size, config=self.config)
        if self.config.normalization == "LayerNorm":
            self.layer_norm_bias = _parameter(input_size, config=self.config)


class _TEDotProductAttention(_ExtraState):
    """te.pytorch.DotProductAttention: a learnable softmax offset per head of this rank."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, pg_collection=None, **kwargs):
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.config = config
        pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self._tp_group = pg_collection.tp
        if config.softmax_type == "learnable":
            self.softmax_offset = _parameter(config.num_attention_heads // _tp_size(self._tp_group), config=config)


class _TEGroupedLinear(_ExtraState):
    """te.pytorch.GroupedLinear as megatron's TEGroupedLinear sizes it (extensions/transformer_engine.py:
    2160-2200): one weight (and bias) per local expert, split over the expert-TP group."""

    def __init__(self, num_gemms, input_size, output_size, *, parallel_mode, config, bias, pg_collection=None,
                 **_unused):
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.config = config
        self._pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        self._tp_group = self._pg_collection.expt_tp
        tp = _tp_size(self._tp_group)
        out_size = output_size // tp if parallel_mode == "column" else output_size
        in_size = input_size // tp if parallel_mode == "row" else input_size
        self.num_gemms, self.use_bias = num_gemms, bias
        self.in_features, self.out_features = in_size, out_size
        self.fp8 = self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False}
        for i in range(num_gemms):
            setattr(self, f"weight{i}", _parameter(out_size, in_size, config=config))
            if bias:
                setattr(self, f"bias{i}", _parameter(out_size, config=config))
        # megatron saves one extra state per GEMM (`_extra_state`, `_extra_state1`, ...) and merges them
        # back before TE's load (its merge_extra_states pre-hook, extensions/transformer_engine.py:2337):
        # here, without FP8, there is nothing to merge
        self._register_load_state_dict_pre_hook(self._drop_per_gemm_extra_states)

    @staticmethod
    def _drop_per_gemm_extra_states(state_dict, prefix, *_args):
        for key in [k for k in state_dict if k.startswith(prefix + EXTRA_STATE) and k != prefix + EXTRA_STATE]:
            del state_dict[key]


class _TEColumnParallelGroupedLinear(_TEGroupedLinear):
    def __init__(self, num_gemms, input_size, output_size, **kwargs):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", **kwargs)


class _TERowParallelGroupedLinear(_TEGroupedLinear):
    def __init__(self, num_gemms, input_size, output_size, **kwargs):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", **kwargs)


class _Norm(_ExtraState):
    """te.pytorch.RMSNorm / LayerNorm: weight, and bias for LayerNorm."""

    def __init__(self, config, hidden_size):
        super().__init__()
        self.weight = _parameter(hidden_size, config=config)
        if config.normalization == "LayerNorm":
            self.bias = _parameter(hidden_size, config=config)


class TENorm:
    """megatron's TENorm (extensions/transformer_engine.py:796): builds the norm --normalization names."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, has_residual: bool = False):
        return _Norm(config, hidden_size)


@functools.lru_cache(maxsize=None)
def stand_ins() -> dict:
    """{megatron's class name: the stand-in with megatron's methods}."""
    made = {}
    grouped = _megatron_methods("TEGroupedLinear", _TEGroupedLinear)
    for name, base in (("TELinear", _Linear), ("TELayerNormColumnParallelLinear", _TELayerNormColumnParallelLinear),
                       ("TEColumnParallelLinear", _TEColumnParallelLinear), ("TERowParallelLinear", _TERowParallelLinear),
                       ("TEDotProductAttention", _TEDotProductAttention)):
        made[name] = _megatron_methods(name, base)
    for name, base in (("TEColumnParallelGroupedLinear", _TEColumnParallelGroupedLinear),
                       ("TERowParallelGroupedLinear", _TERowParallelGroupedLinear)):
        made[name] = _megatron_methods(name, type(base.__name__, (base, grouped), {}))
    made["TENorm"] = TENorm
    return made


def _install_te_stand_ins():
    from megatron.core import utils
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import attention, multi_latent_attention, transformer_block
    from packaging.version import Version

    classes = stand_ins()
    undo = [set_attr(provider, name, cls) for name, cls in classes.items()]
    # megatron's own activation is built (TEActivationOp only with --use-te-activation-func)
    undo.append(set_attr(provider, "TEActivationOp", None))
    undo.append(set_attr(gpt_layer_specs, "TENorm", classes["TENorm"]))
    mla = ("TELinear", "TEColumnParallelLinear", "TELayerNormColumnParallelLinear")
    for module, names in ((multi_latent_attention, mla), (attention, ("TELinear", "TENorm"))):
        undo += [set_attr(module, name, classes[name]) for name in names]
    undo.append(set_attr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider))
    undo.append(set_attr(transformer_block, "LayerNormImpl", classes["TENorm"]))
    undo.append(set_attr(utils, "_te_version", Version(ASSUMED_TE_VERSION)))
    return undo_all(undo)


TE_STAND_INS = Patch(
    "te_spec.stand_ins",
    ["megatron/core/extensions/transformer_engine_spec_provider.py:8",
     "megatron/core/models/gpt/gpt_layer_specs.py:54", "megatron/core/utils.py:71",
     "megatron/core/transformer/multi_latent_attention.py:525", "megatron/core/transformer/attention.py:129",
     "megatron/core/transformer/transformer_block.py:56",
     "megatron/core/extensions/transformer_engine.py:85"],
    "dry-run key check only: transformer-engine's spec built without transformer-engine (stand-ins holding "
    "its modules' parameters, megatron-core's own sharded_state_dict methods)",
    _install_te_stand_ins,
)
SEAMS = [TE_STAND_INS]


@contextlib.contextmanager
def standing_in():
    """The transformer-engine spec builds inside the block (its forward does not run)."""
    with TE_STAND_INS.applied():
        yield
