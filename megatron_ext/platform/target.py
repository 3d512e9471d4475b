"""The platform a configuration is validated for: this machine, or a declared target.

    train.py --recipe R --dry-run --platform cuda [--target-gpu h100] [--assume-te | --assume-no-te] [--assume-apex]

validates as a CUDA cluster would (CUDA present, of the GPU named by ``--target-gpu``, Hopper by default;
transformer-engine present or not; apex absent unless ``--assume-apex``), so a CPU machine checks a
cluster's start-up. What megatron asks the device while it validates (the compute capability) is
answered for that GPU (:func:`device_answers`), and the launch environment is the one the target needs.
Without ``--platform`` the target is this machine. The rules below are the ones megatron-core 0.19.2
applies when it builds the model on such a platform, moved to parse time:

* ``--transformer-impl transformer_engine`` (megatron's default) needs transformer-engine; where it
  is absent a *default* falls back to the local spec, an explicit request is refused.
* Fusions whose kernels are absent: a default is switched off (its source says why), an explicit
  request is refused. On CPU every fusion default is off.
* Norms of the local spec: RMSNorm with apex and no transformer-engine makes the final norm apex's
  FusedLayerNorm, which only does LayerNorm.

Imports nothing heavy at module level: ``scripts/slurm/launch_env.py`` loads this file by path to
decide the launch environment without importing torch.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
from dataclasses import dataclass

from megatron_ext.errors import ConfigError

# Recipe keys that are not accepted: where a configuration is checked is not part of it.
CLI_ONLY = ("platform", "assume_te", "assume_apex", "target_gpu")

# GPUs a declared CUDA target may name: (compute capability, device memory in GiB as torch reports it).
GPUS = {
    "a100": ((8, 0), 80), "h100": ((9, 0), 80), "h200": ((9, 0), 141), "b200": ((10, 0), 180),
    "gb200": ((10, 0), 186), "b300": ((10, 3), 270), "gb300": ((10, 3), 279),
}
DEFAULT_GPU = "h100"
# What a refusal for a kernel this machine lacks adds: where to validate for the cluster instead.
CLUSTER_HINT = "`--dry-run --platform cuda {hint}` validates it for a GPU cluster that has it"
# Compute capability the declared CUDA target is validated for by default (Hopper). Megatron needs
# CUDA_DEVICE_MAX_CONNECTIONS=1 below 10 (megatron/training/arguments.py:1414-1439).
ASSUMED_CUDA_ARCH = GPUS[DEFAULT_GPU][0][0]

# apex's CUDA extensions megatron-core imports by these names.
APEX_KERNELS = {
    "gradient_accumulation_fusion": "fused_weight_gradient_mlp_cuda",  # tensor_parallel/layers.py:51
    "masked_softmax_fusion": "scaled_masked_softmax_cuda",  # fusions/fused_softmax.py:81,357
}
# apex's FusedLayerNorm (fusions/fused_layer_norm.py:23), the local spec's norm with apex; it runs the
# persistent kernel where apex.contrib has it and falls back otherwise (:100).
APEX_NORM = "fused_layer_norm_cuda"


@dataclass(frozen=True)
class Target:
    cuda: bool
    te: bool
    apex: bool
    declared: bool  # named by --platform (else: this machine)
    gpu: str | None = None  # a declared CUDA target's GPU (GPUS)

    @property
    def name(self) -> str:
        return "cuda" if self.cuda else "cpu"

    @property
    def arch(self) -> int:
        return GPUS[self.gpu][0][0] if self.gpu else ASSUMED_CUDA_ARCH

    def describe(self) -> str:
        if not self.declared:
            parts = [f"this machine ({self.name})"]
        else:
            parts = [f"declared {self.name}" + (f" ({self.gpu}, compute capability "
                                                 f"{'.'.join(map(str, GPUS[self.gpu][0]))})" if self.gpu else "")]
        parts.append("transformer-engine " + ("present" if self.te else "absent"))
        parts.append("apex " + ("present" if self.apex else "absent"))
        return ", ".join(parts)

    def why_missing(self, what: str) -> str:
        """Why a kernel is not there, short (for the printed source of a default)."""
        if not self.cuda:
            return "CPU"
        return f"no {what} on the target" if self.declared else f"no {what} here"

    def refusal(self, what: str) -> str:
        """The same, for an error message: says how to declare it present."""
        hint = {"transformer-engine": "--assume-te", "apex": "--assume-apex"}.get(what)
        if self.declared and self.cuda and hint:
            return f"{self.why_missing(what)} ({hint} if the cluster has it)"
        if not self.declared and hint:
            return f"{self.why_missing(what)} ({CLUSTER_HINT.format(hint=hint)})"
        return self.why_missing(what)


def add_arguments(group) -> None:
    group.add_argument(
        "--platform", choices=("cuda", "cpu"), default=None,
        help="With --dry-run: validate for this platform instead of this machine (a CPU machine checks "
        "a GPU cluster's start-up). cuda assumes Hopper GPUs, apex absent unless --assume-apex, and "
        "transformer-engine as --assume-te/--assume-no-te say (default: as importable here).",
    )
    te = group.add_mutually_exclusive_group()
    te.add_argument("--assume-te", dest="assume_te", action="store_const", const=True, default=None,
                    help="With --platform cuda: transformer-engine is installed on the target.")
    te.add_argument("--assume-no-te", dest="assume_te", action="store_const", const=False,
                    help="With --platform cuda: transformer-engine is not installed on the target.")
    group.add_argument("--assume-apex", action="store_true", default=False,
                       help="With --platform cuda: NVIDIA apex with its CUDA extensions is installed on the target.")
    group.add_argument("--target-gpu", choices=sorted(GPUS), default=None,
                       help=f"With --platform cuda: the GPU the cluster has (default {DEFAULT_GPU}); megatron's "
                       "questions to the device (compute capability) are answered for it.")


@functools.lru_cache(maxsize=None)
def te_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False
    return True


@functools.lru_cache(maxsize=None)
def apex_importable() -> bool:
    """apex with the CUDA extensions megatron-core uses (the package alone is not enough)."""
    try:
        return all(importlib.util.find_spec(m) is not None for m in ("apex", APEX_NORM, *APEX_KERNELS.values()))
    except (ImportError, ValueError):
        return False


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve(args) -> Target:
    """The platform this validation is for: answers "is CUDA / transformer-engine / apex there"."""
    declared = args.platform
    assume_te = args.assume_te
    assume_apex = args.assume_apex
    gpu = args.target_gpu
    if declared != "cuda" and gpu is not None:
        raise ConfigError(f"--target-gpu={gpu}: only with --platform cuda (it describes a target, not this machine)")
    if declared is None:
        if assume_te is not None or assume_apex:
            flag = "--assume-apex" if assume_apex else ("--assume-te" if assume_te else "--assume-no-te")
            raise ConfigError(f"{flag}: only with --platform cuda (it describes a target, not this machine)")
        cuda = _cuda_here()
        return Target(cuda=cuda, te=cuda and te_importable(), apex=cuda and apex_importable(), declared=False)
    if not args.dry_run:
        raise ConfigError(f"--platform={declared}: only with --dry-run (a real run is validated for the machine it runs on)")
    if declared == "cpu":
        if assume_te or assume_apex:
            raise ConfigError(f"--platform=cpu with {'--assume-te' if assume_te else '--assume-apex'}: "
                              "transformer-engine and apex kernels need CUDA")
        return Target(cuda=False, te=False, apex=False, declared=True)
    te = te_importable() if assume_te is None else assume_te
    return Target(cuda=True, te=te, apex=bool(assume_apex), declared=True, gpu=gpu or DEFAULT_GPU)


@contextlib.contextmanager
def device_answers(target: Target, env: dict | None = None):
    """While megatron validates for a declared CUDA target on a machine without CUDA, its questions to
    the device are answered for the target's GPU, and the launch environment is the target's:
    torch.cuda.get_device_capability (megatron/training/arguments.py:1339, --moe-grouped-gemm),
    torch.cuda.get_device_properties and get_device_arch_version (megatron/training/utils/
    common_utils.py:504, read at megatron/training/arguments.py:1414, 1444, 1484), and
    CUDA_DEVICE_MAX_CONNECTIONS (asserted at megatron/training/arguments.py:1437) as `env` (the
    target's launch_env) sets it. On this CPU: only the launch environment. Elsewhere: nothing."""
    import types

    if _cuda_here():
        yield
        return
    if not (target.declared and target.cuda):
        # this CPU: only the launch environment (the CPU shims set CUDA_DEVICE_MAX_CONNECTIONS=1 for
        # megatron's TP check; FSDP asserts it unset, arguments.py:1143), for validation's duration
        with _environment(env or {}):
            yield
        return
    import torch
    from megatron.training import arguments

    from megatron_ext.patching import set_attr, undo_all

    (major, minor), gib = GPUS[target.gpu]
    props = types.SimpleNamespace(name=f"{target.gpu} (declared target)", major=major, minor=minor,
                                  total_memory=gib << 30, multi_processor_count=132)
    undo = undo_all([
        set_attr(torch.cuda, "get_device_capability", lambda device=None: (major, minor)),
        set_attr(torch.cuda, "get_device_properties", lambda device=None: props),
        set_attr(arguments, "get_device_arch_version", lambda: major),
    ])
    try:
        with _environment(env or {}):
            yield
    finally:
        undo()


@contextlib.contextmanager
def _environment(env: dict):
    """`env` (value None = unset) in os.environ for the duration, then the previous values."""
    import os

    before = {key: os.environ.get(key) for key in env}
    try:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ------------------------------------------------------------------------------------------------
# Fusions. Megatron turns them on by default; where their kernels cannot run, a *default* is switched
# off and marked so in the printed configuration, an explicit request is refused.
#   needs "te":      transformer-engine's kernel
#   needs "apex":    apex's CUDA extension (APEX_KERNELS)
#   needs "compile": megatron's jit_fuser (torch.compile); runs on CUDA, ~18 s of compiling per
#                    process on CPU, so only the default is switched off there
# "local": only the local spec reaches it (transformer-engine layers bring their own kernels).
# ------------------------------------------------------------------------------------------------
FUSIONS = (
    ("apply_rope_fusion", "te", False),  # models/common/embeddings/rope_utils.py:316
    # every ColumnParallelLinear checks it (tensor_parallel/layers.py:1070), and GPTModel's output
    # layer is one with the transformer-engine spec too
    ("gradient_accumulation_fusion", "apex", False),
    ("masked_softmax_fusion", "apex", True),  # DotProductAttention's FusedScaleMaskSoftmax
    ("bias_dropout_fusion", "compile", False),
    ("bias_gelu_fusion", "compile", False),
    ("bias_swiglu_fusion", "compile", False),
    ("cross_entropy_loss_fusion", "compile", False),
)


def _missing(target: Target, needs: str) -> str | None:
    """What a kernel of this kind lacks on the target ("transformer-engine", "apex", "cuda"), or None."""
    if needs == "te" and not target.te:
        return "transformer-engine"
    if needs == "apex" and not target.apex:
        return "apex"
    if not target.cuda:
        return "cuda"
    return None


def fit_defaults(args, target: Target | None = None) -> Target:
    """Adjust platform-dependent defaults to `target` (default: resolve(args)); refuse explicit
    requests that cannot run there. Records the target on args for the printed configuration."""
    target = target or resolve(args)
    sources = args.config_sources
    args.target_platform = target.describe()
    sources["target_platform"] = "cli (--platform)" if target.declared else "this machine"

    if args.transformer_impl == "transformer_engine" and not target.te:
        if sources["transformer_impl"] != "default":
            raise ConfigError(
                f"--transformer-impl=transformer_engine ({sources['transformer_impl']}): "
                f"{target.refusal('transformer-engine')}; use --transformer-impl local"
            )
        args.transformer_impl = "local"
        sources["transformer_impl"] = "default (no transformer-engine)"
    local = args.transformer_impl == "local"

    for name, needs, local_only in FUSIONS:
        if not getattr(args, name, False) or (local_only and not local):
            continue
        if needs == "compile" and not target.cuda:
            if sources.get(name) == "default":  # torch.compile works on CPU, slowly: only defaults go
                setattr(args, name, False)
                sources[name] = "default (off: CPU)"
            continue
        missing = _missing(target, needs)
        if missing is None:
            continue
        if sources.get(name) in ("recipe", "cli"):
            kernel = APEX_KERNELS.get(name, "transformer-engine's kernel" if needs == "te" else "its kernel")
            raise ConfigError(f"{name}=True ({sources[name]}) needs {kernel}: {target.refusal(missing)}")
        setattr(args, name, False)
        sources[name] = f"default (off: {target.why_missing(missing)})"
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te" \
            and not target.te:
        raise ConfigError(f"--cross-entropy-fusion-impl=te: {target.refusal('transformer-engine')}")

    # Persistent LayerNorm is an apex kernel; torch's norm refuses it (torch_norm.py:48).
    if local and not target.apex and not args.no_persist_layer_norm:
        if sources["no_persist_layer_norm"] != "default":
            raise ConfigError(
                f"--no-persist-layer-norm=False ({sources['no_persist_layer_norm']}): the persistent "
                f"LayerNorm needs apex ({target.refusal('apex')})"
            )
        args.no_persist_layer_norm = True
        sources["no_persist_layer_norm"] = "default (on: no apex)" if target.cuda else "default (on: CPU)"

    # With apex, the local spec's final norm is apex's FusedLayerNorm (gpt_layer_specs.py:68 for the
    # MoE block spec; transformer_block.py:56-59 for a layer spec, unless transformer-engine is
    # importable), which only does LayerNorm (fused_layer_norm.py:66).
    moe = bool(args.num_experts)
    if local and target.apex and args.normalization == "RMSNorm" and (moe or not target.te):
        raise ConfigError(
            "--normalization=RMSNorm with --transformer-impl=local: with apex installed megatron builds "
            "the final norm as apex's FusedLayerNorm, which only does LayerNorm; use the "
            "transformer_engine spec"
        )
    fsdp = bool(args.use_megatron_fsdp or args.use_torch_fsdp2)
    args.launch_env = launch_env(
        tp=args.tensor_model_parallel_size, cp=args.context_parallel_size, fsdp=fsdp,
        arch=target.arch,
    ) if target.cuda else launch_env(tp=1, cp=1, fsdp=fsdp)  # on CPU only FSDP's "unset" matters
    sources["launch_env"] = "derived (launch environment megatron needs on the target)"
    return target


def launch_env(tp: int, cp: int, fsdp: bool, arch: int = ASSUMED_CUDA_ARCH) -> dict:
    """The launch environment megatron needs on CUDA (megatron/training/arguments.py:1414-1439):
    CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor or context parallelism before Blackwell (one hardware
    queue orders the TP/SP communication before the compute that needs it); Megatron-FSDP (and
    torch FSDP2) want it unset. Value None = unset."""
    if fsdp:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": None}
    if (tp > 1 or cp > 1) and arch < 10:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}
