"""CUDA-faithful CPU mode, part (b): point-to-point messages follow NCCL's rules (per communicator
in issue order, a send completes only with the peer's receive, tags ignored); a deadlocking order is
reported on both ranks with both ranks' pending ops. Removing the shim brings gloo's rules back."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only shim (NCCL has the real rules)")


def test_head_to_head_sends_are_a_reported_deadlock():
    results = run_distributed(2, "tests.platform.jobs_nccl_p2p:both_send_first", timeout=60,
                              without_shim=False)
    for r in results:
        assert not r["completed"] and r["type"] == "P2PDeadlock", r
        assert r["seconds"] < 20, r  # detected, not timed out
        assert "both heads are sends" in r["error"]
        # both ranks' pending ops, each with its queue: the head send, then the receive behind it
        for peer in (0, 1):
            assert f"rank {peer} (completed: 0 sends, 0 recvs) pending: send to {1 - peer} #0" in r["error"]
            assert f"recv from {1 - peer} #0" in r["error"]
    without = run_distributed(2, "tests.platform.jobs_nccl_p2p:both_send_first", timeout=60,
                              without_shim=True)
    assert [r["got"] for r in without] == [[1.0] * 4, [0.0] * 4]  # gloo: it completes


def test_head_to_head_receives_are_a_reported_deadlock():
    results = run_distributed(2, "tests.platform.jobs_nccl_p2p:both_receive_first", timeout=60,
                              without_shim=False)
    assert all(not r["completed"] and "both heads are recvs" in r["error"] for r in results)
    without = run_distributed(2, "tests.platform.jobs_nccl_p2p:both_receive_first", timeout=60,
                              without_shim=True)
    assert all(r["completed"] for r in without)


def test_matched_by_order_not_by_tag():
    assert run_distributed(2, "tests.platform.jobs_nccl_p2p:order_not_tags", timeout=60,
                           without_shim=False)[1] == [[1.0, 1.0], [2.0, 2.0]]
    assert run_distributed(2, "tests.platform.jobs_nccl_p2p:order_not_tags", timeout=60,
                           without_shim=True)[1] == [[2.0, 2.0], [1.0, 1.0]]


def test_send_completes_with_the_receive_and_groups_pass_through():
    r0, r1 = run_distributed(2, "tests.platform.jobs_nccl_p2p:send_completes_with_the_receive", timeout=60)
    assert not r0["completed_at_once"] and r0["send_seconds"] >= 0.4
    assert r0["grouped_got"] == [1.0] * 3 and r1["grouped_got"] == [0.0] * 3
