"""One run of a model, from the command line to teardown: the bring-up every entry point shares
(train.py, scripts/convert.py, the planner's trace, the dry-run's key check, the benchmarks).

    with Run.from_argv(argv, parse=arguments.parse) as run:   # platform set up, every flag checked
        run.train()                         # build -> optimizer -> load -> data -> loop -> save/eval

    with Run.for_model(argv, parse=arguments.parse) as run:   # a model-only run: the model's flags
        model = run.build()                 # the bare model chunks; load() / save() their weights

``parse`` is the entry point's argument layer, top-level arguments.py's ``parse`` (megatron's flags,
this project's, the user's, the recipe merge), handed to every call that parses a command line, as
pretrain_gpt.py hands its extra_args_provider to pretrain; no module of the package imports
arguments.py, so a flag added there reaches the package as ``args.<dest>``. There is no default: a
call without it is a TypeError where it is made.

A model-only run (``Run.for_model(argv)``, or ``Run(args, model_only=True)`` of parsed arguments) has no
optimizer, data or loop: those stages refuse. It builds the model in the world the platform sets up
(torchrun's, or one of this process); on the meta device (``meta=True``: the whole model of
``--dry-run --load``, every global key and shape, no storage) it builds megatron-core's model alone,
without the capabilities' changes (what a checkpoint holds), in the running world or, where there is
none, a world of this process alone held in memory (nothing is communicated on the meta device).

Partial uses call the stages they need; each runs once, the ones it needs first:

    initialize()   process groups for the layout, megatron's seeds     (entering the run does it)
    build(wrap)    config -> model chunks -> layout-invariant init -> features' before_wrap ->
                   DDP / Megatron-FSDP / FSDP2 -> features' after_model (training/model.py)
    optimize()     optimizer, LR schedule, the schedule's config callbacks
    load()         the newest intact checkpoint under --load (checkpoint/checkpointer.py); save()
    data()         train / valid / test iterators positioned after the loaded iteration
    step()         one iteration (schedule, then optimizer step)

Leaving the run tears down (features' teardown, the process groups) on every exit path. The
capabilities attach through megatron_ext/training/features.py, in the order it says once. A
measurement attaches through a probe: any object with some of these methods, called at the points
of the same names (never by patching functions):

    after_parse(run)                    the parsed args, before anything is built (may adjust them)
    around_build(run)  -> context       the whole model build, wrapping included
    around_wrap(run)   -> context       the data-parallel wrapper alone
    after_build(run)                    run.model holds the wrapped chunks
    after_load(run)                     run.checkpointer made, run.iteration the loaded iteration
    around_step(run, iteration) -> ctx  one training iteration
    around_schedule(run, iteration) -> ctx   its forward/backward of every micro-batch alone
    after_step(run, iteration, result)
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch

from megatron_ext import platform
from megatron_ext.training import parallel

# What megatron's validate_args asks of every run and a model-only run never reads: data, a batch, a
# length of training and a learning rate. Given before the caller's flags (which win) and left out of
# what a checkpoint records of how the run was launched.
_MODEL_ONLY = {"--mock-data": None, "--micro-batch-size": "1", "--train-iters": "1", "--lr": "0", "--min-lr": "0",
               "--lr-warmup-iters": "0", "--num-workers": "0"}


class Run:
    def __init__(self, args, probes=(), *, model_only: bool = False, meta: bool = False):
        self.args = args
        self.probes = list(probes)
        self.model_only = model_only or meta
        self.meta = meta
        self.config = self.model = self.optimizer = self.scheduler = None
        self.checkpointer = self.iterators = self.forward_backward = None
        self.iteration = 0  # the last completed iteration (the loaded one before the loop)
        self.argv: list[str] | None = None  # the command line parsed (from_argv): an interrupt's resume command
        self._initialized = self._own_world = False
        self._at("after_parse")

    @classmethod
    def from_argv(cls, argv: list[str] | None = None, probes=(), *, parse, exit_on_dry_run: bool = True) -> "Run":
        """Platform set up, then the flags parsed and checked by ``parse`` (the entry point's argument
        layer, top-level ``arguments.parse``); --dry-run --load then places the checkpoint's keys in the
        run's whole model (:func:`check_load`)."""
        import io
        import sys

        argv = list(sys.argv[1:] if argv is None else argv)
        shown = io.StringIO()  # a dry-run's configuration, held back until the key check has passed
        with contextlib.redirect_stdout(shown) if "--dry-run" in argv else contextlib.nullcontext():
            args = _parse(parse, argv)
        if args.dry_run:
            if args.load:
                check_load(args)  # a refusal is the one line printed
            sys.stdout.write(shown.getvalue())
            if getattr(args, "checkpoint_keys", None):
                print(f"  checkpoint_keys {args.checkpoint_keys!r}  [{args.config_sources['checkpoint_keys']}]")
            if exit_on_dry_run:
                raise SystemExit(0)
        run = cls(args, probes)
        run.argv = argv
        return run

    @classmethod
    def for_model(cls, argv: list[str], probes=(), first_read=None, *, parse) -> "Run":
        """A model-only run of these flags: the model's (a recipe, or the one --load's checkpoint
        records; the architecture, the layout, --load / --save and how they load and save), no training
        flags. It builds, loads and saves the model; it has no optimizer, data or loop. ``first_read``:
        what its caller read of --load already (checkpoint/reading.py first_read): its parse, checks
        and load take it from there and read none of it again. ``parse``: as for :meth:`from_argv`."""
        import os

        # one micro-batch per process: a multiple of any data-parallel size of this world
        stand_ins = {flag: value for flag, value in {**_MODEL_ONLY, "--global-batch-size": os.environ.get(
            "WORLD_SIZE", "1")}.items() if flag not in argv}
        args = _parse(parse, [*(part for flag, value in stand_ins.items() for part in (flag, value)
                                if part is not None), *argv], first_read=first_read)
        for flag in stand_ins:
            dest = flag.removeprefix("--").replace("-", "_")
            getattr(args, "recorded_recipe", {}).get("run", {}).pop(dest, None)
            args.config_sources[dest] = "model-only run (not read)"
        return cls(args, probes, model_only=True)

    # ---- points ---------------------------------------------------------------------------------
    def _at(self, point: str, *a) -> None:
        for probe in self.probes:
            fn = getattr(probe, point, None)
            if fn is not None:
                fn(self, *a)

    def _around(self, point: str, *a) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for probe in self.probes:
            fn = getattr(probe, point, None)
            if fn is not None:
                stack.enter_context(fn(self, *a))
        return stack

    # ---- stages ---------------------------------------------------------------------------------
    def __enter__(self) -> "Run":
        self.initialize()
        return self

    def __exit__(self, kind, error, trace) -> bool:
        if error is None:
            self.teardown()
        else:  # the run's own error is what the user sees: a teardown failing after it may not replace it
            with contextlib.suppress(Exception):
                self.teardown()
        return False

    def initialize(self) -> None:
        if self._initialized:
            return
        args = self.args
        if self.meta and not torch.distributed.is_initialized():
            # nothing is communicated on the meta device: this process alone, its store in memory
            # (a --dry-run on any machine: no rendezvous, no port)
            torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
            self._own_world = True
        platform.init_distributed(args.distributed_timeout_minutes * 60)
        logging.getLogger("megatron").setLevel(args.logging_level or logging.WARNING)
        from megatron.core import config

        config.set_experimental_flag(bool(args.enable_experimental))  # as megatron's set_global_variables
        parallel.initialize(
            tensor=args.tensor_model_parallel_size, pipeline=args.pipeline_model_parallel_size,
            virtual_pipeline=args.virtual_pipeline_model_parallel_size, expert=args.expert_model_parallel_size,
            expert_tensor=args.expert_tensor_parallel_size, context=args.context_parallel_size, seed=args.seed,
        )
        self._initialized = True
        log_restart(args)

    def build(self, wrap: bool | None = None) -> list:
        """The model chunks (one per virtual pipeline stage), wrapped for data parallelism unless
        ``wrap`` is False (default: a training run wraps, a model-only run does not)."""
        if self.model is None:
            from megatron_ext.training import model as models

            self.initialize()
            args = self.args
            wrap = not self.model_only if wrap is None else wrap
            with self._around("around_build"), self._standing_in():
                self.config = models.transformer_config(args)
                if self.meta:
                    self.config.perform_initialization = False  # nothing to draw without storage
                    self.model = models.built(models.build_chunks(args, self.config, meta=True))
                else:
                    # --init-model-with-meta-device: built without storage; Megatron-FSDP materialises and
                    # initialises each parameter on the device, its shard only (megatron's get_model,
                    # training.py:1768); validate allows it with --use-megatron-fsdp only
                    self.model = self._with_capabilities(wrap, meta=args.init_model_with_meta_device and wrap)
            self._at("after_build")
        return self.model

    def _with_capabilities(self, wrap: bool, meta: bool) -> list:
        """The chunks with the capabilities attached, in features.py's order."""
        from megatron_ext.training import features, model as models

        args = self.args
        features.before_model(args, self.config)
        chunks = models.build_chunks(args, self.config, meta=meta)
        features.before_wrap(args, chunks)  # frozen weights have no gradient buffer
        if wrap:
            with self._around("around_wrap"):
                chunks = models.wrap(args, self.config, chunks)
        features.after_model(args, chunks)
        return models.built(chunks)

    def _standing_in(self):
        """A model-only run of transformer-engine's spec where transformer-engine is not installed
        (``--platform cuda --assume-te`` on a CPU machine) builds with megatron_ext/seams/te_spec.py's
        stand-ins; a training run without transformer-engine is refused before it gets here."""
        from megatron_ext.platform import target

        if self.model_only and self.args.transformer_impl == "transformer_engine" and not target.te_importable():
            from megatron_ext.seams import te_spec

            return te_spec.standing_in()
        return contextlib.nullcontext()

    def _training(self, stage: str) -> None:
        if self.model_only:
            raise RuntimeError(f"a model-only run (Run.for_model) has no {stage}")

    def optimize(self):
        if self.optimizer is None:
            from megatron_ext.training import optimizer as optim

            self._training("optimizer")
            model = self.build()
            self.optimizer, self.scheduler = optim.build_optimizer(self.args, model)
            optim.configure_schedule_hooks(self.args, self.config, model, self.optimizer)
        return self.optimizer

    def load(self, weights_only: bool = False, chunks: list | None = None) -> int:
        """The newest intact checkpoint under --load (none: iteration 0). ``weights_only``: the
        model's weights alone, as --finetune loads them, with no optimizer (conversion); ``chunks``:
        what stands for the model's chunks there (the conversion's, which load into tensors of their
        own), default the run's model."""
        from megatron_ext import checkpoint

        if weights_only:
            model = chunks or (self.build(wrap=False) if self.model is None else self.model)
            self.checkpointer = checkpoint.Checkpointer(self.args, model, None, checkpoint.WeightsOnly())
        else:
            self.optimize()
            self.checkpointer = checkpoint.Checkpointer(self.args, self.model, self.optimizer, self.scheduler)
        self.iteration = self.checkpointer.load()
        self._at("after_load")
        return self.iteration

    def save(self, iteration: int, weights_only: bool = False, chunks: list | None = None) -> None:
        """A checkpoint of this iteration under --save, checksummed (``weights_only``: the model's
        weights alone, as an import writes them; ``chunks`` as for load)."""
        from megatron_ext import checkpoint

        if weights_only:
            model = chunks or (self.build(wrap=False) if self.model is None else self.model)
            checkpoint.Checkpointer(self.args, model, None, checkpoint.WeightsOnly()).save(iteration)
        else:
            self.optimize()
            if self.checkpointer is None:
                self.checkpointer = checkpoint.Checkpointer(self.args, self.model, self.optimizer, self.scheduler)
            self.checkpointer.save(iteration)

    def data(self):
        if self.iterators is None:
            from megatron_ext.training import data

            self._training("data")
            # after the load: a resumed run reads exactly the data an uninterrupted one would
            self.iterators = data.build_iterators(self.args, len(self.build()), iteration=self.iteration)
            if self.checkpointer is not None:
                self.checkpointer.restore_rng()  # after the iterators: building them draws from the CPU generator
        return self.iterators

    def step(self, iteration: int | None = None):
        """One training iteration: megatron's schedule (or the 1F1B overlap's), then the optimizer."""
        from megatron_ext.training import step

        iteration = self.iteration + 1 if iteration is None else iteration
        schedule = self._schedule()
        if any(hasattr(probe, "around_schedule") for probe in self.probes):
            def schedule(_plain=schedule, **kw):
                with self._around("around_schedule", iteration):
                    return _plain(**kw)
        with self._around("around_step", iteration):
            result = step.train_step(self.args, self.model, self.optimizer, self.scheduler, self.data().train,
                                     schedule)
        self.iteration = iteration
        self._at("after_step", iteration, result)
        return result

    def _schedule(self):
        if self.forward_backward is None:
            from megatron_ext import schedules

            self.optimize()
            self.forward_backward = schedules.get_forward_backward_func(self.args)
        return self.forward_backward

    def train(self) -> list[dict]:
        """The loop, as megatron.training.train runs it; returns the logged history."""
        from megatron_ext import checkpoint
        from megatron_ext.training import evaluation, exits, features, model as models, observability
        from megatron_ext.training import optimizer as optim
        from megatron_ext.training.log_line import TrainingLogger

        args = self.args
        self.optimize()
        if torch.distributed.get_rank() == 0:
            print(features.summary(args), flush=True)  # what is on, once, with the model built
        start = self.load()
        iterators = self.data()
        self._schedule()  # megatron's, or our TP-overlap 1F1B
        # model, optimizer: the per-rank state bytes; the capabilities' counters at each line
        logger = TrainingLogger(args, self.model, self.optimizer, capabilities=features)
        try:
            observer = observability.Observer(args)  # profiler/memory step range, non-finite loss check
            iteration = start
            # exit interval/duration/signal, manual gc; a signal's handler stays until the save is written
            with exits.ExitConditions(args) as stop:
                last = start if args.skip_train else args.train_iters
                for iteration in range(start + 1, last + 1):
                    observer.before_step(iteration)
                    result = self.step(iteration)
                    models.register_fsdp_buffers(args, self.model, iteration - start)  # --use-nccl-ub, after the first
                    logger.log(iteration, result, lr=optim.logged_learning_rate(self.optimizer))
                    observer.after_step(iteration, result)
                    if evaluation.due(args, iteration, iterators):
                        evaluation.at_interval(args, iterators, self.model, self.config, iteration, logger.writer)
                    self.checkpointer.after_step(iteration)  # saves every --save-interval
                    if stop.after_step(iteration):
                        break
                observer.close()
                self.checkpointer.close(iteration)  # saves at exit, waits for async saves
                saved = self.checkpointer.last_saved == iteration and args.save
                stop.interrupted(iteration, checkpoint.checkpoint_dir(args.save, iteration) if saved else None, self.argv)
            if not stop.reason:
                evaluation.after_training(args, iterators, self.model, self.config, iteration, logger.writer)
            return logger.history
        finally:
            logger.close()  # on every exit path: the TensorBoard writer owns a thread (and W&B's run)

    def teardown(self) -> None:
        """Features' teardown, then the process groups (every rank reaches this together)."""
        self.model = self.optimizer = self.scheduler = self.checkpointer = self.iterators = None
        if self._initialized:
            self._initialized = False
            parallel.destroy()
        if self._own_world:
            self._own_world = False
            torch.distributed.destroy_process_group()


