"""The CPU sync detector flags what would synchronise on CUDA (or break CUDA-graph capture), and only
that: host reads of device values, a host tensor entering a device op, ops that sync in one dtype."""
import pytest
import torch

from megatron_ext.moe.sync_detector import SyncDetector, run_backward

x = torch.randn(6, 4)  # created before the detector: device-resident (like params / activations)
rows = torch.randn(6, 8)  # a grouped GEMM's rows (16-byte strides)


SYNCING = {
    "item": lambda: x.sum().item(),
    "tolist": lambda: x[0].tolist(),
    "int": lambda: int(x[0, 0] > 0),
    "bool": lambda: bool((x > 0).any()),
    "cpu": lambda: x.cpu(),
    "to_cpu_str": lambda: x.to("cpu"),
    "numpy": lambda: x.numpy(),
    "nonzero": lambda: torch.nonzero(x > 0),
    "where_1arg": lambda: torch.where(x > 0),
    "masked_select": lambda: x.masked_select(x > 0),
    "bool_index": lambda: x[x > 0],
    "bool_index_put": lambda: x.clone().__setitem__(x > 0, 1.0),
    "repeat_interleave_tensor": lambda: torch.arange(6, device=x.device).repeat_interleave((x[:, 0] > 0).long()),
    "unique": lambda: torch.unique(x),
    "bincount": lambda: torch.bincount((x[:, 0] > 0).long()),
    "equal": lambda: torch.equal(x, x),
    "copy_to_host": lambda: torch.empty(6, 4).copy_(x),
    "factory_on_device_then_item": lambda: torch.zeros(3, device=x.device).sum().item(),
    "cuda_ordinal_factory": lambda: torch.ones(2, device=0).tolist(),
    # a host tensor in a device op: a host-to-device copy on CUDA, an error inside graph capture
    "host_zero_dim_in_where": lambda: torch.where(x > 0, x, torch.zeros((), dtype=x.dtype)),
    "host_scalar_tensor_times_device": lambda: x * torch.tensor(2.0),
    "host_index_tensor": lambda: x[torch.tensor([0, 2])],
    "host_copied_into_device": lambda: torch.empty(6, 4, device=x.device).copy_(torch.ones(6, 4)),
    "host_to_device": lambda: torch.arange(3).to("cuda"),
    # torch's grouped-GEMM fallback (fp32) reads its offsets on the host
    "grouped_mm_fp32": lambda: torch._grouped_mm(rows, torch.ones(2, 8, 8, device=x.device),
                                                 offs=torch.tensor([3, 6], dtype=torch.int32, device=x.device)),
}

NOT_SYNCING = {
    "arithmetic": lambda: (x * 2 + 1).sum(dim=0),
    "repeat_interleave_output_size": lambda: torch.arange(6, device=x.device).repeat_interleave(
        (x[:, 0] > 0).long() * 0 + 2, output_size=12),
    "repeat_interleave_int": lambda: x.repeat_interleave(2, dim=0),
    "argsort_topk_scatter": lambda: torch.zeros(6, 5, device=x.device).scatter_(1, x.topk(2, dim=1)[1], 1.0)
    .argsort(dim=0),
    "long_index": lambda: x[torch.tensor([0, 2], device=x.device)],
    "device_zero_dim_in_where": lambda: torch.where(x > 0, x, x.new_zeros(())),
    "python_scalar": lambda: torch.where(x > 0, x, 0.0) * 2,
    "grouped_mm_bf16": lambda: torch._grouped_mm(
        rows.to(torch.bfloat16), torch.ones(2, 8, 8, dtype=torch.bfloat16, device=x.device),
        offs=torch.tensor([3, 6], dtype=torch.int32, device=x.device)),
    "host_tensor_reads": lambda: torch.tensor([1, 2, 3]).tolist() + [torch.full((2,), 4).sum().item()],
    "host_only_ops": lambda: torch.arange(5).repeat_interleave(torch.tensor([1, 0, 2, 1, 1])).tolist(),
    "to_same_device_object": lambda: x.to(x.device),
    "nonblocking_copy": lambda: x.to("cpu", non_blocking=True),
    "masked_fill_where": lambda: torch.where(x > 0, x, torch.zeros_like(x)).masked_fill(x < -1, 0),
}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_flags_syncing_op(name):
    with SyncDetector() as det:
        SYNCING[name]()
    assert det.count() >= 1, name


@pytest.mark.parametrize("name", sorted(NOT_SYNCING))
def test_ignores_sync_free_op(name):
    with SyncDetector() as det:
        NOT_SYNCING[name]()
    assert det.count() == 0, det.sites()


def test_each_new_class_is_named():
    kinds = {}
    for name in ("host_zero_dim_in_where", "host_index_tensor", "host_to_device", "grouped_mm_fp32"):
        with SyncDetector() as det:
            SYNCING[name]()
        kinds[name] = [e.kind for e in det.events]
    assert kinds == {"host_zero_dim_in_where": ["host-tensor-in-device-op"],
                     "host_index_tensor": ["host-tensor-in-device-op"],
                     "host_to_device": ["host-tensor-in-device-op"],
                     "grouped_mm_fp32": ["dtype-dependent-sync"]}, kinds


def test_grouped_mm_in_bf16_syncs_on_gpus_without_the_cutlass_kernel():
    """The fast path is compute capability 9.x/10.x only: an A100 (8.0) runs the fallback in bf16 too."""
    run = NOT_SYNCING["grouped_mm_bf16"]
    with SyncDetector(capability=(8, 0)) as det:
        run()
    assert [e.kind for e in det.events] == ["dtype-dependent-sync"] and "8.0" in det.events[0].op
    with SyncDetector(capability=(10, 0)) as det:
        run()
    assert det.count() == 0


def test_host_copy_is_counted_once_and_then_host():
    with SyncDetector() as det:
        h = x.cpu()
        h.tolist(), h.sum().item(), h[h > 0]
    assert det.count() == 1 and det.events[0].kind == "d2h-copy"


def test_mark_host():
    idx = torch.arange(4)  # made outside: device-resident unless declared
    with SyncDetector() as det:
        det.mark_host(idx)
        idx.tolist()
    assert det.count() == 0


def test_phases_and_backward_of_custom_function():
    class Reads(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            a.max().item()
            return a * 2

        @staticmethod
        def backward(ctx, g):
            g.sum().tolist()
            return g * 2

    w = torch.randn(4, requires_grad=True)
    with SyncDetector() as det:
        with det.phase("forward"):
            y = Reads.apply(w)
            z = y[y > 0].sum()  # boolean gather: sync in forward, index_put in backward
        with det.phase("backward"):
            z.backward()
    assert det.count("forward") == 2
    assert det.count("backward") == 2, det.sites()
    assert w.grad is not None


def test_raise_on_sync_and_site():
    with pytest.raises(RuntimeError, match="test_sync_detector.py"):
        with SyncDetector(raise_on_sync=True):
            x.sum().item()


def test_run_backward_outside_detector():
    w = torch.randn(3, requires_grad=True)
    run_backward((w * 3).sum())
    assert torch.equal(w.grad, torch.full((3,), 3.0))
