"""CUDA graphs for dropless MoE layers: ``--cuda-graph-impl local --cuda-graph-modules moe`` (or its
deprecated spelling ``--cuda-graph-scope moe``) with ``--moe-zero-sync-dropless``.

Upstream, megatron-core refuses the ``moe`` scope unless the MoE drops and pads
(transformer_config.py:2511, "moe cuda graph is only supported with drop-padding MoE"), and even then
its local implementation captures nothing in a GPT model: only ``MoETransformerLayer`` (hybrid models)
creates a graph manager for that scope (transformer_layer.py:1597-1613), GPT's layers are plain
``TransformerLayer``s (transformer_layer.py:541-567 has no ``moe`` branch). The zero-sync dropless
layer has fixed shapes and no host read, so here every MoE layer's forward (router, dispatch, experts,
combine, shared experts) is captured and replayed by megatron's own ``CudaGraphManager``
(cuda_graphs.py:1763) bound to ``MoELayer.forward``, as megatron binds it to an MoE transformer layer's
router (transformer_layer.py:1580): the first iteration records, megatron's schedule captures the graphs
at its end (schedules.py:862 ``create_cudagraphs``), later iterations replay forward and backward.

The checks, before any compute (:func:`before_validate`), one line each:

* ``--cuda-graph-impl`` other than ``local``, or modules other than ``moe``: refused (transformer-engine's
  and full-iteration capture run in megatron's own training loop; whole-layer capture is not verified here);
* ``moe`` without ``--moe-zero-sync-dropless``: refused, as megatron refuses it;
* no CUDA here: refused ("needs CUDA"); ``--dry-run --platform cuda`` validates it for a GPU cluster;
* what megatron's local graphs do not run with a captured MoE layer: its ``moe`` recomputation
  (megatron switches MoELayer's recompute off under local graphs, moe_layer.py:246-250), the EP overlap
  (``--overlap-moe-expert-parallel-comm``) and the shared-expert overlap (side streams).

Accepted, ``moe`` is taken out of what megatron's validation sees (its drop-padding assert), and put back
in the TransformerConfig before the model is built (:func:`before_model`, where GPT layers read it and
create no manager of their own). The RNG tracker becomes megatron's graph-safe one
(seams.moe.graph_safe_rng, what megatron's initialize does for CUDA graphs, initialize.py:119).
"""
from __future__ import annotations

from megatron_ext.errors import ConfigError
from megatron_ext.moe.options import MoEOptions

IMPL = "--cuda-graph-impl"
MODULES = "--cuda-graph-modules"
_active: list = []  # a run of this process is set up for graphs (before_model) and not torn down yet


def requested(args) -> bool:
    """Does this run capture its MoE layers (validated by :func:`before_validate`)?"""
    return args.cuda_graph_impl == "local" and MoEOptions.from_args(args).zero_sync_dropless


def capturing(args) -> bool:
    """Requested, and the model is built on CUDA here (not a GPU run's model traced on CPU)."""
    from megatron_ext import platform

    return requested(args) and platform.current().is_cuda


def _names(values) -> list:
    """Module names as given (strings, or megatron's CudaGraphModule enums after its parser's type)."""
    return [getattr(v, "name", v) for v in (values or [])]


def before_validate(args, zero_sync_flag: str) -> None:
    """Accept or refuse megatron's CUDA-graph flags (see the module's docstring); ``zero_sync_flag``: the
    zero-sync layer's flag, as the package names it."""
    from megatron_ext.platform.target import resolve

    impl = args.cuda_graph_impl
    deprecated = args.cuda_graph_scope_deprecated
    given = _names(deprecated if deprecated is not None else args.cuda_graph_modules)
    spelled = "--cuda-graph-scope" if deprecated is not None else MODULES
    if impl == "none":
        return  # megatron: modules have no effect without an implementation
    if impl != "local":
        raise ConfigError(f"{IMPL}={impl}: this loop captures CUDA graphs only for the dropless MoE layers of "
                          f"{zero_sync_flag}: {IMPL} local {MODULES} moe ({impl}'s capture is run by megatron's own "
                          "training loop)")
    if given != ["moe"]:
        shown = " ".join(given) if given else "(none: whole layers)"
        raise ConfigError(f"{IMPL}=local, {spelled}={shown}: this loop captures only the MoE layers: "
                          f"{spelled} moe, with {zero_sync_flag}")
    if not MoEOptions.from_args(args).zero_sync_dropless:
        raise ConfigError(f"{IMPL}=local, {spelled}=moe: moe cuda graph is only supported with drop-padding "
                          f"MoE (megatron-core), whose local graphs capture nothing in a GPT model; this loop "
                          f"captures dropless MoE layers with {zero_sync_flag} (no host synchronisation)")
    if not resolve(args).cuda:
        raise ConfigError(f"{IMPL}=local: CUDA graphs need CUDA, which this machine lacks; `--dry-run --platform "
                          "cuda` validates the run for a GPU cluster")
    for flag, on, why in (
        ("--recompute-modules moe", "moe" in (args.recompute_modules or [])
         and args.recompute_granularity == "selective",
         "megatron switches the MoE layer's recomputation off under local CUDA graphs (moe_layer.py:246-250)"),
        ("--overlap-moe-expert-parallel-comm", args.overlap_moe_expert_parallel_comm,
         "megatron's EP overlap splits the MoE layer the graph captures whole"),
        ("--moe-shared-expert-overlap", args.moe_shared_expert_overlap,
         "the shared experts' side stream is not captured"),
    ):
        if on:
            raise ConfigError(f"{IMPL}=local, {spelled}=moe with {flag}: {why}")
    args.cuda_graph_modules = []  # megatron's validation and config see none (its drop-padding assert)
    if deprecated is not None:
        args.cuda_graph_scope_deprecated = None
    args.config_sources["cuda_graph_modules"] = (f"{spelled} moe: the MoE layers, captured by megatron_ext.moe "
                                                 "(megatron's validation sees none)")


def before_model(args, config) -> None:
    """The ``moe`` scope back in the config (GPT layers then create no graph manager of their own) and
    megatron's graph-safe RNG tracker, before the model is built. Built on CPU (a real CPU run is refused
    before: this is a GPU run's model traced here, the planner's), without graphs."""
    if not requested(args):
        return
    from megatron.core.transformer.enums import CudaGraphModule

    from megatron_ext.seams import moe as moe_seams

    if not capturing(args):
        config.cuda_graph_impl, config.cuda_graph_modules = "none", []
        return

    _active.append(True)
    moe_seams.graph_safe_rng()
    config.cuda_graph_modules = [CudaGraphModule.moe]


def capture(moe_layer) -> None:
    """Bind megatron's CUDA-graph manager to this MoE layer's forward (seams.moe.capture_forward)."""
    from megatron_ext.seams import moe as moe_seams

    moe_seams.capture_forward(moe_layer)


def teardown() -> None:
    """The run's graphs, their pool, the side stream and the graph-safe RNG released
    (seams.moe.release_graphs), so the next run in this process starts clean."""
    if _active:
        from megatron_ext.seams import moe as moe_seams

        _active.clear()
        moe_seams.release_graphs()
