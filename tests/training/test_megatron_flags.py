"""Megatron flags that must do what they do in pretrain_gpt.py (or be refused by name), one test per
family: sample-based training, validation/test, exit conditions and manual gc, log-line extras
(--log-throughput, MoE aux losses, --moe-per-layer-logging), W&B, --num-workers,
--calculate-per-token-loss, --mtp-num-layers, and the refused ones."""
from __future__ import annotations

import math
import os
import random
import re

import pytest

import arguments
from megatron_ext.errors import ConfigError
from tests.dist import run_distributed

DENSE = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data", "--log-interval", "1", "--layout-invariant-init"]
MOE = ["--recipe", "recipes/tiny_moe.yaml", "--log-interval", "1", "--train-iters", "2", "--lr-warmup-iters", "1"]


def run(world: int, argv: list[str], job: str = "train_capture", **kw) -> list:
    return run_distributed(world, f"tests.training.jobs_flags:{job}", argv=argv + ["--world-size", str(world)], **kw)


def losses(history: list[dict]) -> list[float]:
    return [r["lm loss"] for r in history]


# --- sample-based training --------------------------------------------------------------------
def test_sample_based_training_is_the_iteration_schedule_in_samples():
    """--train-samples 40 --lr-decay-samples 32 --lr-warmup-samples 8 at global batch 8 is megatron's
    5 iterations with decay over 4 and warm-up over 1: the same learning rates and losses, bit for bit."""
    samples = run(1, DENSE + ["--train-samples", "40", "--lr-decay-samples", "32", "--lr-warmup-samples", "8"])[0]
    iters = run(1, DENSE + ["--train-iters", "5", "--lr-decay-iters", "4", "--lr-warmup-iters", "1"])[0]
    got, want = samples["history"], iters["history"]
    assert [r["iteration"] for r in got] == [1, 2, 3, 4, 5]
    assert [r["learning rate"] for r in got] == [r["learning rate"] for r in want]
    assert losses(got) == losses(want)
    assert "/       5 |" in samples["stdout"]  # the log line counts the derived iterations
    # and the learning rates are megatron's scheduler's, stepped by the global batch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Opt:
        param_groups = [{}]

    ref = OptimizerParamScheduler(Opt(), init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=8, lr_decay_steps=32,
                                  lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=40,
                                  wd_incr_style="constant")
    expected = []
    for _ in range(5):
        ref.step(increment=8)
        expected.append(Opt.param_groups[0]["lr"])
    assert [r["learning rate"] for r in got] == pytest.approx(expected, rel=1e-12)


def test_sample_based_flags_checked_before_compute():
    base = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data"]
    args = arguments.parse(base + ["--train-samples", "20"], exit_on_dry_run=False)
    assert args.train_iters == 2 and args.lr_warmup_iters == 0  # the recipe's iteration schedule gives way
    with pytest.raises(ConfigError, match=r"--lr-warmup-samples=16 must be below the decay length --train-samples=16"):
        arguments.parse(base + ["--train-samples", "16", "--lr-warmup-samples", "16"], exit_on_dry_run=False)
    with pytest.raises(ConfigError, match=r"--rampup-batch-size"):
        arguments.parse(base + ["--rampup-batch-size", "4", "4", "16"], exit_on_dry_run=False)


# --- validation and test ----------------------------------------------------------------------
VALID = re.compile(r" validation loss at (iteration \d+(?: on \w+ set)?) \(([^)]*)\) \| lm loss value: (\S+) \| "
                   r"lm loss PPL: (\S+) \|")


def _validation(stdout: str) -> dict:
    return {m.group(1): float(m.group(3)) for m in VALID.finditer(stdout)}


def _what(stdout: str) -> dict:
    return {m.group(1): m.group(2) for m in VALID.finditer(stdout)}


