"""What a process forked to run jobs starts with, imported once by its fork server: the platform set up
and torch, megatron-core, the entry points and their heavy dependencies (about 7 s of CPU that each
forked process would otherwise pay). The suite's worker pools (tests/_preload.py) and gpu_check's
sections without CUDA (gpu_check_sections/preload.py) call :func:`imports`. Never with CUDA, which
cannot be initialised in a forked child of a process that touched it."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pythonpath() -> str:
    """The checkout and its scripts/ first (as pytest.ini has them), then this process's PYTHONPATH:
    what a process started for the checkout imports from."""
    return os.pathsep.join([ROOT, os.path.join(ROOT, "scripts")] + [p for p in [os.environ.get("PYTHONPATH")] if p])


def fork_server(module: str):
    """The forkserver context, its server started (in the background) to import ``module`` first.
    Python 3.11's server takes its import path from the environment, not from this process's
    sys.path, and skips a preload that raises ImportError without a word (every child would then
    import torch and megatron-core itself): the server starts with the checkout and its scripts/ on
    PYTHONPATH, as pytest.ini puts them. A server already running in this process is used as it is."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([module])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pythonpath()
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def imports() -> None:
    from megatron_ext import platform

    platform.setup()

    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.tokenizers.text.libraries.huggingface_tokenizer as hf  # imports transformers
    import megatron.training.training  # noqa: F401

    import arguments  # every job parses with it
    import megatron_ext.checkpoint.checkpointer  # noqa: F401
    import megatron_ext.planner.trace  # noqa: F401
    import megatron_ext.training.data  # noqa: F401  (megatron's tokenizer package imports transformers when installed)
    import train  # noqa: F401

    hf.AutoTokenizer  # noqa: B018  (transformers resolves its tokenizer classes on first use)
    arguments.build_parser()  # built once per process (megatron reads its config classes' source for the help)


def freeze() -> None:
    """After the imports: their objects live as long as the server and every child, so no child's
    collection scans them (or writes to their pages, which fork shares until written)."""
    import gc

    gc.collect()
    gc.freeze()
