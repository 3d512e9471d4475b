"""Pipeline messages under NCCL's rules: the p2p checker, megatron's plain schedules and ours.

Pure (no processes): megatron's schedules run on stand-ins (megatron_ext.measure.p2p_programs), ours
is the same `steps` the schedule executes."""
from __future__ import annotations

import pytest

from megatron_ext.measure.p2p_programs import megatron_program
from megatron_ext.schedules import pipeline_plan
from megatron_ext.schedules.p2p import Op, Wait, check

PPS, VPPS = (2, 3, 4, 8), (1, 2, 3, 4)


def _combos():
    return [(pp, vpp, m) for pp in PPS for vpp in VPPS for m in (pp, 2 * pp, 4 * pp)]


def _ours(pp, vpp, m, layout=pipeline_plan.DIRECTIONAL, pair_warmup=False):
    group = pp if vpp > 1 else None  # megatron's default microbatch_group_size_per_vp_stage
    return {r: pipeline_plan.program(m, vpp, pp, r, group, layout=layout, pair_warmup=pair_warmup)
            for r in range(pp)}


def test_checker_rules_on_small_programs():
    send, recv = (lambda peer, label=None, comm="g", group=None: Op("send", peer, comm, label, group),
                  lambda peer, label=None, comm="g", group=None: Op("recv", peer, comm, label, group))
    # the order from the issue: rank 0 sends two activations, then receives; rank 1 receives one,
    # sends one back on the same communicator, then receives: two sends head to head
    v = check({0: [send(1, "a0"), send(1, "a1"), recv(1, "b0"), Wait(2)],
               1: [recv(0, "a0"), Wait(0), send(0, "b0"), recv(0, "a1"), Wait(3)]})
    assert not v.completes
    assert "running op 1: send to 1" in " ".join(v.pending[0])
    assert "running op 2: send to 0" in " ".join(v.pending[1])
    # the same order with the return message on a communicator of its own completes
    v = check({0: [send(1, "a0"), send(1, "a1"), recv(1, "b0", comm="h"), Wait(2)],
               1: [recv(0, "a0"), Wait(0), send(0, "b0", comm="h"), recv(0, "a1"), Wait(3)]})
    assert v.ok, v.report()
    # grouped ops run together: a send/recv exchange in one group on each side completes
    assert check({0: [send(1, group=1), recv(1, group=1)], 1: [send(0, group=1), recv(0, group=1)]}).ok
    # ...ungrouped on one communicator, both sending first, it does not
    assert not check({0: [send(1), recv(1)], 1: [send(0), recv(0)]}).completes
    # a wait holds back what the rank issues after it
    assert not check({0: [recv(1, comm="x"), Wait(0), send(1, comm="y")],
                      1: [recv(0, comm="y"), Wait(0), send(0, comm="x")]}).completes
    # NCCL matches by order, not by tag: a swapped order delivers the wrong tensors
    v = check({0: [send(1, "p"), send(1, "q")], 1: [recv(0, "q"), recv(0, "p")]})
    assert v.completes and not v.ok and len(v.mismatched) == 2
    # an unmatched send never completes
    assert not check({0: [send(1)], 1: []}).completes


def test_megatron_plain_schedules_complete_under_nccl_rules():
    accepted = 0
    for pp, vpp, m in _combos():
        try:
            progs = {r: megatron_program(pp, vpp, m, r) for r in range(pp)}
        except (AssertionError, ValueError, RuntimeError):
            continue  # a combination megatron refuses
        accepted += 1
        verdict = check(progs)
        assert verdict.ok, f"megatron PP{pp} VPP{vpp} M{m}:\n{verdict.report()}"
        labels = [op.label for prog in progs.values() for op in prog if isinstance(op, Op)]
        assert labels and None not in labels  # every message is named: the label check ran
    assert accepted == len(_combos())  # 0.19.2 accepts all of them with its default p2p options


def test_checker_catches_megatron_batched_p2p_at_pp2_with_virtual_stages():
    """Negative control on megatron's side: batch_p2p_comm at PP=2 with virtual stages (which
    megatron's arguments refuse) matches an activation with a gradient."""
    verdict = check({r: megatron_program(2, 2, 4, r, overlap_p2p_comm=False, batch_p2p_comm=True)
                     for r in range(2)})
    assert verdict.mismatched and not verdict.ok


@pytest.mark.parametrize("pair_warmup", [False, True], ids=["warmup-single", "warmup-pairs"])
def test_ours_completes_under_nccl_rules_everywhere(pair_warmup):
    for pp, vpp, m in _combos():
        verdict = check(_ours(pp, vpp, m, pair_warmup=pair_warmup))
        assert verdict.ok, f"ours PP{pp} VPP{vpp} M{m} pair_warmup={pair_warmup}:\n{verdict.report()}"


def test_ours_with_one_communicator_per_kind_deadlocks_at_pp2_with_virtual_stages():
    """Negative control: activations 0->1 and 1->0 (between chunks) on one communicator, the
    layout the schedule had before, put two sends head to head under NCCL's rules."""
    for vpp in (2, 3, 4):
        for m in (2, 4, 8):
            verdict = check(_ours(2, vpp, m, layout=pipeline_plan.SHARED))
            assert not verdict.completes
            assert all(any("running" in p and "send to" in p for p in verdict.pending[r]) for r in (0, 1))
    for pp in (3, 4, 8):  # with PP > 2 each pair of ranks carries one direction per kind anyway
        assert check(_ours(pp, 2, 2 * pp, layout=pipeline_plan.SHARED)).ok


@pytest.mark.parametrize("pp, vpp, m", [(2, 2, 4), (4, 2, 8), (2, 1, 4)])
def test_steps_send_and_receive_every_message_once(pp, vpp, m):
    progs = _ours(pp, vpp, m)
    sent = sorted((op.peer, op.label) for p in progs.values() for op in p
                  if isinstance(op, Op) and op.kind == "send")
    received = sorted((r, op.label) for r, p in progs.items() for op in p
                      if isinstance(op, Op) and op.kind == "recv")
    assert sent == received and len(set(sent)) == len(sent)
    # every forward but the first virtual stage's receives one activation, every backward but
    # the last virtual stage's one gradient
    assert len(sent) == 2 * (pp * vpp - 1) * m