def test_validation_and_test_as_pretrain_gpt():
    argv = ["--recipe", "recipes/tiny_dense.yaml", "--train-iters", "4", "--log-interval", "100", "--lr-warmup-iters",
            "1", "--split", "90,5,5", "--eval-interval", "2", "--eval-iters", "2", "--layout-invariant-init"]
    one = run(1, argv)[0]
    two = run(2, argv)  # DP2: each rank evaluates half the batch; megatron's reduction makes it the same loss
    v1, v2 = _validation(one["stdout"]), _validation(two[-1]["stdout"])
    assert list(v1) == ["iteration 2", "iteration 4", "iteration 4 on validation set", "iteration 4 on test set"]
    # each line says what it evaluated: iteration 4's two validation losses are other samples
    # (--eval-iters 2 x global batch 8 each; the test split from its start)
    assert _what(one["stdout"]) == {
        "iteration 2": "at --eval-interval 2: validation samples 0-15",
        "iteration 4": "at --eval-interval 2: validation samples 16-31",
        "iteration 4 on validation set": "after training: validation samples 32-47",
        "iteration 4 on test set": "after training: test samples 0-15"}
    assert all(math.isfinite(x) for x in v1.values())
    assert v1["iteration 4"] < v1["iteration 2"]  # it learns
    assert v1["iteration 4 on test set"] != v1["iteration 4 on validation set"]  # another split
    assert list(v2) == list(v1) and all(math.isclose(v1[k], v2[k], rel_tol=1e-5) for k in v1)
    assert _validation(two[0]["stdout"]) == {}  # printed once, by the last rank
    # a later evaluation reads the next validation batches, not the first ones again
    assert not math.isclose(v1["iteration 4"], v1["iteration 4 on validation set"], rel_tol=1e-9)
    # --eval-iters 0: no evaluation at all
    off = run(1, argv[:-5] + ["--eval-interval", "2", "--eval-iters", "0"])[0]
    assert _validation(off["stdout"]) == {}


def test_empty_split_refused_by_name(tmp_path):
    """megatron's GPTDataset would loop forever on a split with no document; refused at parse time."""
    from scripts import prepare_data

    for i in range(3):
        (tmp_path / f"{i}.txt").write_text("some text " * 20)
    prefix = prepare_data.main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "three")])["prefix"]
    argv = ["--recipe", "recipes/tiny_dense.yaml", "--data-path", prefix, "--split", "90,5,5", "--eval-interval", "2",
            "--eval-iters", "1"]
    with pytest.raises(ConfigError, match=r"--split=90,5,5: the validation split of .*three_text_document "
                                          r"\(3 documents\) holds no document, but 408 validation samples"):
        arguments.parse(argv, exit_on_dry_run=False)


# --- exit conditions and garbage collection ---------------------------------------------------
def test_exit_signal_handler_stops_every_rank_and_saves(tmp_path):
    argv = DENSE + ["--train-iters", "6", "--lr-warmup-iters", "1", "--exit-signal-handler", "--save", str(tmp_path),
                    "--save-interval", "100"]
    out = run(2, argv, job="train_with_signal", at=2)
    assert [o["iterations"] for o in out] == [[1, 2], [1, 2]]  # SIGTERM on rank 0 only; both stop
    assert all(o["handler_restored"] for o in out)
    assert os.path.isdir(tmp_path / "iter_0000002")
    # without --exit-signal-handler SIGTERM keeps its meaning: not exercised (it would end the worker)


def test_exit_duration_in_mins():
    argv = DENSE + ["--train-iters", "4", "--lr-warmup-iters", "1", "--exit-duration-in-mins", "1"]
    assert run(2, argv, job="train_started_minutes_ago", minutes=2) == [[1], [1]]
    assert run(2, argv, job="train_started_minutes_ago", minutes=0) == [[1, 2, 3, 4], [1, 2, 3, 4]]


def test_manual_gc():
    argv = DENSE + ["--train-iters", "4", "--lr-warmup-iters", "1"]
    manual = run(1, argv + ["--manual-gc", "--manual-gc-interval", "2"], job="train_watching_gc")[0]
    assert manual["enabled_during"] == [False] * 4 and manual["enabled_after"]
    assert manual["full_collections"] == 3  # at the start, after iterations 2 and 4
    auto = run(1, argv, job="train_watching_gc")[0]
    assert auto["enabled_during"] == [True] * 4


# --- the log line: throughput, MoE auxiliary losses, per-layer logging ------------------------
def _tags(logdir) -> set:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return set(acc.Tags()["scalars"])


