"""Offload under context parallelism (torch attention): what each comm type's core attention keeps,
as offload/theory.py counts it, and R = 1 under PP2 x CP2 (scripts/bench_offload.py's CP cases)."""
from __future__ import annotations

import pytest

from megatron_ext.offload import theory
from tests.dist import run_distributed

DENSE = ["core_attention", "qkv_linear", "attn_proj"]
COMM_TYPES = ("p2p", "all_gather", "a2a")
# not the shape the counts were read from (hidden 64, 4 heads, seq 64, 2 sequences a micro-batch); every
# tensor a layer keeps at least the benchmark's 1 KB offload threshold (the theory counts them all:
# all_gather's smallest, a chunk's log-sum-exp, is 48 tokens x 6 heads x 4 bytes)
SHAPE = dict(layers=3, hidden=96, heads=6, seq=192, mbs=1, vocab=512, ffn=128, microbatches=1, attention="sdpa", cp=2)


def test_a_rank_holds_its_share_of_the_tokens_and_unfused_attention_is_refused():
    one = theory.Shape(seq=96, mbs=2, hidden=64, heads=4)
    two = theory.Shape(seq=96, mbs=2, hidden=64, heads=4, cp=2)
    assert two.tokens * 2 == one.tokens
    assert theory.qkv_linear_bytes(two) * 2 == theory.qkv_linear_bytes(one)
    with pytest.raises(ValueError, match="torch attention only"):
        theory.core_attention_bytes(two, "unfused")
    with pytest.raises(ValueError, match="split evenly"):
        theory.Shape(seq=97, mbs=1, hidden=64, heads=4, cp=2)


def test_each_comm_type_offloads_what_the_theory_counts():
    """Every layer but the last copies one group; its bytes are the theory's for the rank's tokens,
    core attention alone and with the projection (every comm type hands the projection a storage of
    its own: all_gather the concatenation of its two chunks' outputs, a2a and p2p a copy)."""
    for comm in COMM_TYPES:
        for modules in (["core_attention"], DENSE):
            r = run_distributed(2, "bench.offload:compare", modules=modules, steps=1, cp_comm_type=comm, **SHAPE)[0]
            assert r["grads_equal"] and r["losses_equal"], (comm, modules, r["bad_grads"])
            per_group = r["stats"]["offloaded_bytes"] / (SHAPE["layers"] - 1)
            assert per_group == r["theory_group_bytes"], (comm, modules, per_group, r["theory_group_bytes"])
    shape = {k: v for k, v in SHAPE.items() if k in ("seq", "mbs", "hidden", "heads", "cp")}
    alone = {c: theory.group_bytes(["attn_proj"], False, "sdpa", cp_comm_type=c, **shape) for c in COMM_TYPES}
    assert 0 < alone["all_gather"] == alone["p2p"] == alone["a2a"]


@pytest.mark.parametrize("comm", COMM_TYPES)
def test_pp2_cp2_saves_what_the_theory_says_bitwise(comm):
    """scripts/bench_offload.py's PP=2 x CP=2 case at its smoke size, dense and MoE, every rank: R
    within 1 % and every gradient bit for bit offload off."""
    rows = [row for rank in run_distributed(4, "bench_offload:run_schedule", schedule=f"PP=2xCP=2 {comm}",
                                            timeline_case="", smoke=True) for row in rank]
    assert len(rows) == 8 and {(r["pp_rank"], r["cp_rank"]) for r in rows} == {(p, c) for p in (0, 1) for c in (0, 1)}
    for r in rows:
        assert r["grads_bitwise_equal"], r
        assert 0.99 <= r["R"] <= 1.01, (r["model"], r["pp_rank"], r["cp_rank"], r["R"])
