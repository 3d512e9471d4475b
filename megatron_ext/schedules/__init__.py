"""1F1B backward-forward overlap that hides tensor-parallel communication.

Flag: ``--overlap-tp-comm-1f1b``. With it, the steady phase of the pipeline schedule (and, without
pipelining, each pair of consecutive micro-batches) runs the backward of one micro-batch and the
forward of another interleaved at every TP collective: each collective is issued async and waited
on only after the other micro-batch's compute up to its own next collective (lanes.py). Loss and
gradients are bit-identical to megatron's plain schedule. See docs/overlap.md.
"""
from __future__ import annotations

from megatron_ext.config.typed import add_group
from megatron_ext.counters import SinceLastCall
from megatron_ext.errors import ConfigError
from megatron_ext.schedules.options import OverlapOptions

FLAG = "--overlap-tp-comm-1f1b"
ALIAS = "--overlap-model-parallel-comm-1f1b"


def model_parallel_sizes(args) -> dict:
    """The model-parallel groups whose collectives the paired passes issue: {name: size}."""
    tp = args.tensor_model_parallel_size or 1
    moe = bool(args.num_experts)
    ep = (args.expert_model_parallel_size or 1) if moe else 1
    etp = args.expert_tensor_parallel_size
    etp = (etp if etp is not None else tp) if moe else 1
    return {"tp": tp, "ep": ep, "etp": etp, "cp": args.context_parallel_size or 1}


def add_arguments(parser):
    add_group(parser, OverlapOptions, "megatron_ext: backward-forward TP-communication overlap",
              "1F1B overlap hiding tensor-parallel communication (docs/overlap.md)")
    return parser


def validate(args) -> None:
    """Refuse, naming flag and value, every setting under which the overlap cannot apply."""
    if not OverlapOptions.from_args(args).overlap_tp_comm_1f1b:
        return
    on = f"{FLAG}=True"
    sizes = model_parallel_sizes(args)
    if max(sizes.values()) < 2:
        ep = args.expert_model_parallel_size or 1
        raise ConfigError(
            f"{on} has nothing to hide: --tensor-model-parallel-size={sizes['tp']} "
            f"--expert-model-parallel-size={ep} --context-parallel-size={sizes['cp']}"
            + ("" if args.num_experts else " (dense model)")
            + " issue no model-parallel collective (use TP >= 2, CP >= 2, or EP >= 2 with MoE, or drop the flag)"
        )
    incompatible = {
        "delay_wgrad_compute": (
            "--delay-wgrad-compute",
            "megatron runs delayed weight gradients only inside its own combined-1F1B plan "
            "(transformer_config.py:2750 needs --overlap-moe-expert-parallel-comm) with "
            "transformer-engine layers (arguments.py:1823); use those two flags instead of this one",
        ),
        "overlap_moe_expert_parallel_comm": (
            "--overlap-moe-expert-parallel-comm",
            "megatron's combined-1F1B schedule and ours both pair a forward with a backward; ours "
            "already overlaps the EP all-to-all (it hands off at every TP and EP collective)",
        ),
        "defer_embedding_wgrad_compute": (
            "--defer-embedding-wgrad-compute",
            "not supported by the overlapped schedule",
        ),
        "num_microbatches_with_partial_activation_checkpoints": (
            "--num-microbatches-with-partial-activation-checkpoints",
            "not supported by the overlapped schedule",
        ),
        "variable_seq_lengths": ("--variable-seq-lengths", "pipeline messages have fixed shapes here"),
        "hybrid_context_parallel": ("--hybrid-context-parallel", "has its own schedule"),
    }
    given = vars(args)
    for dest, (flag, why) in incompatible.items():
        value = given.get(dest)  # some are set by megatron's validate_args, not its parser
        if value not in (None, False, 0):
            raise ConfigError(f"{on} cannot be combined with {flag}={value}: {why}")
    # a sharded wrapper frees each layer's gathered weights after its forward and after its backward
    if args.use_torch_fsdp2:
        raise ConfigError(
            f"{on}, --use-torch-fsdp2=True: not supported together: the overlapped "
            "schedule runs one micro-batch's backward inside another's forward, while FSDP2 gathers and "
            "frees each layer's parameters around every forward and backward"
        )
    strategy = args.data_parallel_sharding_strategy
    if args.use_megatron_fsdp and strategy == "optim_grads_params":
        raise ConfigError(
            f"{on} cannot be combined with --data-parallel-sharding-strategy={strategy} "
            "(--use-megatron-fsdp): each FSDP unit's weights are gathered into one bucket that its "
            "post-forward and post-backward hooks free, and the paired forward frees a layer's "
            "bucket while the other micro-batch's backward still reads it (docs/fsdp.md); use "
            "optim or optim_grads"
        )
    impl = args.transformer_impl
    if impl == "transformer_engine":
        raise ConfigError(
            f"{on} with --transformer-impl={impl}: TE layers issue their TP collectives inside TE "
            "(userbuffers/NCCL in C++), which the overlap cannot intercept; use --transformer-impl=local"
        )
    cuda_graph = args.cuda_graph_impl
    if cuda_graph not in (None, "none"):
        raise ConfigError(f"{on} cannot be combined with --cuda-graph-impl={cuda_graph}")
    if args.external_cuda_graph or args.enable_cuda_graph:
        raise ConfigError(f"{on} cannot be combined with CUDA graphs")


def get_forward_backward_func(args=None):
    """Our schedule when ``args.overlap_tp_comm_1f1b`` is on, else megatron's; called with the
    same keyword arguments as megatron's forward_backward_* functions."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func

    if args is not None and OverlapOptions.from_args(args).overlap_tp_comm_1f1b:
        from megatron_ext.schedules.overlap_1f1b import forward_backward_overlap

        return forward_backward_overlap
    return megatron_func()


def teardown() -> None:
    """The run's process groups are destroyed after this: forget every one we hold."""
    from megatron_ext.schedules import exposed_comm, group_kinds, lane_state, lanes, overlap_1f1b

    overlap_1f1b._P2P_GROUPS.clear()
    group_kinds.GROUPS.tp = group_kinds.GROUPS.ep = group_kinds.GROUPS.cp = ()  # a reference kept here keeps a destroyed group's threads
    group_kinds.GROUPS.hidden = 0
    lane_state.set_stateful(())  # references to the run's dispatchers / shared experts
    lanes.reset_buffers()
    exposed_comm.exposed_seconds()
    exposed_comm.EXPOSED_S.clear()
    _SINCE.reset()


_SINCE = SinceLastCall()


def log_counters() -> dict:
    """Time the compute waited for TP (and EP, CP) collectives of paired passes since the last line
    (CUDA events on the compute stream on GPUs; host time on CPU)."""
    from megatron_ext.schedules import exposed_comm

    delta = _SINCE(exposed_comm.exposed_seconds())
    return {f"{kind.upper()} comm exposed (ms)": f"{delta[kind] * 1e3:.1f}" for kind in sorted(delta)}


def summary(args) -> str:
    """The startup summary's line (training/features.py): which schedule runs the micro-batches."""
    if args.overlap_tp_comm_1f1b:
        return f"overlap: on ({FLAG}: backward of one micro-batch hides the other's TP/EP/CP communication)"
    return f"overlap: off (megatron's schedule; {FLAG} hides TP/EP/CP communication)"
