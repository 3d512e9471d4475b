"""What a command prints besides its work: a refusal as one line per problem, printed once, with a
non-zero exit (``run``); third-party warnings that tell the user nothing, filtered (``quiet``)."""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import warnings
from typing import Callable

# Set to 1 to keep the traceback of a refusal (debugging megatron_ext itself).
TRACEBACK_ENV = "MEGATRON_EXT_TRACEBACK"
# Set to 1 (or pass --verbose) to see the third-party warnings quiet() filters.
VERBOSE_ENV = "MEGATRON_EXT_VERBOSE"


class ConfigError(ValueError):
    """A bad flag or recipe value, reported before any compute starts.
    The message names the flag (``--flag-name=value``) and what is wrong."""


class InputError(Exception):
    """A file a tool reads is not what it expects (a line that is not JSON, a key holding no text);
    the message names the file and line. Defined here, importable, so it crosses process pools."""


def run(main: Callable[[], object], explain: Callable[[BaseException], str | None]) -> None:
    """Call ``main``; a ConfigError, or an error megatron raised from a flag (``explain`` names the
    flags, or returns None for anything else, which keeps its traceback), becomes ``error: LINE`` (one
    per problem) on rank 0's stderr and exit status 1 on every rank: the ranks refuse the same flags.
    Under torchrun every rank also writes the lines to its error file, so torchrun's failure report
    shows them as the root cause instead of "To enable traceback see ...". Ctrl-C where no loop
    handles it (while a run starts; a training loop stops at a step boundary itself, training/exits.py):
    one line on rank 0 and exit status 130, no traceback."""
    try:
        main()
    except KeyboardInterrupt:
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print("[interrupted] SIGINT before a step boundary: stopped, nothing saved", file=sys.stderr, flush=True)
        sys.exit(130)
    except (AssertionError, ValueError, RuntimeError, NotImplementedError) as e:
        line = explain(e)
        if line is None or os.environ.get(TRACEBACK_ENV) == "1":
            raise
        text = "\n".join(f"error: {each}" for each in line.splitlines())
        _write_torchrun_error_file(text)
        if int(os.environ.get("RANK", "0")) == 0:
            print(text, file=sys.stderr, flush=True)
        sys.exit(1)


def _write_torchrun_error_file(text: str) -> None:
    """torchrun's agent reads each failed worker's TORCHELASTIC_ERROR_FILE into its report; a plain
    string message is shown as it is (torch/distributed/elastic/multiprocessing/errors/__init__.py
    ProcessFailure, _format_failure)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            indent = "\n" + " " * len("  traceback : ")  # the report's own field, so the lines align under it
            json.dump({"message": indent.join(text.splitlines()), "timestamp": str(int(time.time()))}, f)
    except OSError:
        pass  # the report then says what it says without it


# Third-party warnings that tell the person running a command nothing they can act on, each with
# why: (warning category, message pattern, why). quiet() filters them; --verbose shows them.
QUIET_WARNINGS = (
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated",
     "torch renamed c10d collectives (all_gather_into_tensor, reduce_scatter_tensor) that megatron-core calls"),
    (UserWarning, r"Could not determine rank from torch\.distributed",
     "megatron-core asked for the rank before a process group exists: parsing, a dry run without torchrun"),
    (UserWarning, r"If you are using transformer_engine as the transformer implementation, the core_attn",
     "megatron-core's advice on --recompute-modules core_attn with transformer-engine, printed once per "
     "config: the planner builds many"),
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load "
                  r"in a single process",
     "torch's checkpoint reader, when a checkpoint's metadata is read by one process on purpose"),
    (UserWarning, r"The argument order of load has been changed",
     "torch.distributed.checkpoint's note on its own signature, which megatron-core's loader calls"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor",
     "torch's deprecation of ShardedTensor, which megatron-core's distributed checkpoints still use"),
    (UserWarning, r"--fp8-recipe=tensorwise is incompatible with the streaming checkpoint dequantize path",
     "megatron's note on transformer-engine's FP8 parameters in checkpoints; the local spec's FP8 keeps its "
     "parameters in high precision (megatron_ext/fp8)"),
    (UserWarning, r"WARNING: there is no optimizer on RANK",
     "no parameter trains on this rank: asked for with --freeze-all-layers (megatron says it may be expected)"),
)
# Third-party log records of the same kind: (logger, message pattern, why).
QUIET_LOGS = (
    ("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED",
     "megatron-core points its developers at HybridModel; GPTModel is what Megatron-LM's pretrain_gpt.py builds"),
    ("megatron.core.datasets.gpt_dataset", r"Unable to save MockGPTDataset indexes",
     "--mock-data: generated samples, nothing to cache"),
    ("megatron.core.rerun_state_machine", r"Implicit initialization of Rerun State Machine|RerunStateMachine initialized",
     "megatron-core's rerun machine, created on first use; this loop does not re-run iterations (--rerun-mode)"),
    ("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated",
     "megatron-core's note on its own writer, printed at every save: saves here go through megatron-core's "
     "queue (--async-strategy has no effect here)"),
)


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet(argv: list[str] | None = None) -> bool:
    """Filter the warnings and log records of QUIET_WARNINGS and QUIET_LOGS in this process, unless
    ``--verbose`` is in ``argv`` or MEGATRON_EXT_VERBOSE=1. Called once by each entry point (train.py,
    scripts/), before megatron-core is imported; anything not listed (a real problem) still shows.
    Returns whether the filters were installed."""
    argv = sys.argv[1:] if argv is None else argv
    if "--verbose" in argv or os.environ.get(VERBOSE_ENV) == "1":
        return False
    for category, pattern, _why in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name, pattern, _why in QUIET_LOGS:
        logging.getLogger(name).addFilter(_DropMatching(pattern))
    # megatron.training sets the root logger to INFO on import: its INFO records while the flags are
    # checked (a dataset's index read for --dry-run) are not for the user; a run then sets the level
    # its --logging-level asks for (train.main)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    return True
