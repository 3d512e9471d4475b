"""indices_to_multihot: bit-identical to megatron-core's _indices_to_multihot, and sync-free."""
import pytest
import torch

from megatron_ext.moe.multihot import indices_to_multihot, reference_indices_to_multihot
from megatron_ext.moe.sync_detector import SyncDetector, run_backward


def make_inputs(T, K, E, masked=0.3, dtype=torch.float32, seed=0):
    """Top-k-like indices: distinct experts per row, a fraction masked with -1."""
    gen = torch.Generator().manual_seed(seed)
    if T == 0:
        idx = torch.empty(0, K, dtype=torch.long)
    else:
        idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
    idx = idx.masked_fill(torch.rand(T, K, generator=gen) < masked, -1)
    probs = torch.randn(T, K, generator=gen).to(dtype)
    return idx, probs


def bits(t):
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def assert_bit_identical(idx, probs, E):
    ref_map, ref_probs = reference_indices_to_multihot(idx, probs, E)
    map_, probs_ = indices_to_multihot(idx, probs, E, out_dtype=torch.float32)
    assert map_.dtype == torch.bool and map_.shape == ref_map.shape
    assert torch.equal(map_, ref_map)
    assert probs_.dtype == ref_probs.dtype and probs_.shape == ref_probs.shape
    assert torch.equal(bits(probs_), bits(ref_probs))  # bit for bit, incl. -0.0 and NaN payloads
    assert map_.is_contiguous() and probs_.is_contiguous()


SHAPES = [(0, 2, 4), (1, 1, 1), (3, 4, 4), (5, 8, 8), (7, 1, 8), (16, 2, 64), (33, 6, 16), (128, 8, 256), (1000, 2, 8)]


@pytest.mark.parametrize("T,K,E", SHAPES)
@pytest.mark.parametrize("masked", [0.0, 0.3, 1.0])
def test_bit_identical_random(T, K, E, masked):
    for seed in range(3):
        assert_bit_identical(*make_inputs(T, K, E, masked=masked, seed=seed), E)


def test_rows_all_masked_and_k_equals_e():
    idx, probs = make_inputs(64, 8, 8, masked=0.0)
    idx[::3] = -1  # whole rows masked
    assert_bit_identical(idx, probs, 8)
    map_, _ = indices_to_multihot(idx, probs, 8)
    assert not map_[::3].any() and map_[1::3].all()  # K == E: unmasked rows hit every expert


def test_large_t():
    assert_bit_identical(*make_inputs(1 << 17, 4, 32, seed=5), 32)


def test_special_values_keep_their_bits():
    idx = torch.tensor([[0, 2], [1, -1], [3, 0]])
    probs = torch.tensor([[-0.0, float("nan")], [float("inf"), 7.0], [-float("inf"), 1e-45]])
    assert_bit_identical(idx, probs, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(dtype):
    """The reference takes float32 probs only (index_put_ into a float32 buffer); ours keeps the
    probs' dtype by default and equals the reference elementwise after the same cast."""
    idx, probs = make_inputs(50, 3, 12, dtype=dtype)
    with pytest.raises(RuntimeError):
        reference_indices_to_multihot(idx, probs, 12)
    ref_map, ref_probs = reference_indices_to_multihot(idx, probs.float(), 12)
    map_, probs_ = indices_to_multihot(idx, probs, 12)
    assert probs_.dtype == dtype and torch.equal(map_, ref_map)
    assert torch.equal(bits(probs_.float()), bits(ref_probs))
    _, probs32 = indices_to_multihot(idx, probs, 12, out_dtype=torch.float32)
    assert torch.equal(bits(probs32), bits(ref_probs))


def test_int32_indices():
    idx, probs = make_inputs(40, 2, 8)
    assert_bit_identical(idx.int(), probs, 8)


def test_gradient_matches_reference():
    idx, probs = make_inputs(30, 3, 6, seed=2)
    g = torch.randn(30, 6)
    p1 = probs.clone().requires_grad_()
    p2 = probs.clone().requires_grad_()
    # not Tensor.backward / torch.autograd.backward: the CPU shim mode recurses on those
    run_backward((reference_indices_to_multihot(idx, p1, 6)[1] * g).sum())
    run_backward((indices_to_multihot(idx, p2, 6)[1] * g).sum())
    assert torch.equal(p1.grad, p2.grad)


@pytest.mark.parametrize("T,K,E", [(0, 2, 4), (9, 2, 4), (256, 8, 64)])
def test_zero_syncs_and_reference_has_three(T, K, E):
    idx, probs = make_inputs(T, K, E)
    with SyncDetector() as det:
        indices_to_multihot(idx, probs, E)
    assert det.count() == 0, det.sites()
    with SyncDetector() as det:
        reference_indices_to_multihot(idx, probs, E)
    kinds = sorted(e.op for e in det.events)
    # indices[mask], probs[mask] (boolean-mask gathers) and repeat_interleave without output_size
    assert kinds == ["aten.index.Tensor", "aten.index.Tensor", "aten.repeat_interleave.Tensor"], det.sites()


def test_output_shapes_do_not_depend_on_data():
    """Same ops and shapes whatever the mask: nothing a CUDA graph could not replay."""
    traces = []
    for masked in (0.0, 0.5, 1.0):
        idx, probs = make_inputs(20, 4, 8, masked=masked)
        from torch.utils._python_dispatch import TorchDispatchMode

        class Trace(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ops = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                shapes = [tuple(o.shape) for o in (out if isinstance(out, (list, tuple)) else [out])
                          if isinstance(o, torch.Tensor)]
                self.ops.append((str(func), shapes))
                return out

        with Trace() as tr:
            indices_to_multihot(idx, probs, 8)
        traces.append(tr.ops)
    assert traces[0] == traces[1] == traces[2]
    assert not any("nonzero" in op or "masked_select" in op for op, _ in traces[0])
