"""Job functions for tests/planner/test_steptime.py (rank 0 of a one-process gloo world)."""
from __future__ import annotations


def _parse(argv):
    import arguments

    from megatron_ext.planner import published

    return published.parse(argv, arguments.parse)


# a dense BF16 run on the transformer-engine target: Llama-3-8B's shape, one node
DENSE_8B = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
            "--group-query-attention", "--num-query-groups", "8", "--normalization", "RMSNorm", "--swiglu",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
            "--vocab-size", "128256", "--tokenizer-type", "NullTokenizer", "--mock-data", "--bf16",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--lr", "1e-4", "--train-iters", "10", "--world-size", "8", "--use-distributed-optimizer", "--num-workers", "0"]


def attention_kinds(seqs=(4096, 8192)):
    """Per sequence length, the step time's terms with each core attention kind on the same run, and
    the kind the run's own flags resolve to (transformer-engine target; local spec with megatron's
    unfused attention)."""
    from megatron_ext.planner import memory, profiles, steptime, work

    dev = profiles.device("h100", None)
    out = {}
    for seq in seqs:
        args = _parse([*DENSE_8B, "--seq-length", str(seq), "--max-position-embeddings", str(seq)])
        layout = memory.Layout.from_args(args)
        stub = [dict(components=dict(parameters=0.0))]
        out[seq] = {kind: steptime.step_time(args, layout, stub, [0.0], dev, dev.host_link, attention=kind)
                    for kind in ("unfused", "sdpa", "transformer_engine")}
    te = _parse([*DENSE_8B, "--seq-length", "4096", "--max-position-embeddings", "4096"])
    local = [*DENSE_8B, "--seq-length", "4096", "--max-position-embeddings", "4096", "--transformer-impl", "local",
             "--assume-no-te"]
    return dict(times={s: {k: {n: v for n, v in t.items() if n.endswith("_s")} for k, t in kinds.items()}
                       for s, kinds in out.items()},
                resolved=dict(transformer_engine=work.attention_kind(te),
                              local_unfused=work.attention_kind(_parse([*local, "--attention-backend", "unfused"])),
                              local_auto=work.attention_kind(_parse(local)),
                              local_flash=work.attention_kind(_parse([*local, "--attention-backend", "flash"]))))


def profile_changes_the_prediction():
    """The same published dense run (Llama3-70B) planned on the datasheet model and on a profile
    whose matrix products are measured at half the datasheet model's rate and whose attention is
    measured at a tenth of its time; the H200's stored profile as the planner reads it."""
    from megatron_ext.planner import hardware, memory, profiles, published, steptime

    case = published.CASES["llama3-70b 64xH100 TP4 PP8 VP5 fp8"]
    args = _parse(case["argv"])
    layout = memory.Layout.from_args(args)
    sheet = profiles.device("h100", None)
    rows = []
    for dtype, fp8 in (("bfloat16", False), ("float8", True)):
        for m in (1024, 8192):
            for n in (1024, 8192, 32768):
                for k in (1024, 8192, 32768):
                    rows.append(dict(dtype=dtype, m=m, n=n, k=k, ms=2 * sheet.gemm_s(m, n, k, fp8=fp8) * 1e3))
    s = 4096
    att = sheet.attention_s("transformer_engine", 1, 32, s, 128, 128, s * (s + 1) / 2) * 1e3
    profile = dict(schema=1, gpu="h100", device="NVIDIA H100 (test)", date="2000-01-01", source="test",
                   gemm=dict(source="test", rows=rows),
                   attention=dict(source="test", rows=[dict(kind="transformer_engine", batch=1, seq=s, heads=32,
                                                            head_dim=128, causal=True, fwd_bwd_ms=att / 10)]))
    profiles.check(profile)
    measured = profiles.device("h100", profile)
    stub = [dict(components=dict(parameters=0.0))]
    times = {}
    for name, dev in (("datasheet", sheet), ("profile", measured)):
        t = steptime.step_time(args, layout, stub, [0.0], dev, dev.host_link)
        times[name] = dict({k: v for k, v in t.items() if k.endswith("_s")}, kernels=t["kernels"])
    h200 = profiles.device("h200")
    stored = profiles.load("h200")
    attention = {r["kind"]: (r["fwd_bwd_ms"], h200.attention_s(r["kind"], r["batch"], r["heads"], r["seq"], r["head_dim"],
                                                                r["head_dim"], r["seq"] * (r["seq"] + 1) / 2) * 1e3)
                 for r in stored["attention"]["rows"] if "documents" not in r}
    return dict(times=times, sources=measured.sources, h200_measured=h200.measured, h200_describe=h200.describe(),
                h200_attention=attention, h200_link=(h200.host_link, stored["host_link"]["d2h_bytes_per_s"]),
                h100_stored=profiles.load("h100"), gemm_efficiency=hardware.GEMM_EFFICIENCY)


