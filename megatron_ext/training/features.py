"""How the capabilities compose: the one place that says which package's hooks a run calls, and in
which order. Each capability package may define

    add_arguments(parser)          its flags, declared once, with help text, in an argparse group
                                   titled "megatron_ext: <capability>"
    before_validate(args)          refuse flags before megatron's validate_args asserts on them
    validate(args)                 raise ConfigError naming flag and value; runs before any compute
    before_model(args, config)     adjust the TransformerConfig before the model is built
    before_wrap(args, chunks)      change the built model chunks before the data-parallel wrapper
                                   lays out its buffers (what is frozen then has no gradient buffer)
    after_model(args, model)       attach to the wrapped model chunks (list of DDP-wrapped modules)
    at_log_line(args)              every rank, at each log line, before it is printed (host reads)
    log_counters()                 {name: value} for the log line, counted since the previous line
    teardown()                     forget per-run state (process groups are destroyed after it)

The run (training/run.py Run.build) calls them in this order: the config -> before_model -> the
model chunks -> layout-invariant init -> before_wrap (LoRA's adapters, a frozen base) -> the
data-parallel wrapper (DDP, Megatron-FSDP or FSDP2) -> after_model. The 1F1B overlap has nothing to
attach: it is the schedule the step picks (schedules.get_forward_backward_func)."""
from __future__ import annotations

from megatron_ext import attention, lora, moe, offload, schedules, sft
from megatron_ext.training import hooks as training

# The order every hook runs in. lora first: its adapters and the frozen base exist before the
# data-parallel wrapper is built (before_wrap), so every package after it finds the adapted linears
# (the grouped experts run their adapters, offload hooks the same modules). Then moe: it replaces
# the token dispatcher and the experts, and offload (next) hooks the expert modules moe put in place;
# the overlap schedule pairs passes whose saved tensors offload already manages; sft before training:
# it sets --calculate-per-token-loss before megatron validates, and training's data checks
# (training/data.py) read the chat data it accepted; training last (its checks read what the others
# settled). attention first of all: it resolves --attention-backend for the layer spec the platform
# settled, before megatron validates (which asserts on it) and before training's data checks read the
# data loader's mask it may switch off; it attaches nothing (its seam is installed with the others).
CAPABILITIES = (attention, lora, moe, offload, schedules, sft, training)


def _hooks(name):
    for package in CAPABILITIES:
        fn = getattr(package, name, None)
        if fn is not None:
            yield fn


def each(name: str) -> list:
    """Every package's hook of this name, in the order above: for calling them one by one (parsing
    collects each package's refusal instead of stopping at the first)."""
    return list(_hooks(name))


def add_arguments(parser):
    for fn in _hooks("add_arguments"):
        fn(parser)
    return parser


def before_validate(args) -> None:
    for fn in _hooks("before_validate"):
        fn(args)


def validate(args) -> None:
    for fn in _hooks("validate"):
        fn(args)


def before_model(args, config) -> None:
    for fn in _hooks("before_model"):
        fn(args, config)


def before_wrap(args, chunks) -> None:
    for fn in _hooks("before_wrap"):
        fn(args, chunks)


def after_model(args, model) -> None:
    for fn in _hooks("after_model"):
        fn(args, model)


def at_log_line(args) -> None:
    for fn in _hooks("at_log_line"):
        fn(args)


def log_counters() -> dict:
    """Feature counters for the log line, each package's `log_counters()` (since its last call)."""
    counters = {}
    for fn in _hooks("log_counters"):
        counters.update(fn())
    return counters


def teardown() -> None:
    for fn in _hooks("teardown"):
        fn()
