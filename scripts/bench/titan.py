"""torchtitan's Llama-3 training step at a given depth, timed on this GPU: the peer a user would pick for
a PyTorch-native trainer, measured beside this project's loop by gpu_check's throughput section (which
runs this file in a process of its own where torchtitan is installed) or alone:

    python3 scripts/bench/titan.py --layers 8 [--seq 8192] [--batch 1] [--steps 5] [--compile] [--json FILE]

The model is torchtitan's own Llama-3 8B (``llama3_configs["8B"]``: hidden 4096, FFN 14336 SwiGLU, 32 heads
in 8 KV groups, RoPE, vocabulary 128256) cut to ``--layers``, in its own recipe's form (its 8B recipe,
``config_registry.llama3_8b``): its chunked cross-entropy loss, AdamW (``default_adamw``), fp32 weights
under FSDP2's bf16 mixed precision, flex attention with a block-causal mask; activation checkpointing off
(this project's loop recomputes nothing either). Its data and tokenizer are the one thing replaced: its
recipe reads C4 and the Llama-3 tokenizer from the Hugging Face hub, which a GPU machine without a network
cannot reach; here a loader of random tokens with one document per row (``RandomTokens``).

What runs is its ``Trainer``: built from that config, stepped by its own ``train_step`` (forward and
backward, CUDA graphs as its default, gradient clipping, the optimizer and LR scheduler steps) with the
per-step work of its ``train()`` loop. Where it cannot run, the run says why (its exception and the end
of its traceback). No smaller loop stands in for it: its model's own training setup
(``Decoder.Config.update_from_config``) imports its ``trainer.py``, so where the Trainer cannot be
imported (its ``trainer.py`` imports ``datasets`` for its HF data loaders: scripts/gpu_run.sh carries it)
its model cannot be set up for training either. Its Trainer needs CUDA (it sets the CUDA device first).

torchtitan is not a dependency of this project: it is carried to a GPU machine as a wheel with
``--no-deps`` (scripts/gpu_run.sh). On a machine where it does not import (on CPU its model package needs
triton), every run reads "skipped: torchtitan not importable (...)". Prints a table; ``--json`` writes
{"runs": [...]}, each with step times in seconds (``step_s``), losses, peak bytes."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
import traceback

import torch


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _components():
    """torchtitan's classes this adapter builds on; ImportError where torchtitan does not import."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer
    from dataclasses import dataclass

    class RandomTokens(BaseDataLoader):
        """Batches as torchtitan's text loaders yield them: ({"input", "positions"}, labels), random
        tokens, one document per row (its block-causal mask is then the causal one)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 128256
            seed: int = 1234

        def __init__(self, config, *, seq_len: int, local_batch_size: int, **kwargs):
            self.config, self.seq_len, self.batch = config, seq_len, local_batch_size
            self.generator = torch.Generator().manual_seed(config.seed)

        def __iter__(self):
            positions = torch.arange(self.seq_len).expand(self.batch, -1)
            while True:
                tokens = torch.randint(0, self.config.vocab_size, (self.batch, self.seq_len + 1), generator=self.generator)
                yield {"input": tokens[:, :-1], "positions": positions.clone()}, tokens[:, 1:]

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    class NoTokenizer(BaseTokenizer):
        """The loader above makes token ids itself: the Trainer builds a tokenizer and never uses it."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config=None, **kwargs):
            super().__init__()

        def encode(self, *args, **kwargs):
            raise NotImplementedError

        def decode(self, *args, **kwargs):
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return 0

    return RandomTokens, NoTokenizer


def model_spec(flavor: str, layers: int, attn: str):
    """torchtitan's own Llama-3 ``flavor`` (its model registry) with its first ``layers`` layers."""
    from torchtitan.models.llama3 import model_registry

    spec = model_registry(flavor, attn_backend=attn)
    spec.model.layers = spec.model.layers[:layers]
    return spec


