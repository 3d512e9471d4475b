"""Every architecture of the zoo (tests/training/zoo.py) trains on 2 processes (TP2 + SP, EP2 for MoE)
and trains bit-identically with every applicable megatron_ext feature on: activation offload of every
module the architecture has, the sync-free dispatcher (MoE), the TP-overlapped 1F1B schedule. Losses,
grad norms, every weight and every last gradient are compared bit for bit; and offload must have
moved bytes out of every hooked sub-module, so nothing is bypassed."""
from __future__ import annotations

import math

import pytest

from tests.dist import run_distributed
from tests.training import zoo


def _run(argv):
    return run_distributed(2, "tests.training.jobs_zoo:train_digest", argv=argv)


def _assert_bitwise(plain, featured, modules):
    losses = [r["lm loss"] for r in plain[-1]["history"]]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    for rank, (a, b) in enumerate(zip(plain, featured)):
        assert [(r["lm loss"], r["grad norm"]) for r in a["history"]] == \
            [(r["lm loss"], r["grad norm"]) for r in b["history"]], (rank, a["history"], b["history"])
        assert a["params"].keys() == b["params"].keys() and a["grads"].keys() == b["grads"].keys()
        differ = [k for k in a["params"] if a["params"][k] != b["params"][k]]
        differ += [k + " (grad)" for k in a["grads"] if a["grads"][k] != b["grads"][k]]
        assert not differ, (rank, differ)
        hooked = b["offloaded"]
        assert {key.split("/")[0] for key in hooked} == set(modules), (rank, sorted(hooked))
        bypassed = [key for key, v in hooked.items() if v["saved"] > 0 and v["offloaded"] == 0]
        assert not bypassed, (rank, bypassed)


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_architecture_trains_bitwise_with_every_feature_on(name):
    _assert_bitwise(_run(zoo.plain_argv(name)), _run(zoo.features_argv(name)), zoo.offload_modules(name))


@pytest.mark.parametrize("name", list(zoo.COMBINATIONS))
def test_features_with_recompute_and_mtp_train_bitwise(name):
    plain, featured = _run(zoo.combination_argv(name, False)), _run(zoo.combination_argv(name, True))
    _assert_bitwise(plain, featured, zoo.COMBINATIONS[name][2])


def test_the_comparison_sees_a_one_ulp_change():
    """Negative control: the same run with another init scale differs in every digest."""
    argv = zoo.plain_argv("llama3")
    other = list(argv)
    other[other.index("--init-method-std") + 1] = "0.0200001"
    with pytest.raises(AssertionError):
        _assert_bitwise(_run(argv), _run(other), [])
