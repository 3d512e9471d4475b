"""Jobs for the SFT tests, run on every rank of a persistent gloo world (tests/dist.py)."""
from __future__ import annotations

import arguments


def packed_rows(argv: list[str], windowed: list[str]) -> dict:
    """On the model megatron-core builds (local spec): a packed row's logits against each of its
    conversations run alone, the padding's tokens changed, the causal mask of an unpacked row as the
    negative control; the same with a sliding window (`windowed` flags); and a resumed run's data
    iterator against an uninterrupted one's."""
    import contextlib
    import io

    from megatron_ext.training import data
    from megatron_ext.training.run import Run

    out = {}
    for name, extra in (("plain", []), ("window", windowed)):
        with contextlib.redirect_stdout(io.StringIO()):
            run = Run.from_argv(argv + extra, exit_on_dry_run=False, parse=arguments.parse)
        with run:
            model = run.build(wrap=False)[0]
            model.eval()
            with contextlib.redirect_stdout(io.StringIO()):
                train = data.build_datasets(run.args)[0]
            out[name] = _compare(model, train)
            if name == "plain":
                out["resume"] = _resume_reads_the_same(run.args)
    return out


def _spans(row) -> list:
    ends = [int(e) for e in row["cu_seqlens"].unique()]
    return list(zip(ends, ends[1:]))


def _compare(model, dataset) -> dict:
    import torch

    from megatron_ext.sft.attention import packed_inputs

    # a row of at least two conversations, then padding (its last segment is not a conversation: no loss)
    row = next(r for r in map(dataset.__getitem__, range(len(dataset.rows)))  # epoch 0: every row
               if len(_spans(r)) >= 3 and not r["loss_mask"][_spans(r)[-1][0]:].any()
               and len(set(r["tokens"][_spans(r)[-1][0]:].tolist())) == 1)
    batch = {k: v.unsqueeze(0) for k, v in row.items()}
    spans = _spans(row)
    conversations, padding = spans[:-1], spans[-1]
    with torch.no_grad():
        inputs, packed = packed_inputs(batch, model, "cpu")
        logits = model(inputs["tokens"], inputs["position_ids"], inputs["attention_mask"], **packed)[0]
        alone = [model(row["tokens"][a:b][None], torch.arange(b - a)[None], None)[0] for a, b in conversations]
        changed = dict(inputs, tokens=inputs["tokens"].clone())
        changed["tokens"][0, padding[0]:] = (changed["tokens"][0, padding[0]:] + 7) % 300
        repadded = model(changed["tokens"], changed["position_ids"], changed["attention_mask"])[0]
        causal = torch.ones(1, 1, len(row["tokens"]), len(row["tokens"]), dtype=torch.bool).triu(1)
        unpacked = model(inputs["tokens"], inputs["position_ids"], causal)[0]
    real = slice(0, padding[0])
    return {
        "conversations": len(conversations),
        "max_abs_diff_alone": max(float((logits[a:b] - x).abs().max()) for (a, b), x in zip(conversations, alone)),
        "logit_scale": float(logits[real].abs().max()),
        "padding_changes_real_logits": bool((repadded[real] != logits[real]).any()),
        "padding_in_loss": float(row["loss_mask"][padding[0]:].sum()),
        "positions_restart": all(row["position_ids"][a:b].tolist() == list(range(b - a)) for a, b in spans),
        "unpacked_max_abs_diff": float((unpacked[conversations[1][0]:conversations[1][1]]
                                        - alone[1]).abs().max()),
    }


def _resume_reads_the_same(args) -> bool:
    """Iterators positioned after 3 iterations give the batches an uninterrupted run reads then."""
    import torch

    from megatron_ext.training import data

    import contextlib
    import io

    per_iteration = args.global_batch_size // args.micro_batch_size
    with contextlib.redirect_stdout(io.StringIO()):
        fresh = data.build_iterators(args, 1, iteration=0)
        resumed = data.build_iterators(args, 1, iteration=3)
    for _ in range(3 * per_iteration):
        next(fresh.train[0])
    same = True
    for _ in range(per_iteration):
        a, b = next(fresh.train[0]), next(resumed.train[0])
        same = same and all(torch.equal(a[k], b[k]) for k in a)
    return same
