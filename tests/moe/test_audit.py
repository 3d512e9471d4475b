"""The CPU audit sees what CUDA saw (megatron_ext/moe/audit.py, sync_detector.py): every MoE layer
mode claimed sync-free, at EP 1 and 2, flags nothing (no host read, no host tensor in a device op, no
op that syncs in the layer's dtype), nor does the whole transformer layer a CUDA graph captures; and each
class the first GPU run found is flagged where it really is: the host-made 0-dim zero of the grouped
experts as they were at 4d4d546, torch's fp32 grouped GEMM, the one-sync dropless mode's host read."""
import functools
import os
import subprocess

import pytest

from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OLD = "4d4d546"  # the tree the first GPU run measured


def old_grouped_experts():
    """megatron_ext/moe/grouped_experts.py as it was at OLD, or None where git or the commit is absent."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "show", f"{OLD}:megatron_ext/moe/grouped_experts.py"],
                             capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return out.stdout if out.returncode == 0 else None


@functools.lru_cache(maxsize=None)
def audits():
    source = old_grouped_experts()
    return {ep: run_distributed(ep, "tests.moe.jobs:sync_audit", ep=ep, old_grouped_experts=source)
            for ep in (1, 2)}


@pytest.mark.parametrize("ep", [1, 2])
def test_every_mode_claimed_sync_free_passes_the_audit(ep):
    for rank, audit in enumerate(audits()[ep]):
        assert len(audit["sync_free"]) == 6
        assert all(sites == [] for sites in audit["sync_free"].values()), (rank, audit["sync_free"])
        assert all(sites == [] for sites in audit["whole_layer"].values()), (rank, audit["whole_layer"])


def test_the_captured_transformer_layer_has_static_shapes():
    """The whole layer a CUDA graph captures (attention + zero-sync MoE, bf16): the same ops with the
    same shapes, forward and backward, collectives included, for two routings."""
    for dispatcher in ("alltoall", "allgather"):
        res = run_distributed(2, "tests.moe.jobs:shape_trace", dispatcher=dispatcher, mode="dropless-syncfree",
                              whole=True, dtype="bfloat16")
        assert all(r["same"] and r["ops"] > 200 for r in res), res


@pytest.mark.parametrize("ep", [1, 2])
def test_negative_controls_each_class_is_flagged_where_it_is(ep):
    for audit in audits()[ep]:
        fp32 = audit["fp32_zero_sync"]["alltoall/dropless-syncfree"]
        assert [s.split(" at ")[0] for s in fp32] == (
            ["[forward] dtype-dependent-sync: aten._grouped_mm.default: torch's grouped-GEMM fallback reads the "
             "offsets on the host (torch.float32)"] * 2
            + ["[backward] dtype-dependent-sync: aten._grouped_mm.default: torch's grouped-GEMM fallback reads the "
               "offsets on the host (torch.float32)"] * 4), fp32
        read = audit["one_sync_dropless"]["alltoall/dropless"]
        assert len(read) == 1 and read[0].startswith("[forward] d2h-copy: tolist at megatron_ext/moe/dispatcher.py")


@pytest.mark.parametrize("ep", [1, 2])
def test_the_audit_fails_on_the_grouped_experts_of_4d4d546(ep):
    """The line the H200 run found (a host-made 0-dim zero in torch.where: a sync, and graph capture
    fails), in the real code of that tree, run by this audit."""
    if old_grouped_experts() is None:
        pytest.skip(f"git or commit {OLD} is not available in this checkout (a shallow clone)")
    for audit in audits()[ep]:
        old = audit["old_grouped_experts"]
        assert old == {f"{d}/dropless-syncfree": [
            "[forward] host-tensor-in-device-op: aten.where.self with a host () bfloat16 at "
            "grouped_experts@4d4d546.py:128 (__call__)"] for d in ("alltoall", "allgather")}, old