def test_log_line_throughput_moe_losses_and_per_layer_logging(tmp_path):
    on = run(1, MOE + ["--log-throughput", "--moe-per-layer-logging", "--log-timers-to-tensorboard",
                       "--log-num-zeros-in-grad", "--log-params-norm", "--tensorboard-dir", str(tmp_path / "on")])[0]
    off = run(1, MOE + ["--tensorboard-dir", str(tmp_path / "off")])[0]
    line = on["stdout"].splitlines()
    assert re.search(r"throughput per GPU \(TFLOP/s/GPU\): \d+\.\d \|", on["stdout"])
    assert "throughput per GPU" not in off["stdout"]
    # megatron's grad norm | num zeros | params norm, on every line of the run that asks for them
    assert len(re.findall(r"grad norm: \d+\.\d{3} \| num zeros: \d+ \| params norm: \d+\.\d{3} \|", on["stdout"])) == 2
    assert "num zeros" not in off["stdout"] and "params norm" not in off["stdout"]
    assert {"iteration-time", "throughput", "params norm", "num zeros"} <= _tags(tmp_path / "on")
    assert not {"iteration-time", "throughput"} & _tags(tmp_path / "off")
    for out in (on, off):  # megatron's load-balancing loss joins every line
        assert all(r["load_balancing_loss"] > 0 for r in out["history"])
        assert re.search(r"load_balancing_loss: \d\.\d{6}E[+-]\d\d \|", out["stdout"]), line
    assert on["history"][0]["load_balancing_loss"] == off["history"][0]["load_balancing_loss"]
    per_layer = {f"moe/load_balancing_loss_layer_{i}" for i in range(4)}
    assert per_layer <= _tags(tmp_path / "on") and not per_layer & _tags(tmp_path / "off")
    assert "load_balancing_loss" in _tags(tmp_path / "off")


def test_z_loss_joins_the_log_line():
    out = run(1, MOE + ["--moe-z-loss-coeff", "1e-3"])[0]
    assert all(r["z_loss"] > 0 for r in out["history"]) and "z_loss: " in out["stdout"]


# --- W&B ----------------------------------------------------------------------------------------
def test_wandb_refused_by_name_where_not_installed():
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(ConfigError, match=r"--wandb-project=p: the wandb package is not installed"):
        arguments.parse(DENSE + ["--wandb-project", "p"], exit_on_dry_run=False)


def test_wandb_writer_as_megatron_sets_it_up(tmp_path):
    argv = DENSE + ["--train-iters", "2", "--lr-warmup-iters", "1", "--wandb-project", "proj", "--wandb-exp-name", "exp",
                    "--wandb-save-dir", str(tmp_path)]
    first, last = run(2, argv, job="train_with_fake_wandb")
    assert last["init"] == [{"project": "proj", "name": "exp", "dir": str(tmp_path)}] and last["finish"] == 1
    assert [step for step, _ in last["log"]] == [1, 2] and "lm loss" in last["log"][0][1]
    assert first == {"init": [], "log": [], "finish": 0}  # the last rank writes, as megatron


# --- data-loader workers ------------------------------------------------------------------------
def test_num_workers_honoured():
    """--num-workers N: megatron's loader reads in N worker processes (it was forced to 0), same data."""
    base = ["--recipe", "recipes/tiny_dense.yaml", "--train-iters", "3", "--lr-warmup-iters", "1", "--log-interval",
            "100", "--world-size", "1"]
    workers = run_distributed(1, "tests.training.jobs_flags:train_outside_daemon", argv=base + ["--num-workers", "2"])[0]
    inline = run_distributed(1, "tests.training.jobs_flags:train_outside_daemon", argv=base + ["--num-workers", "0"])[0]
    assert workers["children"] >= 2 and inline["children"] == 0
    assert workers["losses"] == inline["losses"] and all(math.isfinite(x) for x in workers["losses"])
    refused = run_distributed(1, "tests.training.jobs_flags:parse_error", argv=base + ["--num-workers", "2"])[0]
    assert refused.startswith("--num-workers=2: this is a daemonic process")