def fit_with_the_held_out_half_poisoned():
    """published.fit over the data points (the published runs and the device record's whole steps) with
    every held-out point made unreadable (flags no parser accepts, a GPU the planner does not know) and
    its measured figure multiplied by 10: a fit that read one would fail or move."""
    import arguments

    from megatron_ext.planner import hardware, published
    from tests.scripts import load_script

    points = published.data_points(load_script("bench_plan").device_steps())
    poisoned = [dict(p, argv=["--no-such-flag"], gpu="no-such-gpu", measured=10 * p["measured"])
                if p["role"] == "held out" else p for p in points]
    fitted = published.fit(arguments.parse, poisoned)
    return dict(fitted=fitted, constants=dict(gemm_efficiency=hardware.GEMM_EFFICIENCY, moe_layer_s=hardware.MOE_LAYER_S),
                points=[{k: p[k] for k in ("name", "kind", "moe", "role")} for p in points])




def unfused_bytes_per_score(seqs=(64, 128), heads=2, head_dim=8):
    """Bytes megatron's unfused DotProductAttention (the local spec's core attention with
    --attention-backend unfused, BF16, softmax in fp32) reads and writes, forward and backward, counted
    op by op (every aten op that moves data: its tensors' bytes in and out; views move none), at two
    sequence lengths: the coefficient of heads x s^2 (the linear terms cancel)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from megatron_ext.training import parallel

    views = {"view", "_unsafe_view", "transpose", "t", "permute", "expand", "slice", "select", "unsqueeze", "squeeze",
             "as_strided", "alias", "detach", "_local_scalar_dense"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] not in views:
                tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
                self.nbytes += sum(t.numel() * t.element_size() for t in tensors if t.numel() > 1)
            return out

    from gpu_check_sections.kernel_profile import _local_core_attention

    try:
        attn = _local_core_attention("unfused", heads, head_dim, max(seqs))  # as gpu_check measures it
        counts = {}
        for s in seqs:
            q, k, v = (torch.randn(s, 1, heads, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            c = Count()
            with c:
                out = attn(q, k, v)
                fwd = c.nbytes
                out.backward(torch.ones_like(out))
            counts[s] = (fwd, c.nbytes - fwd)
    finally:
        parallel.destroy()
    a, b = seqs
    scale = heads * (b * b - (b / a) * a * a)
    fwd = (counts[b][0] - (b / a) * counts[a][0]) / scale
    bwd = (counts[b][1] - (b / a) * counts[a][1]) / scale
    return dict(forward=fwd, backward=bwd)


def kernel_profile_smoke():
    """gpu_check's kernel_profile at its CPU smoke size: what it returns and that it refuses to write."""
    from gpu_check_sections import kernel_profile

    from megatron_ext.planner import profiles

    claims = []
    r = kernel_profile.section_kernel_profile(None, claims)
    smoke = r["cpu_smoke"]
    profiles.check(smoke)
    try:
        kernel_profile.write(smoke)
        refused = None
    except ValueError as e:
        refused = str(e)
    return dict(status=r["status"], read=r["cpu_smoke_read_by_planner"], claims=claims, refused=refused,
                blocks={k: bool(smoke.get(k)) for k in ("gemm", "grouped_gemm", "attention", "hbm", "host_link")},
                kinds=sorted({row["kind"] for row in smoke["attention"]["rows"]}),
                skipped=smoke["attention"]["skipped"], gpu=smoke["gpu"], kind=kernel_profile.gpu_kind("NVIDIA H100 80GB HBM3"))


def published_fit_stdout() -> dict:
    """scripts/bench_plan.py --published-fit --json: its exit status and what reached file descriptor 1
    (what a shell reads, log handlers' writes included)."""
    import os
    import sys
    import tempfile

    from tests.scripts import load_script

    bench_plan = load_script("bench_plan")
    with tempfile.TemporaryFile(mode="w+") as captured:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(captured.fileno(), 1)
        try:
            status = bench_plan.main(["--published-fit", "--json"])
            sys.stdout.flush()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        return dict(status=status, stdout=captured.read())
