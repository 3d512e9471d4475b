"""Job functions for the LoRA tests (run on every rank of a gloo world, see tests/dist.py)."""
from __future__ import annotations

import arguments


def _adapter_pieces(chunks) -> list:
    """(key, global shape, global offset, prepended axes, value, gradient) of every adapter factor this
    rank holds, from the model's own checkpoint entries (global keys and offsets)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_ext.lora import adapters
    from megatron_ext.seams import unwrapped

    pieces = []
    for chunk in chunks:
        model = unwrapped(chunk)
        for sh in adapters._adapter_tensors(model.sharded_state_dict()):
            if not isinstance(sh, ShardedTensor):
                continue
            grad = getattr(sh.data, "main_grad", None)
            pieces.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), sh.prepend_axis_num,
                           sh.data.detach().float().cpu().clone(),
                           None if grad is None else grad.detach().float().cpu().clone()))
    return pieces


def _assemble(pieces_per_rank: list) -> tuple[dict, dict]:
    """The full (global) adapter factors and their gradients from every rank's pieces."""
    import torch

    values, grads = {}, {}
    for pieces in pieces_per_rank:
        for key, shape, offset, prepend, value, grad in pieces:
            for out, t in ((values, value), (grads, grad)):
                if t is None:
                    continue
                full = out.setdefault(key, torch.full(shape, float("nan")))
                index = tuple(slice(o, o + (1 if axis < prepend else t.shape[axis - prepend]))
                              for axis, o in enumerate(offset))
                full[index] = t.reshape(full[index].shape)
    return values, grads


def _collect(chunks) -> tuple[dict, dict]:
    """Every rank's adapter factors and gradients, assembled (a collective: every rank calls)."""
    import torch

    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, _adapter_pieces(chunks))
    return _assemble(gathered)


def _numpy(tensors: dict) -> dict:
    """Tensors go back to the test process as numpy arrays: a pickled torch tensor is shared through a
    file descriptor, whose server thread would outlive the job (tests/dist.py's leak check)."""
    return {k: v.numpy() for k, v in tensors.items()}


def train_adapters(argv: list[str]) -> dict:
    """The training loop; its log history, and the full adapter factors and last gradients (every
    rank), as numpy arrays."""
    from megatron_ext.training.run import Run

    values, grads = {}, {}
    with Run.from_argv(list(argv), parse=arguments.parse) as run:
        history = run.train()
        if "--use-megatron-fsdp" not in argv:  # its parameters are DTensor shards: the losses say it
            values, grads = _collect(run.model)
    return dict(history=history, values=_numpy(values), grads=_numpy(grads))


def train_adapters_many(argvs: dict) -> dict:
    """train_adapters for several runs in one job: {name: result}."""
    return {name: train_adapters(list(argv)) for name, argv in argvs.items()}


def _run(argv: list[str]) -> dict:
    """train_adapters, or the one-line refusal it stopped with."""
    from megatron_ext.errors import ConfigError

    try:
        return train_adapters(argv)
    except ConfigError as e:
        return {"error": str(e)}


def checkpoint_story(base_argv: list[str], lora_argv: list[str], root: str) -> dict:
    """Every way a LoRA run meets checkpoints, in one job (results keyed by step):
    base      a full run saves the base (no LoRA)
    full_pretrained / full_finetune  without LoRA: --pretrained-checkpoint base with an empty --load
              (it saves another base, one iteration on), and --finetune --load base
    pretrained  LoRA with --pretrained-checkpoint base and --load = --save a new directory, 4 iterations
    first / resumed  LoRA from the base by --finetune --load base, saving at 2 and stopping; then
              resuming from the adapter checkpoint alone (its base found from its record)
    finetuned   --finetune --load of the adapter checkpoint, no training: the adapters it loads
    refused_*   the adapter checkpoint without LoRA, with another rank, on another base"""
    import math
    import os

    from megatron.core import dist_checkpointing

    from megatron_ext.checkpoint import dirs as ckpt_dirs
    from megatron_ext.checkpoint import lora as ckpt_lora

    base, other, adapters, pre = (os.path.join(root, n) for n in ("base", "full", "adapters", "pretrained"))
    out = {}
    out["base"] = _run(base_argv + ["--train-iters", "2", "--save", base])
    out["full_pretrained"] = _run(base_argv + ["--train-iters", "1", "--pretrained-checkpoint", base, "--load", other,
                                               "--save", other])
    out["full_finetune"] = _run(base_argv + ["--train-iters", "1", "--finetune", "--load", base])
    lora = base_argv + lora_argv
    out["first"] = _run(lora + ["--train-iters", "4", "--finetune", "--load", base, "--save", adapters,
                                "--save-interval", "2", "--exit-interval", "2"])
    out["resumed"] = _run(lora + ["--train-iters", "4", "--load", adapters, "--save", adapters])
    out["pretrained"] = _run(lora + ["--train-iters", "4", "--pretrained-checkpoint", base, "--load", pre,
                                     "--save", pre])
    out["finetuned"] = _run(lora + ["--train-iters", "4", "--finetune", "--load", adapters, "--skip-train"])
    out["refused_no_lora"] = _run(base_argv + ["--train-iters", "4", "--load", adapters])
    rank = lora_argv.index("--lora-rank") + 1
    other_rank = lora_argv[:rank] + ["4"] + lora_argv[rank + 1:]
    out["refused_rank"] = _run(base_argv + other_rank + ["--train-iters", "4", "--load", adapters])
    out["refused_base"] = _run(lora + ["--train-iters", "4", "--load", adapters, "--pretrained-checkpoint", other])
    saved = ckpt_dirs.checkpoint_dir(adapters, 4)
    metadata = dist_checkpointing.load_tensors_metadata(saved)
    out["keys"] = sorted(metadata)
    out["model_numel"] = sum(math.prod(t.global_shape) for k, t in metadata.items() if not k.startswith("optimizer"))
    out["record"] = dist_checkpointing.load_common_state_dict(saved)["lora"]
    out["base_identity"] = {"path": base, "iteration": 2,
                            "checksum": ckpt_lora.identity(ckpt_dirs.checkpoint_dir(base, 2))}
    return out


