"""The tiny MoE recipe trains with --moe-sync-free-dispatcher under EP2 and EP2 x TP2 with the
same losses and grad norms as megatron-core's own dispatcher, bit for bit."""
import pytest

from tests.dist import run_distributed

# two MoE layers: the dispatcher is per layer, a second layer is what a layer's output meets
BASE = ["--recipe", "recipes/tiny_moe.yaml", "--num-layers", "2", "--train-iters", "3", "--global-batch-size", "4",
        "--log-interval", "1", "--expert-model-parallel-size", "2"]
MOE_LAYERS = 2
LAYOUTS = {
    "ep2": (2, []),
    "ep2xtp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}


def _train(world, argv):
    res = run_distributed(world, "tests.moe.jobs:train", argv=argv)
    losses = [[h["lm loss"] for h in r["history"]] for r in res]
    norms = [[h["grad norm"] for h in r["history"]] for r in res]
    return losses, norms, [r["installed"] for r in res]


_REFERENCES: dict = {}


def _reference(world, argv):
    """megatron-core's own dispatcher on `argv`, trained once per module (two tests compare with
    the plain EP2 run)."""
    key = (world, tuple(argv))
    if key not in _REFERENCES:
        _REFERENCES[key] = _train(world, argv)
    return _REFERENCES[key]


CAPACITY = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
CASES = {  # allgather and the EP2 x TP2 capacity variants: per layer, bitwise, in test_dispatcher.py
    "ep2-alltoall": ("ep2", []),
    "ep2-alltoall-capacity": ("ep2", CAPACITY),
    "ep2xtp2-alltoall": ("ep2xtp2", []),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_equal_standard_dispatcher(case):
    layout, extra = CASES[case]
    world, parallel = LAYOUTS[layout]
    argv = BASE + parallel + extra
    ref_losses, ref_norms, ref_installed = _reference(world, argv)
    losses, norms, installed = _train(world, argv + ["--moe-sync-free-dispatcher"])
    assert ref_installed == [0] * world
    assert installed == [MOE_LAYERS] * world  # every MoE layer got our dispatcher
    assert len(losses[0]) == 3
    assert losses == ref_losses  # exact float equality, every iteration, every rank
    assert norms == ref_norms
    assert losses[0][-1] < losses[0][0]  # and it trains


ZERO_SYNC = ["--moe-sync-free-dispatcher", "--moe-zero-sync-dropless"]


def test_zero_sync_dropless_trains_bitwise_and_overflow_stops_the_run():
    """The recipe under EP2 with the zero-sync dropless mode (worst-case budget): the standard
    dispatcher's losses and grad norms, bit for bit. With a budget far below the load, the run stops
    at the first log line with one error naming the flag and a factor that would have fitted."""
    argv = BASE  # a log line every iteration
    ref_losses, ref_norms, _ = _reference(2, argv)
    losses, norms, installed = _train(2, argv + ZERO_SYNC)
    assert installed == [MOE_LAYERS] * 2
    assert losses == ref_losses and norms == ref_norms
    with pytest.raises(RuntimeError) as err:
        _train(2, argv + ZERO_SYNC + ["--moe-dropless-budget-factor", "0.25"])
    message = str(err.value)
    assert "--moe-dropless-budget-factor=0.25:" in message and "a factor of" in message, message
    losses, _, _ = _train(2, argv + ZERO_SYNC + ["--moe-dropless-budget-factor", "0.25",
                                                 "--moe-dropless-overflow", "drop"])
    assert len(losses[0]) == 3 and losses != ref_losses  # dropping changes the result, and it says so
