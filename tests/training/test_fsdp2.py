"""torch FSDP2 (--use-torch-fsdp2) trains through train.py as Megatron-LM's get_model wraps it and
agrees with DDP + the distributed optimizer from the same weights (--layout-invariant-init) and
batches, in every layout megatron's own rules allow it (no pipeline or expert parallelism:
megatron/training/arguments.py:997-1015).

Tolerance: grad norm within relative 1e-6 of the DDP run (observed: at most 4e-7); the losses of
these 2 iterations are bitwise DDP's (Adam's first steps hardly see the last bits of a gradient).
Not bitwise in general, for summation order, not math: FSDP2 reduce-scatters the gradients after
every micro-batch's backward (megatron's no_sync is a no-op for it), so a rank's micro-batches are
summed after the data-parallel sum, not before; it averages inside the reduce-scatter
(ReduceOp.AVG), where megatron's DDP scales by 1/DP and sums; and the grad norm sums the squares of
per-parameter shards, not of DDP's bucket ranges.
"""
from __future__ import annotations

import math

from tests.dist import run_distributed
from tests.training.test_fsdp import (
    DENSE, ITERS, MOE, MOE_LAYERS, MOE_OFFLOAD, SYNC_FREE, VARIANTS, ZERO_SYNC, _parse, _without_iters, assert_offloaded,
    assert_same_as,
)

RTOL = 1e-6
FSDP2 = ["--use-torch-fsdp2"]


def runs(world_size: int, argv: list[str]) -> dict:
    return run_distributed(world_size, "tests.training.jobs_fsdp2:against_ddp",
                           argv=argv + ["--world-size", str(world_size)])[-1]


def _pairs(run) -> list[tuple]:
    """(loss, grad norm) per iteration, from a log history (jobs_fsdp2) or a variant's run (jobs_fsdp_compose)."""
    if isinstance(run, dict):
        return [tuple(r) for r in run["history"]]
    return [(r["lm loss"], r["grad norm"]) for r in run]


def assert_agree(runs: dict) -> None:
    ddp, got = _pairs(runs["ddp"]), _pairs(runs["fsdp2"])
    assert len(ddp) == len(got) == ITERS and ddp[-1][0] < ddp[0][0]  # it learns
    a, b = [r[1] for r in ddp], [r[1] for r in got]
    assert all(math.isfinite(x) and math.isclose(x, y, rel_tol=RTOL) for x, y in zip(a, b)), (a, b)
    assert [r[0] for r in got] == [r[0] for r in ddp]  # observed bitwise over these steps


def test_dense_dp2():
    """And the per-rank state bytes of the log line: FSDP2 holds half of every weight and gradient,
    DDP + the distributed optimizer whole ones; both hold half of Adam's state."""
    out = runs(2, DENSE)
    assert_agree(out)
    ddp, got = out["ddp"][-1], out["fsdp2"][-1]
    for key in ("param bytes", "grad bytes"):
        assert math.isclose(2 * got[key], ddp[key], rel_tol=0.01), key  # rows split unevenly: within 1 %
    assert math.isclose(got["optim bytes"], ddp["optim bytes"], rel_tol=0.01)


def test_moe_dp2():
    """And megatron_ext's features under FSDP2 (experts replicated over EP1 and sharded by FSDP2,
    which gathers and frees every layer's weights around each use; compared as in
    tests/training/test_fsdp_compose.py): offload, the sync-free dispatcher, zero-sync dropless with
    offload, each bitwise the FSDP2 run without it; the offload moves exactly the bytes it moves
    under DDP."""
    ddp = ["--use-distributed-optimizer"]
    features = {"offload": FSDP2 + MOE_OFFLOAD, "sync-free": FSDP2 + SYNC_FREE,
                "zero-sync + offload": FSDP2 + ZERO_SYNC + MOE_OFFLOAD}
    results = run_distributed(2, VARIANTS, argv=MOE + ["--world-size", "2"], flags={
        "ddp": ddp, "fsdp2": FSDP2, **features, "ddp offload": ddp + MOE_OFFLOAD})
    assert_agree(results[-1])
    assert_same_as(results, "fsdp2", features)
    for r in results:
        assert [r[n]["dispatchers"] for n in features] == [0, MOE_LAYERS, MOE_LAYERS]
        for name in ("offload", "zero-sync + offload"):
            assert_offloaded(r[name])
        assert r["offload"]["offloaded"] == r["ddp offload"]["offloaded"]