def frozen_state(argv: list[str]) -> dict:
    """The training loop; the last log line's state bytes, and what holds a gradient or optimizer state when
    it is taken: the parameters (adapter factors or not) that require or have a gradient, the
    parameters in DDP's gradient buffers, the numel of the optimizer's state tensors."""
    from megatron_ext.seams import unwrapped
    from megatron_ext.training import log_line
    from train import main as train_main

    seen: dict = {}
    state_bytes = log_line.state_bytes

    def record(model, optimizer):
        named = [(n, p) for c in model for n, p in unwrapped(c).named_parameters()]
        adapter = {id(p) for n, p in named if ".lora." in n}
        routed = {id(p) for n, p in named if not getattr(p, "allreduce", True)}  # reduced over expert DP
        seen.update(
            adapter_numel=sum(p.numel() for n, p in named if id(p) in adapter),
            base_numel=sum(p.numel() for n, p in named if id(p) not in adapter),
            routed_adapter_numel=sum(p.numel() for n, p in named if id(p) in adapter and id(p) in routed),
            routed_base_numel=sum(p.numel() for n, p in named if id(p) not in adapter and id(p) in routed),
            trainable_not_adapter=[n for n, p in named if p.requires_grad and id(p) not in adapter],
            base_with_grad=[n for n, p in named if id(p) not in adapter and (
                getattr(p, "main_grad", None) is not None or p.grad is not None)],
            buffered=sorted(n for n, p in named if any(p is q for c in model for buf in log_line._ddp_buffers(c)
                                                       for q in buf.params)),
            adapter_names=sorted(n for n, p in named if id(p) in adapter),
            optimizer_state_numel=sum(v.numel() for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                                      for st in opt.optimizer.state.values() for v in st.values()
                                      if hasattr(v, "dim") and v.dim() > 0),
        )
        return state_bytes(model, optimizer)

    log_line.state_bytes = record
    try:
        history = train_main(list(argv))
    finally:
        log_line.state_bytes = state_bytes
    last = history[-1] if history else {}
    return dict(seen, bytes={k: last.get(k) for k in ("param bytes", "grad bytes", "optim bytes")})


def frozen_states(argvs: dict) -> dict:
    return {name: frozen_state(list(argv)) for name, argv in argvs.items()}


def per_layer(stacked: dict) -> dict:
    """Checkpoint keys stack a block's layers on a leading axis (``decoder.layers.X`` [layers, ...]):
    one entry per layer, named as the model names it (``decoder.layers.<i>.X``)."""
    out = {}
    for key, value in stacked.items():
        rest = key.removeprefix("decoder.layers.")
        if rest == key or rest.split(".", 1)[0].isdigit():
            out[key] = value
        else:
            out.update({f"decoder.layers.{i}.{rest}": v for i, v in enumerate(value)})
    return out


def one_lora_step(hf_dir: str, ckpt: str, argv: list[str]) -> dict:
    """One LoRA step of ours on the import of ``hf_dir`` (into ``ckpt``, as scripts/convert.py import
    does), B set to random values first (so that A has a gradient too): the factors it ran with and
    their gradients (per layer, as numpy arrays), its loss and its batch. (peft runs in the test
    process: transformers' loading leaves threads a pool worker may not keep.)"""
    import torch

    from megatron_ext import hf
    from megatron_ext.lora import adapters
    from megatron_ext.training import step

    hf.import_hf(hf_dir, ckpt, parse=arguments.parse)
    draw, forward_step, batches = adapters.init_adapters, step.forward_step, []

    def init_with_random_b(chunks, seed):
        count = draw(chunks, seed)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for chunk in chunks:
                for name, p in chunk.named_parameters():
                    if name.endswith("lora_B.weight"):
                        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.05)
        return count

    def recording(data_iterator, model, *a, **k):
        def it():
            batch = next(data_iterator)
            batches.append({key: v.clone().numpy() for key, v in batch.items() if v is not None})
            yield batch

        return forward_step(it(), model, *a, **k)

    adapters.init_adapters, step.forward_step = init_with_random_b, recording
    try:
        ours = train_adapters([*argv, "--load", ckpt, "--finetune", "--recipe", f"{ckpt}/recipe.yaml"])
    finally:
        adapters.init_adapters, step.forward_step = draw, forward_step
    (batch,) = batches
    return dict(values=per_layer(ours["values"]), grads=per_layer(ours["grads"]), batch=batch,
                loss=ours["history"][0]["lm loss"])
