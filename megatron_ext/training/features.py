"""Our capabilities as seen by the builders: each package may define

    add_arguments(parser)          its flags, declared once, with help text, in an argparse group
                                   titled "megatron_ext: <capability>"
    before_validate(args)          refuse flags before megatron's validate_args asserts on them
    validate(args)                 raise ConfigError naming flag and value; runs before any compute
    before_model(args, config)     adjust the TransformerConfig before the model is built
    after_model(args, model)       attach to the built model chunks (list of DDP-wrapped modules)
    at_log_line(args)              every rank, at each log line, before it is printed (host reads)
    log_counters()                 {name: value} for the log line, counted since the previous line
    teardown()                     forget per-run state (process groups are destroyed after it)

and the builders call whichever exist, in this order of packages."""
from __future__ import annotations

import importlib
import weakref

# moe before offload: offload hooks the expert modules the MoE package puts in place
PACKAGES = ("megatron_ext.moe", "megatron_ext.offload", "megatron_ext.schedules", "megatron_ext.training")


def _hooks(name):
    for pkg in PACKAGES:
        fn = getattr(importlib.import_module(pkg), name, None)
        if fn is not None:
            yield fn


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


def after_model(args, model) -> None:
    for fn in _hooks("after_model"):
        fn(args, model)


class SinceLastCall:
    """Running totals -> how much each grew since the previous call (a log line reports its own
    interval). A new `run` (an object identifying it, held weakly so that a finished run can be
    freed) starts again from zero."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._last, self._run = {}, None

    def __call__(self, totals: dict, run=None) -> dict:
        if (self._run() if self._run is not None else None) is not run:
            self._last, self._run = {}, (weakref.ref(run) if run is not None else None)
        delta = {k: v - self._last.get(k, 0) for k, v in totals.items()}
        self._last = dict(totals)
        return delta


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
