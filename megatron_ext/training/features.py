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
    datasets(args)                 the data of a package that brings its own (sft: packed conversations)
                                   instead of megatron's GPT datasets, or None: an object with
                                   check(args, config, sizes), every file read and refused by name
                                   before any compute, and build(config, sizes) -> [train, valid, test]
                                   (config: megatron's GPTDatasetConfig; sizes: samples per split)
    batch_inputs(batch, model, device)
                                   a micro-batch that package's data made, as the model takes it:
                                   (the batch on `device`, extra keyword arguments of the forward);
                                   None for a batch it did not make
    around_evaluation(args)        a context around each validation / test evaluation
    at_log_line(args)              every rank, at each log line, before it is printed (host reads)
    log_counters()                 {name: value} for the log line, counted since the previous line
    teardown()                     forget per-run state (process groups are destroyed after it)
    summary(args) -> str | None    its line of the startup summary, "<capability>: <effective setting>"
                                   (off included, so a user sees a flag took effect); a capability that
                                   lands (context parallelism, FP8) adds its line by defining it

The run (training/run.py Run.build) calls them in this order: the config -> before_model -> the
model chunks -> layout-invariant init -> before_wrap (LoRA's adapters, a frozen base) -> the
data-parallel wrapper (DDP, Megatron-FSDP or FSDP2) -> after_model. The data (training/data.py),
the step (training/step.py) and the evaluation (training/evaluation.py) ask datasets, batch_inputs
and around_evaluation. The 1F1B overlap has nothing to attach: it is the schedule the step picks
(schedules.get_forward_backward_func).

The training package's own hooks (training/hooks.py) are among them, so no module they reach may
import this one (tests/test_house.py: no import circle)."""
from __future__ import annotations

import contextlib

from megatron_ext import attention, fp8, lora, moe, offload, schedules, sft
from megatron_ext.training import hooks as training

# The order every hook runs in. attention first: it resolves --attention-backend for the layer spec
# the platform settled, before megatron validates (which asserts on it) and before training's data
# checks read the data loader's mask it may switch off; it attaches nothing (its seam is installed with
# the others). Then lora: its adapters and the frozen base exist before the data-parallel wrapper is
# built (before_wrap), so every package after it finds the adapted linears (the grouped experts run
# their adapters, offload hooks the same modules). Then moe: it replaces the token dispatcher and the
# experts, and offload (next) hooks the expert modules moe put in place; the overlap schedule pairs
# passes whose saved tensors offload already manages; sft before training: it sets
# --calculate-per-token-loss before megatron validates, and its datasets stand in for the GPT datasets
# training would read; training last (its checks read what the others settled). fp8 after lora:
# it puts the products of the (frozen) base linears in FP8, the adapters' stay in high precision;
# before moe, whose grouped experts find the FP8 recipe on the experts' linears.
CAPABILITIES = (attention, lora, fp8, moe, offload, schedules, sft, training)


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


def datasets(args):
    """The data this run reads when a package brings its own (the first that answers), else None:
    megatron's GPT datasets (training/data.py)."""
    for fn in _hooks("datasets"):
        found = fn(args)
        if found is not None:
            return found
    return None


def batch_inputs(batch: dict, model, device):
    """(batch on `device`, extra forward arguments) from the package whose data made `batch`, else None."""
    for fn in _hooks("batch_inputs"):
        found = fn(batch, model, device)
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def around_evaluation(args):
    with contextlib.ExitStack() as stack:
        for fn in _hooks("around_evaluation"):
            stack.enter_context(fn(args))
        yield


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


def summary(args) -> str:
    """The startup summary: every capability's line (its ``summary(args)``), in the order above, as one
    block (Run.train prints it once, on rank 0)."""
    lines = [line for fn in _hooks("summary") if (line := fn(args))]
    return "\n".join(["[capabilities]", *(f"  {line}" for line in lines)])
