"""--dry-run --platform cuda [--assume-te | --assume-no-te] [--assume-apex]: a CPU machine validates a
configuration as a CUDA cluster would (megatron_ext/platform/target.py)."""
from __future__ import annotations

import contextlib
import io
import os
import types

import pytest

import arguments
from megatron_ext.errors import ConfigError
from megatron_ext.platform import cpu_shims, target

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "recipes", "tiny_dense.yaml")
NO_TE = ("--platform", "cuda", "--assume-no-te")
TE = ("--platform", "cuda", "--assume-te")


def parse(*argv, recipe_path=TINY):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        args = arguments.parse(["--recipe", recipe_path, "--mock-data", "--dry-run", *argv], exit_on_dry_run=False)
    return args, out.getvalue()


def recipe(tmp_path, extra: str = "", drop: str = "") -> str:
    lines = [l for l in open(TINY).read().splitlines() if not (drop and l.startswith(drop))]
    path = tmp_path / "r.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return str(path)


def test_gpu_without_apex_switches_kernel_fusions_off_and_keeps_compiled_ones():
    args, out = parse(*NO_TE)
    src = args.config_sources
    for name in ("gradient_accumulation_fusion", "masked_softmax_fusion"):
        assert getattr(args, name) is False and src[name] == "default (off: no apex on the target)"
    assert args.apply_rope_fusion is False
    assert src["apply_rope_fusion"] == "default (off: no transformer-engine on the target)"
    assert args.no_persist_layer_norm is True and src["no_persist_layer_norm"] == "default (on: no apex)"
    # torch.compile fusions run on CUDA: megatron's defaults stay (on CPU they are switched off)
    assert args.bias_swiglu_fusion is True and src["bias_swiglu_fusion"] == "default"
    assert args.bias_dropout_fusion is True
    assert "declared cuda (h100, compute capability 9.0), transformer-engine absent, apex absent" in out
    here, _ = parse()
    assert here.bias_swiglu_fusion is False and here.config_sources["bias_swiglu_fusion"] == "default (off: CPU)"


def test_gpu_with_apex_and_te_keeps_megatron_defaults():
    args, _ = parse("--platform", "cuda", "--assume-te", "--assume-apex")
    assert args.gradient_accumulation_fusion and args.masked_softmax_fusion and args.apply_rope_fusion
    assert args.no_persist_layer_norm is False  # local spec with apex: the persistent kernel exists


@pytest.mark.parametrize("key,match", [
    ("masked_softmax_fusion", r"masked_softmax_fusion=True \(recipe\) needs scaled_masked_softmax_cuda: "
                              r"no apex on the target \(--assume-apex if the cluster has it\)"),
    ("gradient_accumulation_fusion", r"needs fused_weight_gradient_mlp_cuda: no apex on the target"),
    ("apply_rope_fusion", r"apply_rope_fusion=True \(recipe\) needs transformer-engine's kernel: "
                          r"no transformer-engine on the target \(--assume-te"),
])
def test_explicit_fusion_without_its_kernel_is_refused(tmp_path, key, match):
    path = recipe(tmp_path, f"{key}: true\n")
    with pytest.raises(ConfigError, match=match):
        parse(*NO_TE, recipe_path=path)
    parse("--platform", "cuda", "--assume-te", "--assume-apex", "--normalization", "LayerNorm", recipe_path=path)


def test_transformer_engine_spec_follows_the_assumption(tmp_path):
    path = recipe(tmp_path, drop="transformer_impl")  # megatron's default: transformer_engine
    assert parse(*TE, recipe_path=path)[0].transformer_impl == "transformer_engine"
    args, _ = parse(*NO_TE, recipe_path=path)
    assert args.transformer_impl == "local" and args.config_sources["transformer_impl"] == "default (no transformer-engine)"
    with pytest.raises(ConfigError, match=r"^--transformer-impl=transformer_engine \(cli\): no transformer-engine on "
                                          r"the target \(--assume-te if the cluster has it\); use --transformer-impl local$"):
        parse(*NO_TE, "--transformer-impl", "transformer_engine", recipe_path=path)


def test_rmsnorm_on_the_local_spec_with_apex_and_without_te_is_refused():
    with pytest.raises(ConfigError, match=r"--normalization=RMSNorm with --transformer-impl=local: with apex"):
        parse(*NO_TE, "--assume-apex")
    parse(*NO_TE, "--assume-apex", "--normalization", "LayerNorm")
    parse(*TE, "--assume-apex")  # dense layer spec: the final norm is transformer-engine's


@pytest.mark.parametrize("argv,match", [
    (["--platform", "cuda"], r"^--platform=cuda: only with --dry-run"),
    (["--assume-te"], r"^--assume-te: only with --platform cuda"),
    (["--assume-apex"], r"^--assume-apex: only with --platform cuda"),
])
def test_target_flags_misused(argv, match):
    with pytest.raises(ConfigError, match=match):
        arguments.parse(["--recipe", TINY, "--mock-data", *argv], exit_on_dry_run=False)