def trainer_config(a, dump_folder: str):
    """Its 8B recipe's Trainer.Config at this depth, data and tokenizer replaced (see the docstring)."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.trainer import Trainer

    RandomTokens, NoTokenizer = _components()
    spec = model_spec(a.flavor, a.layers, a.attn)
    vocab = spec.model.vocab_size
    return Trainer, Trainer.Config(
        model_spec=spec,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)),
        optimizer=default_adamw(lr=3e-4),
        training=TrainingConfig(local_batch_size=a.batch, seq_len=a.seq, steps=a.warmup + a.steps + 1),
        dataloader=RandomTokens.Config(vocab_size=vocab),
        tokenizer=NoTokenizer.Config(),
        metrics=MetricsProcessor.Config(log_freq=1),
        activation_checkpoint=None,
        compile=CompileConfig(enable=a.compile),
        dump_folder=dump_folder,
        hf_assets_path=dump_folder,
    )


def run_trainer(a) -> dict:
    """Its Trainer, stepped as its train() steps it; per-step wall time (synchronised)."""
    with tempfile.TemporaryDirectory(prefix="titan_") as tmp:
        Trainer, config = trainer_config(a, tmp)
        trainer = Trainer(config)
        losses = []
        log = trainer.metrics_processor.log

        def logged(step, global_avg_loss, *rest, **kw):  # its own loss, as its logger receives it
            losses.append(float(global_avg_loss))
            return log(step, global_avg_loss, *rest, **kw)

        trainer.metrics_processor.log = logged
        data = trainer.batch_generator(trainer.dataloader)
        times = []
        try:
            for _ in range(a.warmup + a.steps):
                trainer.step += 1
                trainer.gc_handler.run(trainer.step)
                _sync()
                t = time.perf_counter()
                trainer.train_step(data)
                _sync()
                times.append(time.perf_counter() - t)
                if trainer.step == a.warmup and torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
            params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
        finally:
            trainer.close()
        return {"ran": "its Trainer.train_step", "parameters": params, "step_s": times[a.warmup:], "losses": losses}


@contextlib.contextmanager
def one_process_world():
    """torchrun's environment for a world of one (torchtitan initialises its process group from it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure(a) -> dict:
    """One run of its Trainer; where it cannot run, why (its exception and traceback's end)."""
    mode = "compiled" if a.compile else "eager"
    out = {"mode": mode, "attention": a.attn, "flavor": a.flavor, "layers": a.layers, "seq": a.seq, "batch": a.batch}
    try:
        import torchtitan  # noqa: F401
        from torchtitan.models.llama3 import model_registry  # noqa: F401
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return dict(out, status=f"skipped: torchtitan not importable ({type(e).__name__}: {str(e)[:200]})")
    out["torchtitan"] = _version()
    with one_process_world():
        try:
            got = run_trainer(a)
        except Exception as e:  # noqa: BLE001 - why its Trainer cannot run here is the result
            first = str(e).splitlines()[0][:300] if str(e) else ""
            return dict(out, status=f"error: its Trainer cannot run here: {type(e).__name__}: {first}",
                        traceback=traceback.format_exc()[-3000:])
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return dict(out, status="ok", peak_bytes=peak, **got)


def _version():
    try:
        from importlib.metadata import version

        return version("torchtitan")
    except Exception:  # noqa: BLE001
        return None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="8B", help="torchtitan's Llama-3 flavor (8B; debugmodel for a tiny run)")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--attn", default="flex", help="its attention backend (flex: its recipe's; flex_flash on Hopper)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="its torch.compile of every block and the loss")
    ap.add_argument("--json", default=None)
    # gpu_check passes the shape it measured ours at: checked against the flavor's own
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    run = measure(a)
    if run["status"] == "ok":
        run["shape_matches"] = _shape_matches(a)
        if run["shape_matches"] is not True:
            run["status"] = f"error: {run['shape_matches']}"
    print(f"| torchtitan | layers | seq | status | step ms (median) | tokens/s |\n|---|---|---|---|---|---|\n"
          f"| {run['mode']} | {a.layers} | {a.seq} | {run['status']} | "
          + (f"{1e3 * sorted(run['step_s'])[len(run['step_s']) // 2]:.1f} | "
             f"{a.batch * a.seq / sorted(run['step_s'])[len(run['step_s']) // 2]:.0f} |"
             if run["status"] == "ok" else "- | - |"), file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": [run]}, f, default=str)
    return 0 if run["status"] == "ok" or run["status"].startswith("skipped") else 1


def _shape_matches(a):
    """True, or what differs between the flavor's model and the shape asked for."""
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry(a.flavor).model
    attention = cfg.layers[0].attention
    got = {"hidden": cfg.dim, "vocab": cfg.vocab_size, "heads": getattr(attention, "n_heads", None),
           "kv_heads": getattr(attention, "n_kv_heads", None),
           "ffn": cfg.layers[0].feed_forward.w1.out_features}
    asked = {"hidden": a.hidden, "vocab": a.vocab, "heads": a.heads, "kv_heads": a.kv_heads, "ffn": a.ffn}
    differ = {k: (v, got[k]) for k, v in asked.items() if v is not None and got[k] is not None and got[k] != v}
    return True if not differ else "shape differs (asked, torchtitan's): " + ", ".join(f"{k} {v}" for k, v in differ.items())


if __name__ == "__main__":
    sys.exit(main())
