"""A script of scripts/ loaded as a module, so a test calls its functions (scripts are not a package)."""
import contextlib
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_rank(function: str, kwargs: dict):
    """Job (every rank): a script's rank function ``module:name``, allowed to start processes as a
    rank of a fresh world may (--async-save forks a writer per save): the pool's workers are daemonic,
    and multiprocessing refuses children to a daemonic process, so the flag is lifted for the job."""
    import importlib
    import multiprocessing

    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        module, name = function.split(":")
        return getattr(importlib.import_module(module), name)(**kwargs)
    finally:
        config["daemon"] = daemon


@contextlib.contextmanager
def warm_worlds():
    """Inside the block a script's fresh world of processes (megatron_ext.measure.launch.run_world) is
    the suite's warm gloo workers (tests/dist.py): the same function on every rank, results in rank
    order, without each rank's imports paid again (script_rank: it may start processes). Load the
    script inside the block (a script that imports run_world at its top binds it then)."""
    from megatron_ext.measure import launch
    from tests.dist import run_distributed

    def run_world(world_size, fn, timeout=900, **kwargs):
        return run_distributed(world_size, "tests.scripts:script_rank", function=f"{fn.__module__}:{fn.__qualname__}",
                               kwargs=kwargs)

    original, launch.run_world = launch.run_world, run_world
    try:
        yield
    finally:
        launch.run_world = original
