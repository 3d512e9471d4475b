"""CUDA graphs for dropless MoE layers (megatron_ext/moe/graphs.py): which CUDA-graph flags a run
accepts, refused by name otherwise; what the model is built with. The capture itself needs CUDA
(scripts/gpu_check.py, section moe_graphs); tests/moe/test_audit.py proves on CPU that the captured
region has no host read, no host tensor in a device op and static shapes."""
import contextlib
import io
import types

import pytest

import arguments
from megatron_ext.errors import ConfigError

BASE = ["--recipe", "recipes/tiny_moe.yaml", "--dry-run", "--moe-sync-free-dispatcher", "--moe-zero-sync-dropless"]
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe"]


def parse(*argv):
    with contextlib.redirect_stdout(io.StringIO()):
        return arguments.parse([*BASE, *argv], exit_on_dry_run=False)


def test_a_cuda_dry_run_accepts_moe_graphs_and_the_model_is_built_with_the_moe_scope(monkeypatch):
    """megatron's validation sees no module (its drop-padding assert); the config the model is built
    from has the moe scope back, with which megatron's GPT layers make no graph manager of their own
    (with no module they would capture whole layers), and the RNG tracker is made graph-safe."""
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.enums import CudaGraphModule
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_ext.moe import graphs
    from megatron_ext.seams import moe as moe_seams

    for spelling in (["--cuda-graph-modules", "moe"], ["--cuda-graph-scope", "moe"]):
        args = parse("--platform", "cuda", "--bf16", "--cuda-graph-impl", "local", *spelling)
        assert args.cuda_graph_impl == "local" and args.cuda_graph_modules == [] and graphs.requested(args)
        assert "captured by megatron_ext.moe" in args.config_sources["cuda_graph_modules"]
    made = []
    monkeypatch.setattr(moe_seams, "graph_safe_rng", lambda: made.append("rng"))
    monkeypatch.setattr(moe_seams, "release_graphs", lambda: made.append("released"))
    monkeypatch.setattr(cuda_graphs, "CudaGraphManager", lambda config, *a, **k: made.append("manager"))
    traced = core_transformer_config_from_args(args)  # built here, on CPU: the planner's trace of a GPU run
    graphs.before_model(args, traced)
    assert (traced.cuda_graph_impl, traced.cuda_graph_modules, made) == ("none", [], [])
    assert not graphs.capturing(args)
    monkeypatch.setattr(graphs, "capturing", graphs.requested)  # as on a GPU
    config = core_transformer_config_from_args(args)
    graphs.before_model(args, config)
    assert config.cuda_graph_modules == [CudaGraphModule.moe] and made == ["rng"]
    graphs.teardown()  # the run's teardown releases megatron's graphs, pool, side stream, graph-safe RNG
    graphs.teardown()
    assert made == ["rng", "released"]
    made.remove("released")
    layer = types.SimpleNamespace(config=config, is_moe_layer=True,
                                  submodules_config=types.SimpleNamespace(self_attention=object(), mlp=object()))
    TransformerLayer.create_mcore_cudagraph_manager(layer, config)
    assert made == ["rng"] and not hasattr(layer, "cudagraph_manager")
    config.cuda_graph_modules = []
    TransformerLayer.create_mcore_cudagraph_manager(layer, config)  # the control: a whole-layer manager
    assert made == ["rng", "manager"]


@pytest.mark.parametrize("argv,line", [
    (["--platform", "cpu", "--bf16", *GRAPHS], "--cuda-graph-impl=local: CUDA graphs need CUDA"),
    (["--platform", "cuda", "--bf16", "--cuda-graph-impl", "local", "--cuda-graph-modules", "attn"],
     "--cuda-graph-impl=local, --cuda-graph-modules=attn: this loop captures only the MoE layers"),
    (["--platform", "cuda", "--bf16", "--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "moe"],
     "--cuda-graph-impl=transformer_engine: this loop captures CUDA graphs only for"),
    (["--platform", "cuda", *GRAPHS], "--moe-zero-sync-dropless=True with fp32 (no --bf16): on CUDA the grouped GEMM"),
    (["--platform", "cuda", "--bf16", "--target-gpu", "a100"],
     "--moe-zero-sync-dropless=True on --target-gpu=a100: torch's bf16 grouped-GEMM kernel needs compute"),
])
def test_refused_by_name(argv, line):
    with pytest.raises(ConfigError) as e:
        parse(*argv)
    assert str(e.value).startswith(line), str(e.value)


def test_without_the_zero_sync_layer_refused_as_megatron_refuses_it():
    with pytest.raises(ConfigError) as e, contextlib.redirect_stdout(io.StringIO()):
        arguments.parse(["--recipe", "recipes/tiny_moe.yaml", "--dry-run", "--platform", "cuda", "--bf16", *GRAPHS],
                        exit_on_dry_run=False)
    assert str(e.value).startswith("--cuda-graph-impl=local, --cuda-graph-modules=moe: moe cuda graph is only "
                                   "supported with drop-padding MoE (megatron-core)"), str(e.value)
