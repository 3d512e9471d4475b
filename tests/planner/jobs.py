"""Job functions for the planner tests (every rank of a gloo world)."""
from __future__ import annotations


def plan_json(argv, prefix="--"):
    """scripts/plan.py's report for argv (train.py's with prefix "--plan-"), or the one-line refusal."""
    import arguments

    from megatron_ext.errors import ConfigError
    from megatron_ext.planner import cli

    try:
        return dict(report=cli.main([*argv, f"{prefix}json"], prefix, arguments.parse))
    except ConfigError as e:
        return dict(error=str(e))


def plan_json_recipe(extra):
    """plan_json for recipes/tiny_dense.yaml with ``extra`` keys added to the recipe."""
    import os
    import tempfile

    import yaml

    with open("recipes/tiny_dense.yaml") as f:
        recipe = dict(yaml.safe_load(f), **extra)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(recipe, f)
    try:
        return plan_json(["--recipe", f.name])
    finally:
        os.unlink(f.name)


def saved_seq_exponents(argv):
    """Per spec (transformer-engine target, local with torch's attention, local with megatron's unfused
    attention), the largest exponent in sequence length among the storages one dense layer saves for
    backward (2: something of size s x s is kept), that layer's saved bytes at the run's shape, and
    whether torch attention's kernel was given a mask."""
    import contextlib
    import io

    import arguments

    from megatron_ext.attention import kernels
    from megatron_ext.planner import trace as tr

    masks = []  # per call of torch attention's kernel: was it given a mask (on CUDA: flex_attention)?
    attend = kernels.attend

    def spy(*a, **k):
        masks.append(k.get("mask") is not None)
        return attend(*a, **k)

    out = {}
    for name, impl, assume, extra in (("transformer_engine", "transformer_engine", "--assume-te", ()),
                                      ("local", "local", "--assume-no-te", ()),
                                      ("local_unfused", "local", "--assume-no-te", ("--attention-backend", "unfused"))):
        with contextlib.redirect_stdout(io.StringIO()):
            args = arguments.parse([*argv, "--transformer-impl", impl, "--platform", "cuda", assume, *extra,
                                    "--dry-run"], exit_on_dry_run=False)
        masks.clear()
        kernels.attend = spy
        try:
            t = tr.trace(args)
        finally:
            kernels.attend = attend
        s = tr.scaled(args, t)
        comp = s.kind("dense")
        exps = [t["exps"][k].get("seq", 0.0) for k, (c, _module, _gemm) in t["raw"]["saved"].items() if c == comp]
        out[name] = dict(max_seq_exponent=max(exps), saved=s.saved[comp], masks=sorted(set(masks)))
    return out


def published_throughput():
    """(case, predicted tokens/s/GPU, published) for every published run: the step time as given
    (no trace needed: its terms do not depend on the activations)."""
    import arguments

    from megatron_ext.planner import published

    return [(r["case"], r["predicted_tokens_per_s_per_gpu"], r["published_tokens_per_s_per_gpu"])
            for r in published.throughput(lambda argv: published.parse(argv, arguments.parse))]


def plan_as_given(argv):
    """The plan of the run as given only (one trace): its --json as_given and stages."""
    import arguments

    from megatron_ext.planner import cli, search

    opts, args, _ = cli.parse(argv, "--", arguments.parse)
    result = search.plan(args, gpu=opts.gpu, memory_gb=opts.memory_gb, recomputes=())
    return dict(as_given=cli.as_given_json(result["as_given"]), first=result["candidates"][0].as_given,
                chunks=[ch["activations_per_microbatch"] for ch in result["stages"][0]["chunks"]])


def published_plan(name):
    """The plan of one published run (the search without recompute: one trace), as --json has it,
    with the published figures."""
    import arguments

    from megatron_ext.planner import cli, published, search

    c = published.CASES[name]
    opts, args, _ = cli.parse([*c["argv"], "--gpu", c["gpu"]], "--", arguments.parse)
    result = search.plan(args, gpu=opts.gpu, recomputes=("none",))
    report = dict(as_given=cli.as_given_json(result["as_given"]),
                  candidates=[dict(flags=x.flags, as_given=x.as_given, fits=x.fits) for x in result["candidates"]])
    return dict(report=report, published=dict(peak_gib=c["peak_gib"], tokens_per_s_per_gpu=c["tokens_per_s_per_gpu"]))


def fp8_saved(argv):
    """One dense layer on a transformer-engine target, traced once: what it saves for backward as
    given and with --fp8-format hybrid, the bytes the trace marked as saved layer-linear inputs (only
    as such / also kept by something else), and the expected ones from the shape (per token: the
    two normed inputs of QKV and FC1, the activation output into FC2; attention's output into the
    projection, which the fused attention keeps too)."""
    import contextlib
    import io

    import arguments

    from megatron_ext.planner import trace as tr

    parsed = {}
    for name, extra in (("bf16", []), ("fp8", ["--fp8-format", "hybrid"])):
        with contextlib.redirect_stdout(io.StringIO()):
            parsed[name] = arguments.parse([*argv, "--transformer-impl", "transformer_engine", "--platform", "cuda",
                                            "--assume-te", *extra, "--dry-run"], exit_on_dry_run=False)
    t = tr.trace(parsed["bf16"])
    out = {}
    for name, args in parsed.items():
        s = tr.scaled(args, t)
        comp = s.kind("dense")
        out[name] = dict(saved=s.saved[comp], only=s.gemm_inputs[comp], shared=s.gemm_inputs_shared[comp],
                         gemm_weights=s.gemm_weights[comp])
    a = parsed["bf16"]
    tokens = a.seq_length * a.micro_batch_size
    elem = 2 if (a.bf16 or a.fp16) else 4
    out["expected"] = dict(only=tokens * (2 * a.hidden_size + a.ffn_hidden_size) * elem,
                           shared=tokens * a.num_attention_heads * a.kv_channels * elem, elem=elem)
    return out