def test_cpu_target_refuses_cuda_kernels_and_target_is_not_a_recipe_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^--platform=cpu with --assume-te"):
        parse("--platform", "cpu", "--assume-te")
    # argparse: the two assumptions exclude each other (its errors are one-line refusals too)
    with pytest.raises(ConfigError, match=r"^argument --assume-no-te: not allowed with argument --assume-te$"):
        parse("--platform", "cuda", "--assume-te", "--assume-no-te")
    with pytest.raises(ConfigError, match=r"unknown key 'platform'"):
        parse(recipe_path=recipe(tmp_path, "platform: cuda\n"))


@pytest.mark.parametrize("tp,cp,fsdp,arch,expected", [
    (1, 1, False, 9, {}),
    (2, 1, False, 9, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    (1, 2, False, 8, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    (8, 1, False, 10, {}),  # Blackwell: megatron no longer needs it
    (2, 1, True, 9, {"CUDA_DEVICE_MAX_CONNECTIONS": None}),  # Megatron-FSDP wants it unset
])
def test_launch_env(tp, cp, fsdp, arch, expected):
    assert target.launch_env(tp=tp, cp=cp, fsdp=fsdp, arch=arch) == expected


def test_tp_on_the_cuda_target_reports_the_launch_environment():
    args, out = parse(*NO_TE, "--tensor-model-parallel-size", "2", "--world-size", "2")
    assert args.launch_env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert "launch_env" in out and "CUDA_DEVICE_MAX_CONNECTIONS" in out
    assert parse()[0].launch_env == {}  # this machine: CPU, nothing to set


def test_model_build_installs_the_sequence_parallel_norm_on_cuda(monkeypatch):
    """The local spec's torch norm under sequence parallelism: on CPU a shim makes it work; on CUDA
    the model builder installs the same seam (here with the shim removed and CUDA pretended)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.training import model as models

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, sequence_parallel=True,
                               tensor_model_parallel_size=2, normalization="RMSNorm", persist_layer_norm=False)
    args = types.SimpleNamespace(transformer_impl="local")
    with cpu_shims.without("torch_norm_sequence_parallel"):
        with pytest.raises(AssertionError, match="sequence parallel not supported"):
            WrappedTorchNorm(config, 8)
        models.install_seams(args, config)  # no CUDA: nothing (the shim's business)
        with pytest.raises(AssertionError):
            WrappedTorchNorm(config, 8)
        monkeypatch.setattr(models, "platform", types.SimpleNamespace(current=lambda: types.SimpleNamespace(is_cuda=True)))
        models.install_seams(args, config)
        norm = WrappedTorchNorm(config, 8)
        assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())  # grads all-reduced over TP
        models.install_seams(types.SimpleNamespace(transformer_impl="transformer_engine"), config)  # idempotent
    assert cpu_shims.SHIMS["torch_norm_sequence_parallel"].active
    with cpu_shims.without("torch_norm_sequence_parallel"), pytest.raises(AssertionError):
        WrappedTorchNorm(config, 8)  # the removal undid the seam too


def test_target_gpu_answers_megatrons_device_questions():
    import torch
    from megatron.training import arguments as margs

    before = (torch.cuda.get_device_capability, margs.get_device_arch_version)
    # TP2 before Blackwell: the launch environment needs CUDA_DEVICE_MAX_CONNECTIONS=1; from Blackwell on not
    hopper, _ = parse(*TE, "--tensor-model-parallel-size", "2", "--world-size", "2")
    blackwell, _ = parse(*TE, "--target-gpu", "b200", "--tensor-model-parallel-size", "2", "--world-size", "2")
    assert "h100" in hopper.target_platform and hopper.launch_env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert "b200" in blackwell.target_platform and blackwell.launch_env == {}
    captured = {}
    with target.device_answers(target.resolve(blackwell), blackwell.launch_env):
        captured["capability"] = torch.cuda.get_device_capability()
        captured["arch"] = margs.get_device_arch_version()
    assert captured == {"capability": (10, 0), "arch": 10}
    assert (torch.cuda.get_device_capability, margs.get_device_arch_version) == before  # put back
    # megatron's grouped-GEMM check asks the device (megatron/training/arguments.py:1339)
    moe = os.path.join(ROOT, "recipes", "tiny_moe.yaml")
    assert parse(*TE, "--moe-grouped-gemm", recipe_path=moe)[0].moe_grouped_gemm
    with pytest.raises(ConfigError, match="^--target-gpu=b200: only with --platform cuda"):
        parse("--target-gpu", "b200")


def test_nsys_profile_range_is_a_cuda_feature_accepted_on_a_cuda_target():
    args, _ = parse(*TE, "--profile", "--profile-step-start", "2", "--profile-step-end", "3")
    assert args.profile and not args.use_pytorch_profiler
    with pytest.raises(ConfigError, match="^--profile without --use-pytorch-profiler is an nsys capture range"):
        parse("--profile", "--profile-step-start", "2", "--profile-step-end", "3")