def main(argv: list[str] | None, parse_run) -> list[dict]:
    """train.py: parse with the argument layer it hands in (``parse_run``: top-level arguments.parse),
    train, tear down; returns the logged history (one dict per log line)."""
    with Run.from_argv(argv, parse=parse_run) as run:
        return run.train()


def log_restart(args) -> None:
    """On a restarted world (torchrun --max-restarts, a requeued slurm job), rank 0 says so; the
    Checkpointer's line that follows names the checkpoint and iteration it resumes from."""
    restarts = platform.restart_count()
    if not restarts or torch.distributed.get_rank() != 0:
        return
    counts = ", ".join(f"{name}={os.environ[name]}" for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
                       if os.environ.get(name))
    where = f"the newest intact checkpoint under --load={args.load}" if args.load else "iteration 0 (no --load)"
    print(f"[restart] restart {restarts} of this job ({counts}): resuming from {where}", flush=True)


def _parse(parse, argv: list[str], **handed):
    """The platform set up (CPU shims or this rank's GPU, before megatron-core is imported), then the
    flags parsed and checked by ``parse``; a --dry-run does not exit here (Run.from_argv). ``handed``:
    what the argument layer is handed besides (``first_read``)."""
    if not callable(parse):
        raise TypeError(f"parse={parse!r}: the entry point's argument layer, top-level arguments.parse")
    platform.setup()
    return parse(argv, exit_on_dry_run=False, **handed)


def check_load(args) -> None:
    """--dry-run with --load: every key of the checkpoint the run would load placed in the run's whole
    model, built here on the meta device (checkpoint/keys.py says how a key is placed, or
    refuses it by name). Records what it found on args."""
    from megatron_ext import checkpoint

    found = checkpoint.checkpoint_to_load(args)
    if found is None:
        return  # nothing to load (the load says so), or another format
    with Run(checkpoint.whole_model_args(args), meta=True) as whole:
        (chunk,) = whole.build()
        state = chunk.sharded_state_dict(metadata=checkpoint.sharding_metadata(whole.args))
    checkpoint.place(args, *found, state)