def test_dense_dp2_tp2():
    assert_agree(runs(4, DENSE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]))


def test_refusals_are_megatrons_by_name(tmp_path):
    import pytest

    from megatron_ext.errors import ConfigError

    fsdp2 = DENSE + ["--use-torch-fsdp2", "--world-size", "4"]
    with pytest.raises(ConfigError, match=r"^--expert-model-parallel-size=2, --use-torch-fsdp2=True: .*expert paral"):
        _parse(MOE + ["--use-torch-fsdp2", "--world-size", "2", "--expert-model-parallel-size", "2"])
    for flags, match in [
        (["--pipeline-model-parallel-size", "2"],
         r"^--pipeline-model-parallel-size=2, --use-torch-fsdp2=True: .*pipeline parallelism"),
        (["--use-distributed-optimizer"],
         r"^--use-distributed-optimizer=True, --use-torch-fsdp2=True: .*distributed optimizer"),
        (["--ckpt-format", "fsdp_dtensor"],
         r"^--ckpt-format=fsdp_dtensor, --use-torch-fsdp2=True: .*torch_dist or torch_dcp"),
        (["--ckpt-format", "torch_dcp", "--save", str(tmp_path), "--save-interval", "1"],
         r"^--ckpt-format=torch_dcp: megatron_ext saves and loads torch_dist"),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--overlap-tp-comm-1f1b"],
         r"^--overlap-tp-comm-1f1b=True, --use-torch-fsdp2=True: not supported together"),
        (["--init-model-with-meta-device"],  # megatron's FSDP2 wrapper would leave the weights on meta
         r"^--init-model-with-meta-device without --use-megatron-fsdp: .*FSDP2 wrapper never materialises"),
    ]:
        with pytest.raises(ConfigError, match=match):
            _parse(fsdp2 + flags)
    args = _parse(fsdp2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert args.use_torch_fsdp2 and not args.use_distributed_optimizer and args.ckpt_format == "torch_dist"


def test_resume_is_exact_and_checkpoints_are_verified(tmp_path):
    """MoE DP2 (SwiGLU, experts: megatron's sharded-state-dict factories on DTensor shards), saved
    as torch_dist at 2 and 3: resumed, bitwise the uninterrupted run; a flipped tensor byte in the
    newest checkpoint is named, and the run falls back to iteration 2 exactly. Every parameter is
    written half by each data-parallel rank (its FSDP2 shard), the expert weights included; a
    megatron-core DDP run resumes it (Megatron-LM's torch_dist format, global keys). In bf16
    (megatron's mixed-precision optimizer) a resume from iteration 2 is bitwise too."""
    argv = _without_iters(MOE) + ["--world-size", "2"]
    out = run_distributed(2, "tests.training.jobs_fsdp2:resume", argv=argv, save_dir=str(tmp_path / "ckpt"))[-1]
    straight = [(r["lm loss"], r["grad norm"]) for r in out["straight"]]
    assert [(r["lm loss"], r["grad norm"]) for r in out["first"]] == straight[:3]
    assert [(r["lm loss"], r["grad norm"]) for r in out["resumed"]] == straight[3:]
    assert out["backend"] == "torch_dist"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"} <= set(out["files"])
    written = out["written"]  # half of every parameter in each rank's file, none replicated
    assert len(written) >= 10 and all(
        set(w) == {"__0_0.distcp", "__1_0.distcp"} and w["__0_0.distcp"] == w["__1_0.distcp"]
        for w in written.values()
    ), written
    assert out["refused"].startswith("damaged checkpoint ")
    assert "iter_0000003: __1_0.distcp checksum mismatch" in out["refused"]
    assert [(r["lm loss"], r["grad norm"]) for r in out["fallback"]] == straight[2:3]
    ddp = out["ddp_resumed"]  # megatron-core DDP from the FSDP2 checkpoint: the same run, up to summation order
    assert len(ddp) == len(straight) - 2 and all(
        math.isclose(r["lm loss"], loss, rel_tol=RTOL) and math.isclose(r["grad norm"], norm, rel_tol=RTOL)
        for r, (loss, norm) in zip(ddp, straight[2:])
    ), (ddp, straight[2:])
    bf16 = [(r["lm loss"], r["grad norm"]) for r in out["bf16_straight"]]  # saved at 2 (and 4)
    assert len(bf16) == 4 and [(r["lm loss"], r["grad norm"]) for r in out["bf16_resumed"]] == bf16[2:]