# --- per-token loss -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """Byte-level documents of 5..60 bytes: every sequence holds several end-of-document tokens, so
    --eod-mask-loss leaves micro-batches with different token counts."""
    from scripts import prepare_data

    root = tmp_path_factory.mktemp("short")
    rng = random.Random(0)
    for i in range(400):
        (root / f"{i:03d}.txt").write_text("".join(rng.choice("abcdefgh \n") for _ in range(rng.randint(5, 60))))
    prepare_data.main(["--input", str(root), "--output-prefix", str(root / "short")])
    return str(root / "short_text_document")


def test_calculate_per_token_loss(short_documents, tmp_path):
    argv = ["--recipe", "recipes/tiny_dense.yaml", "--data-path", short_documents, "--eod-mask-loss", "--train-iters",
            "3", "--lr-warmup-iters", "1", "--log-interval", "100", "--layout-invariant-init", "--data-cache-path",
            str(tmp_path)]
    mean = losses(run(1, argv)[0]["history"])
    per_token = losses(run(1, argv + ["--calculate-per-token-loss"])[0]["history"])
    per_token_dp2 = losses(run(2, argv + ["--calculate-per-token-loss"])[-1]["history"])
    assert mean[0] == pytest.approx(per_token[0], rel=1e-6)  # same weights, same reported token mean
    assert per_token[1:] != pytest.approx(mean[1:], rel=1e-6)  # the gradients weigh tokens, not micro-batches
    assert per_token_dp2 == pytest.approx(per_token, rel=1e-5)  # summed over data-parallel ranks too


# --- multi-token prediction ---------------------------------------------------------------------
def test_mtp_num_layers_builds_and_logs_the_mtp_loss():
    out = run(1, DENSE + ["--train-iters", "2", "--lr-warmup-iters", "1", "--mtp-num-layers", "1"])[0]
    assert all(math.isfinite(r["lm loss"]) and math.isfinite(r["mtp_1 loss"]) for r in out["history"])
    assert "mtp_1 loss: " in out["stdout"]


# --- architecture flags megatron's config builder drops ---------------------------------------------
def test_yarn_flags_reach_multi_latent_attention():
    """MLA's yarn reads beta_fast / beta_slow / original_max_position_embeddings, which megatron's config
    builder never sets from --yarn-beta-fast / --yarn-beta-slow / --yarn-original-max-position-embeddings
    (Kimi-K2's beta_fast = beta_slow = 1): here they arrive; --no-yarn-correction-range-round-to-int,
    which MLA cannot honour, is refused by name."""
    from megatron_ext.training import model

    mla = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
           "--v-head-dim", "16", "--rope-type", "yarn", "--rotary-scaling-factor", "32", "--mscale", "1",
           "--mscale-all-dim", "1"]
    yarn = ["--yarn-beta-fast", "1", "--yarn-beta-slow", "0.5", "--yarn-original-max-position-embeddings", "2048"]
    config = model.transformer_config(arguments.parse(DENSE + mla + yarn, exit_on_dry_run=False))
    assert (config.beta_fast, config.beta_slow, config.original_max_position_embeddings) == (1.0, 0.5, 2048)
    config = model.transformer_config(arguments.parse(DENSE + mla, exit_on_dry_run=False))
    assert (config.beta_fast, config.beta_slow, config.original_max_position_embeddings) == (32, 1, 4096)
    with pytest.raises(ConfigError, match=r"^--no-yarn-correction-range-round-to-int with --multi-latent-attention"):
        arguments.parse(DENSE + mla + ["--no-yarn-correction-range-round-to-int"], exit_on_dry_run=False)


def test_llama3_rope_factors_are_transformers_llama3():
    """--rope-scaling-{low,high}-freq-factor / --rope-scaling-original-max-position-embeddings reach
    megatron-core's llama-3 scaling (which fixes them at 1 / 4 / 8192): with Llama-4-Scout's (factor
    16, high frequency factor 1) the rotary frequencies are transformers' own, bit for bit; without
    the seam they are not; without --use-rope-scaling the flags are refused by name."""
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_ext.seams import registry

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
    hf_config = LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_parameters=rope)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    flags = ["--use-rope-scaling", "--rope-scaling-factor", "16", "--rope-scaling-high-freq-factor", "1",
             "--rotary-base", "500000"]
    args = arguments.parse(DENSE + flags, exit_on_dry_run=False)

    def ours():
        return RotaryEmbedding(128, 1.0, rotary_base=500000, rope_scaling=True, rope_scaling_factor=16.0,
                               use_cpu_initialization=True).inv_freq

    assert not torch.equal(ours(), expected)  # megatron-core's fixed factors
    registry.install(args)
    try:
        assert torch.equal(ours(), expected)
    finally:
        registry.uninstall()
    with pytest.raises(ConfigError, match=r"^--rope-scaling-high-freq-factor=1.0 without --use-rope-scaling"):
        arguments.parse(DENSE + ["--rope-scaling-high-freq-factor", "1"], exit_on_dry_run=False)


# --- refused by name ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags,match",
    [
        (["--use-megatron-fsdp"], r"^--ckpt-format=torch_dist, --use-megatron-fsdp=True: .*fsdp_dtensor"),
        (["--use-torch-fsdp2", "--use-distributed-optimizer"], r"^--use-distributed-optimizer=True, --use-torch-fsdp2=True: "),
        (["--full-validation"], r"^--full-validation: not supported"),
        (["--step-batch-size-schedule", "0:8"], r"^--step-batch-size-schedule: batch-size schedules"),
        (["--qk-norm-skip-nope-layers", "--qk-l2-norm"], r"^--qk-norm-skip-nope-layers without --no-rope-freq"),
        (["--mla-q-proj-without-norm"], r"^--mla-q-proj-without-norm needs --multi-latent-attention with --qk-layernorm and no --q-lora-rank"),
    ],
)
def test_refused_by_name(flags, match):
    with pytest.raises(ConfigError, match=match):
        arguments.parse(DENSE + flags, exit_on_dry_run=False)
