"""Context parallelism on the local spec (megatron_ext/attention/context_parallel.py): each comm type's
attention over a gloo CP group against the one-rank kernel on the whole sequence, fp32."""
from __future__ import annotations

import pytest

from tests.attention import jobs_cp
from tests.dist import run_distributed

_RUNS: dict = {}


def _kernels(cp: int) -> dict:
    if cp not in _RUNS:
        _RUNS[cp] = run_distributed(cp, "tests.attention.jobs_cp:kernels_match_one_rank")
    return _RUNS[cp]


@pytest.mark.parametrize("cp", [2, 4])
def test_each_comm_type_matches_one_rank(cp):
    """Output and the gradients of queries, keys, values (and sinks) on every rank within 2e-6 of the
    one-rank kernel's same rows: the causal triangle, GQA, narrower values, windows, sinks and a packed
    row's documents under the load-balanced split."""
    expected = {f"{c[0]}/{comm}" for c in jobs_cp.KERNEL_CASES for comm in c[-1]}
    for rank, result in enumerate(_kernels(cp)):
        assert set(result) == expected
        for case, errors in result.items():
            assert max(errors) <= 2e-6, (rank, case, errors)


@pytest.mark.parametrize("cp", [2, 4])
def test_one_rank_simulated_on_one_device_computes_what_that_rank_does(cp):
    """``OneRank(cp, rank)`` (what gpu_check times per comm type on one GPU) runs the rank's own kernels:
    with every rank holding the same inputs, its output and dq equal the real group's on every rank."""
    expected = {f"{c[0]}/{comm}" for c in jobs_cp.KERNEL_CASES for comm in c[-1]}
    for rank, result in enumerate(run_distributed(cp, "tests.attention.jobs_cp:one_rank_simulation_matches")):
        assert set(result) == expected
        for case, errors in result.items():
            assert max(errors) <= 1e-6, (rank, case, errors)


def test_ring_backward_hands_cuda_its_output_token_major():
    """CUDA's memory-efficient backward reads the output at row stride heads x head size (its kernel's
    o_strideM), whatever the tensor's strides: the ring's merged output is head-major, which that kernel
    read out of bounds on an H200 (an illegal memory access). The arguments it is given: token-major
    output and output gradient, the log-sum-exp padded to 32 rows, values unchanged."""
    import torch

    from megatron_ext.attention import context_parallel as cpa

    b, h, s, d = 2, 4, 40, 16
    q, k, v, out, dout = (torch.randn(b, h, s, d) for _ in range(5))
    assert out.stride(2) != h * d  # head-major, as the ring merges it
    args = cpa.efficient_backward_args(dout[:, :, 10:], q, k, v, out[:, :, 10:], torch.randn(b, h, s - 10))
    for given, original in ((args[0], dout[:, :, 10:]), (args[5], out[:, :, 10:])):
        assert given.stride(2) == h * d and given.stride(1) == d and torch.equal(given, original)
    assert args[6].shape == (b, h, 32) and args[4] is None


# the aten ops that move a rank's tensors between layouts (the kernels and allocations aside)
_MOVES = ("copy_", "clone", "index_select", "index_add", "new_zeros", "zeros_like", "cat", "contiguous", "slice_backward", "add", "add_")


@pytest.mark.parametrize("comm,bound", [("a2a", 30), ("all_gather", 26)])
def test_a_ranks_layout_moves_are_counted(comm, bound):
    """Bytes the layout changes of one CP rank read and write, forward and backward (CP 2, one rank
    simulated, its collectives local copies; in units of the rank's queries; GQA with half the heads):
    the reorders between rank-major chunks and sequence order copy each block once each way
    (index_select's backward is an index_add into zeros), all_gather's chunks take prefixes of the
    gathered keys whose gradients are summed in place (slicing's backward makes a zero-filled tensor per
    slice): 39 and 39 units before, 30 and 25.5 now, the outputs and gradients bit for bit the same."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from megatron_ext.attention import context_parallel as cpa

    class Moved(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] in _MOVES:
                Moved.nbytes += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                                    if isinstance(t, torch.Tensor))
            return out

    b, h, g, s, d = 1, 8, 4, 256, 16
    q, k, v = (torch.randn(b, n, s // 2, d, requires_grad=True) for n in (h, g, g))
    dy = torch.randn(b, h, s // 2, d)
    with Moved():
        cpa.attend(comm, q, k, v, group=cpa.OneRank(2, 0), scale=0.25, causal=True).backward(dy)
    assert Moved.nbytes / q.numel() / q.element_size() <= bound


def _parse(*argv):
    import contextlib
    import io

    import arguments

    with contextlib.redirect_stdout(io.StringIO()):
        return arguments.parse([*argv, "--dry-run"], exit_on_dry_run=False)


DENSE = ("--recipe", "recipes/tiny_dense.yaml", "--world-size", "4")


@pytest.mark.parametrize("argv, line", [
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "6", "--kv-channels", "16"],
     "--cp-comm-type=a2a with --num-attention-heads=6: 6 heads per tensor-parallel rank do not split over "
     "--context-parallel-size=4"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "12", "--kv-channels", "16",
      "--group-query-attention", "--num-query-groups", "3"],
     "--cp-comm-type=a2a with --num-query-groups=3: 3 query groups per tensor-parallel rank neither split "
     "over nor repeat to --context-parallel-size=4"),
    (["--context-parallel-size", "2", "--window-size", "8,0"],
     "--window-size=(8, 0) with --cp-comm-type=p2p: ring attention runs the causal triangle only"),
    (["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "p2p", "p2p", "p2p", "--softmax-type",
      "learnable"], "--softmax-type=learnable with --cp-comm-type=p2p"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], "--cp-comm-type=a2a+p2p with --transformer-impl=local"),
    (["--context-parallel-size", "2", "--attention-backend", "unfused"],
     "--context-parallel-size=2 with --attention-backend=unfused: megatron's DotProductAttention"),
    (["--context-parallel-size", "4", "--seq-length", "36"], "--seq-length=36"),
])
def test_what_a_comm_type_cannot_express_is_refused_by_name(argv, line):
    """One line before any compute, naming the flag, its value and the comm type that can."""
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _parse(*DENSE, *argv)
    assert str(e.value).startswith(line) and len(str(e.value).splitlines()) == 1, str(e.value)


def test_per_layer_comm_types_reach_their_layers():
    """--cp-comm-type one per layer passes megatron's validation (its length = --num-layers) and the
    local spec takes it; a window with all_gather and a2a only is allowed."""
    args = _parse(*DENSE, "--context-parallel-size", "2", "--cp-comm-type", "p2p", "all_gather", "a2a", "a2a")
    assert args.cp_comm_type == ["p2p", "all_gather", "a2a", "a2a"] and args.attention_kernel == "sdpa"
    args = _parse(*DENSE, "--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--window-size", "8,0")
    assert args.cp_comm_type == ["all_gather"]
