"""The training package as a capability: its flags, its checks before any compute, its teardown
(the hooks of megatron_ext/training/features.py). The checks that read what every package settled
(the data each split reads, --dry-run --load's keys) come after all the packages' checks
(megatron_ext/config/command_line.py finalize; the keys by the bring-up after it, training/run.py
check_load); nothing here reaches a module that calls the
capabilities' hooks (features.py lists this module among them)."""
from megatron_ext.errors import ConfigError


def add_arguments(parser):
    group = parser.add_argument_group(
        "megatron_ext: training", "initialisation, what the model builder adds"
    )
    group.add_argument(
        "--layout-invariant-init",
        action="store_true",
        help="Initialise every parameter from its global checkpoint key and --seed, so every "
        "TP/PP/VPP/EP/DP layout starts from identical weights (for comparing layouts).",
    )
    from megatron_ext.checkpoint import add_arguments as add_checkpointing_arguments
    from megatron_ext.training.model import add_arguments as add_model_arguments

    add_model_arguments(group)

    add_checkpointing_arguments(parser)
    return parser


def before_validate(args) -> None:
    from megatron_ext.training.model import before_validate as model_before_validate
    from megatron_ext.training.optimizer import refuse_batch_size_schedules

    model_before_validate(args)
    refuse_batch_size_schedules(args)
    from megatron_ext.checkpoint import before_validate as checkpointing_before_validate
    from megatron_ext.checkpoint import check_loadable

    checkpointing_before_validate(args)
    check_loadable(args)  # no checkpoint, or every one damaged (a cheap look): refused here, at --dry-run too


def validate(args) -> None:
    import contextlib
    import io

    from megatron_ext.training import optimizer, tokenizer
    from megatron_ext.training import log_line as training_logging

    tokenizer.configure(args)  # the vocabulary (and its padding) from the tokenizer flags
    with contextlib.redirect_stdout(io.StringIO()):  # megatron prints 'setting training iterations to N'
        optimizer.resolve_iterations(args)  # --train-iters, or from --train-samples; the LR schedule
    training_logging.validate(args)
    from megatron_ext.checkpoint import validate as validate_checkpointing

    validate_checkpointing(args)
    from megatron_ext.training.observability import validate as validate_observability

    validate_observability(args)
    if args.layout_invariant_init and args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights:
        raise ConfigError(
            "--layout-invariant-init with --pipeline-model-parallel-size>1 needs "
            "--untie-embeddings-and-output-weights (tied weights live on two stages)"
        )
    if args.init_model_with_meta_device and not args.use_megatron_fsdp:
        raise ConfigError(
            "--init-model-with-meta-device without --use-megatron-fsdp: megatron leaves the meta-built "
            "parameters uninitialised (torch.empty_like) for a DDP model, and megatron-core's torch FSDP2 "
            "wrapper never materialises them; it is for Megatron-FSDP, which initialises each shard"
        )
    if args.layout_invariant_init and args.init_model_with_meta_device:
        raise ConfigError(
            "--layout-invariant-init with --init-model-with-meta-device: the weights are drawn before "
            "Megatron-FSDP shards them, and a meta-device model has none until it does"
        )


def before_wrap(args, chunks) -> None:
    if args.freeze_all_layers:
        from megatron_ext.training.model import freeze_all_layers

        freeze_all_layers(chunks)


def teardown() -> None:
    # imported here, as in validate(): importing this package (argument parsing does) stays light
    from megatron_ext.seams import registry
    from megatron_ext.training import model, optimizer

    optimizer.release_schedule_hooks()
    model.release_models()
    registry.uninstall()  # what the run installed (training/model.py build_chunks)
