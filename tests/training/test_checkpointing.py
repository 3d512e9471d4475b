"""Checkpointing: a resumed run logs exactly the losses of an uninterrupted one; a crash in
the middle of a save leaves the previous checkpoint the one that loads; retention; resharding;
integrity: a damaged checkpoint is named in one line and the older one resumes exactly.

Every run goes through train.main in the persistent gloo workers (tests/dist.py). Dropout is on
wherever the RNG state matters, so a resume that lost it would show."""
from __future__ import annotations

import os

import pytest

from megatron_ext.checkpoint.dirs import TRACKER, complete_iterations, retained
from tests.dist import run_distributed

TOTAL, SPLIT = 4, 2  # uninterrupted: iterations 1..4; interrupted: 1..2, save, resume, 3..4
# global batch 4: one micro-batch a step per data-parallel rank (two on one rank without DP). What a
# resume must restore (weights, optimizer, schedule, RNG, data position) is per step, not per micro-batch
BATCH = ["--global-batch-size", "4"]
DENSE = ["--recipe", "recipes/tiny_dense.yaml", "--num-layers", "2", "--train-iters", str(TOTAL), "--log-interval", "100",
         *BATCH]
MOE = ["--recipe", "recipes/tiny_moe.yaml", "--train-iters", str(TOTAL), "--log-interval", "100", *BATCH]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]

_UNINTERRUPTED: dict = {}


def train(world: int, argv: list[str], lines: list | None = None) -> list[dict]:
    """The history of the last rank (where the loss lives); rank 0's printed lines into `lines`."""
    out = run_distributed(world, "tests.training.jobs_ckpt:train_capturing", argv=argv)
    if lines is not None:
        lines.extend(out[0]["lines"])
    return out[-1]["history"]


def uninterrupted(world: int, argv: list[str]) -> list[dict]:
    key = (world, tuple(argv))
    if key not in _UNINTERRUPTED:
        _UNINTERRUPTED[key] = train(world, argv)
    return _UNINTERRUPTED[key]


def losses(history: list[dict]) -> list[tuple]:
    return [(r["iteration"], r["lm loss"], r["grad norm"]) for r in history]


def interrupted(world: int, argv: list[str], save: str, first_extra=(), resume_extra=(), lines=None) -> list[dict]:
    """Iterations 1..SPLIT, save and exit; then a new run resumes from --load and finishes."""
    first = train(world, argv + ["--save", save, "--save-interval", str(SPLIT), "--exit-interval", str(SPLIT),
                                 *first_extra], lines)
    assert [r["iteration"] for r in first] == list(range(1, SPLIT + 1))
    assert complete_iterations(save) == [SPLIT]
    second = train(world, argv + ["--load", save, "--save", save, "--save-interval", str(SPLIT), *resume_extra],
                   lines)
    assert second[0]["iteration"] == SPLIT + 1, "did not resume at the saved iteration"
    return first + second


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_equals_uninterrupted_dp2_distributed_optimizer(tmp_path, async_save):
    argv = DENSE + DROPOUT + ["--use-distributed-optimizer"]
    extra = ["--async-save"] if async_save else []
    lines = []
    resumed = interrupted(2, argv, str(tmp_path), first_extra=extra, resume_extra=extra, lines=lines)
    saved = [line for line in lines if line.startswith("[checkpoint] saved checkpoint")]
    assert len(saved) == 2 and all(("written by a forked process" in line) == async_save for line in saved), saved
    assert losses(resumed) == losses(uninterrupted(2, argv))
    assert complete_iterations(str(tmp_path)) == [SPLIT, TOTAL]  # saved at exit too
    assert open(tmp_path / TRACKER).read() == str(TOTAL)
    for it in (SPLIT, TOTAL):  # checksummed in the (forked) writer too
        assert_checksums_match(str(tmp_path / f"iter_{it:07d}"))


def test_resume_equals_uninterrupted_tp2_pp2(tmp_path):
    argv = DENSE + DROPOUT + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--use-distributed-optimizer", "--overlap-tp-comm-1f1b",
    ]
    assert losses(interrupted(4, argv, str(tmp_path))) == losses(uninterrupted(4, argv))


def test_resume_equals_uninterrupted_ep2(tmp_path):
    argv = MOE + ["--hidden-dropout", "0.1", "--expert-model-parallel-size", "2",
                  "--use-distributed-optimizer", "--moe-sync-free-dispatcher"]
    assert losses(interrupted(2, argv, str(tmp_path))) == losses(uninterrupted(2, argv))


def test_resume_equals_uninterrupted_ep2_overlapped_grad_reduce_and_param_gather(tmp_path):
    """With --overlap-param-gather a step updates only this rank's shard of each parameter until the
    next forward gathers the rest: a save must gather first, or the checkpoint holds the previous
    step's weights there (without it: iteration 3 logs 5.6157 instead of 5.6078)."""
    argv = MOE + ["--hidden-dropout", "0.1", "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                  "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-num-buckets", "2"]
    assert losses(interrupted(2, argv, str(tmp_path))) == losses(uninterrupted(2, argv))


def test_resume_without_rng_state_differs(tmp_path):
    """The equality above has teeth: the same resume without the RNG state (dropout on) differs."""
    argv = DENSE + DROPOUT + ["--use-distributed-optimizer"]
    resumed = interrupted(2, argv, str(tmp_path), resume_extra=["--no-load-rng"])
    full = uninterrupted(2, argv)
    assert losses(resumed)[:SPLIT] == losses(full)[:SPLIT]
    assert losses(resumed)[SPLIT:] != losses(full)[SPLIT:]


def test_freeze_all_layers_saves_without_optimizer_state_and_loads_back(tmp_path):
    """--freeze-all-layers: nothing trains, so megatron builds a stub optimizer with no state; the run
    saves the model, schedule and RNG (its save died in the stub's state_dict before). A run that
    trains loads it back with a fresh optimizer and says so: its first loss is the frozen run's at that
    iteration, though its own --init-method-std would draw other weights (so they came from the
    checkpoint)."""
    argv = DENSE + ["--lr-warmup-iters", "0"]
    lines = []
    frozen = train(1, argv + ["--freeze-all-layers", "--save", str(tmp_path), "--save-interval", str(SPLIT)])
    assert complete_iterations(str(tmp_path)) == [SPLIT, TOTAL]
    resumed = train(1, argv + ["--load", str(tmp_path), "--ckpt-step", str(SPLIT), "--init-method-std", "0.5"], lines)
    assert resumed[0]["iteration"] == SPLIT + 1
    assert resumed[0]["lm loss"] == frozen[SPLIT]["lm loss"]
    assert any("holds no optimizer state (saved with --no-save-optim or --freeze-all-layers): the optimizer "
               "starts fresh" in line for line in lines), lines
    assert resumed[-1]["grad norm"] > 0 and resumed[-1]["lm loss"] != frozen[-1]["lm loss"]  # it trains


@pytest.mark.parametrize("how,mode", [("raise", "sync"), ("exit", "async")],
                         ids=["write-error-sync", "writer-killed-async"])
def test_crash_mid_save_leaves_previous_checkpoint_loadable(tmp_path, how, mode):
    save = str(tmp_path)
    argv = DENSE + DROPOUT + ["--use-distributed-optimizer"]
    extra = ["--async-save"] if mode == "async" else []
    out = run_distributed(
        2, "tests.training.jobs_ckpt:train_with_crash_mid_save",
        argv=argv + ["--save", save, "--save-interval", str(SPLIT), *extra],
        save_dir=save, crash_iteration=TOTAL, how=how,
    )[0]
    assert out["error"] is not None and "CheckpointException" in out["error"], out
    assert out["partial_files"], "the crash should have come after some files were written"
    assert f"iter_{TOTAL:07d}.partial" in out["listing"] and f"iter_{TOTAL:07d}" not in out["listing"]
    assert complete_iterations(save) == [SPLIT]
    assert open(os.path.join(save, TRACKER)).read() == str(SPLIT)

    resumed = train(2, argv + ["--load", save, "--save", save, "--save-interval", "100"])
    assert resumed[0]["iteration"] == SPLIT + 1
    assert losses(resumed) == losses(uninterrupted(2, argv))[SPLIT:]
    assert complete_iterations(save) == [SPLIT, TOTAL]
    assert not any(n.endswith(".partial") for n in os.listdir(save)), "stale partial save not cleaned"


def test_keep_last_k(tmp_path):
    save = str(tmp_path)
    train(2, DENSE + ["--save", save, "--save-interval", "1", "--save-keep-last", "2"])
    assert complete_iterations(save) == [TOTAL - 1, TOTAL]
    assert sorted(os.listdir(save)) == sorted([f"iter_{TOTAL - 1:07d}", f"iter_{TOTAL:07d}", TRACKER])


@pytest.mark.parametrize("given,source", [(["--async-save"], "cli"), ([], "default")])
def test_async_save_request_survives_validate_args_with_its_source(given, source):
    """megatron's validate_args turns --async-save off without its persistent worker; we honour the
    request, and the configuration still names who asked for it."""
    import arguments

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "recipes", "tiny_dense.yaml")
    args = arguments.parse(["--recipe", recipe, "--mock-data", "--dry-run", *given], exit_on_dry_run=False)
    assert args.async_save is bool(given)
    assert args.config_sources["async_save"] == source


def test_debris_rule():
    """Once iter_4 is committed: deletes in progress and older partial saves go; a newer partial
    save is an async save still being written (they overlap when saves come faster than writes)."""
    from megatron_ext.checkpoint.dirs import debris

    names = ["iter_0000002", "iter_0000003.partial", "iter_0000004", "iter_0000001.deleting",
             "iter_0000005.partial", TRACKER]
    assert sorted(debris(names, 4)) == ["iter_0000001.deleting", "iter_0000003.partial"]


def test_retention_rule():
    its = [10, 20, 30, 40, 50]
    assert retained(its, None, None) == set(its)
    assert retained(its, 2, None) == {40, 50}
    assert retained(its, 1, 20) == {20, 40, 50}
    assert retained(its, None, 30) == {30, 50}  # megatron's --save-retain-interval alone


def test_resume_into_another_layout_tp2_to_dp2(tmp_path):
    """dist_checkpointing reshards a TP=2 checkpoint for TP=1 x DP=2. Not bit-equal: fp32
    summation order differs between layouts (and the RNG state is per layout, so no dropout)."""
    save = str(tmp_path)
    tp2 = DENSE + ["--tensor-model-parallel-size", "2"]
    train(2, tp2 + ["--save", save, "--save-interval", str(SPLIT), "--exit-interval", str(SPLIT)])
    resumed = train(2, DENSE + ["--load", save])
    assert resumed[0]["iteration"] == SPLIT + 1
    expected = uninterrupted(2, tp2)[SPLIT:]
    for got, want in zip(resumed, expected):
        assert got["lm loss"] == pytest.approx(want["lm loss"], rel=1e-5)
        assert got["grad norm"] == pytest.approx(want["grad norm"], rel=1e-4)


# ---------------------------------------------------------------------------------------------
# integrity: a damaged checkpoint is detected, named in one line, and never trained on
# ---------------------------------------------------------------------------------------------
from tests.training.jobs_ckpt import DAMAGES  # noqa: E402

LAYOUTS = {
    "dp2-distopt": (2, DENSE + DROPOUT + ["--use-distributed-optimizer"]),
    "tp2pp2": (4, DENSE + DROPOUT + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     "--use-distributed-optimizer"]),
}
FALLBACK_CASES = [c for c in DAMAGES if c not in ("no-fallback", "ckpt-step")]
# the damage every layout must survive; the other cases (a changed checksum list, a checkpoint
# without checksums, --no-ckpt-fallback) exercise layout-independent code and run at DP2 only
BOTH_LAYOUTS = ["truncated-shard", "missing-shard", "changed-tensor-bytes", "damaged-dcp-metadata",
                "missing-metadata-json", "damaged-latest-marker"]
EXTRA = {"no-fallback": ["--no-ckpt-fallback"], "ckpt-step": ["--ckpt-step", str(TOTAL)]}
_SAVED: dict = {}


def saved(layout: str, tmp_path_factory) -> tuple[str, list]:
    """One save sequence per layout, iterations 1..4 saved at 2 and 4; its history is the
    uninterrupted reference."""
    if layout not in _SAVED:
        world, argv = LAYOUTS[layout]
        pristine = str(tmp_path_factory.mktemp(layout) / "pristine")
        try:
            out = run_distributed(world, "tests.training.jobs_ckpt:save_recording_reads", timeout=120,
                                  argv=argv + ["--save-interval", str(SPLIT)], save=pristine)
            _SAVED[layout] = (pristine, out)
        except Exception as e:  # noqa: BLE001 - the layout's cases fail with it, without rerunning
            _SAVED[layout] = e
    if isinstance(_SAVED[layout], Exception):
        raise _SAVED[layout]
    return _SAVED[layout]


def damaged(layout: str, case: str, tmp_path_factory) -> tuple[str, list, list]:
    """A copy of the layout's checkpoints with `case` done to the newest (iter_4), and the resume
    from it: (the copy, the reference per rank, the resume per rank)."""
    import shutil

    pristine, reference = saved(layout, tmp_path_factory)
    copy = str(tmp_path_factory.mktemp(f"{layout}-{case}") / "ckpt")
    shutil.copytree(pristine, copy)
    DAMAGES[case][0](copy, os.path.join(copy, f"iter_{TOTAL:07d}"))
    world, argv = LAYOUTS[layout]
    out = run_distributed(world, "tests.training.jobs_ckpt:resume_recording_verified", timeout=120,
                          argv=argv + ["--load", copy, *EXTRA.get(case, [])])
    return copy, reference, out


def checkpoint_lines(rank_out: dict) -> list[str]:
    return [line for line in rank_out["lines"] if line.startswith(("[checkpoint]", "warning:"))]


@pytest.mark.parametrize("layout,case", [("dp2-distopt", c) for c in FALLBACK_CASES] + [("tp2pp2", c) for c in BOTH_LAYOUTS])
def test_damaged_checkpoint_is_named_and_the_older_one_resumes_exactly(layout, case, tmp_path_factory):
    case_dir, saving, out = damaged(layout, case, tmp_path_factory)
    newest, older = (os.path.join(case_dir, f"iter_{i:07d}") for i in (TOTAL, SPLIT))
    lines = checkpoint_lines(out[0])
    for rank in out[1:]:
        assert not checkpoint_lines(rank), "only rank 0 reports"
    for rank in out:
        assert rank["error"] is None
    what = DAMAGES[case][1]
    if case == "damaged-latest-marker":
        assert len(lines) == 2, lines
        assert lines[0].startswith(f"[checkpoint] warning: {what}") and "ignored" in lines[0]
    else:
        damaged_lines = [line for line in lines if "damaged checkpoint" in line]
        assert len(damaged_lines) == 1, lines
        assert damaged_lines[0].startswith(f"[checkpoint] damaged checkpoint {newest}: {what}"), damaged_lines
        assert f"loading {older} instead of the damaged newer checkpoint(s): 2 iterations lost (4 -> 2)" in lines[-2]
    if case == "no-checksums":
        assert any(f"note: {older} has no checksums" in line for line in lines), lines
    assert lines[-1].startswith(f"[checkpoint] resuming from checkpoint {older} at iteration {SPLIT} ")
    # never trained on: the resumed run is the uninterrupted one, bit for bit, from the older checkpoint
    assert losses(out[-1]["history"]) == losses(saving[-1]["history"])[SPLIT:]
    if case == "damaged-latest-marker":  # each rank verified the shards it read
        verified = [set(rank["verified"]) for rank in out]
        shards = {f for f in os.listdir(older) if f.endswith(".distcp")}
        assert set().union(*verified) == shards
        if layout == "tp2pp2":  # not every rank's
            assert all(len(v) < len(shards) for v in verified), verified


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checksums_are_taken_while_writing(layout, tmp_path_factory):
    pristine, out = saved(layout, tmp_path_factory)
    for rank in out:  # the shard files were summed as they were written, not read back
        assert rank["read_back"] in ([], [".metadata"]), rank["read_back"]
    for it in (SPLIT, TOTAL):
        assert_checksums_match(os.path.join(pristine, f"iter_{it:07d}"))


@pytest.mark.parametrize("case,flag", [("no-fallback", "--no-ckpt-fallback"), ("ckpt-step", f"--ckpt-step={TOTAL}")])
def test_damaged_checkpoint_asked_for_stops_with_one_line(tmp_path_factory, case, flag):
    case_dir, _, out = damaged("dp2-distopt", case, tmp_path_factory)
    newest = os.path.join(case_dir, f"iter_{TOTAL:07d}")
    for result in out:
        assert result["history"] is None
        assert result["error"].startswith(f"DamagedCheckpoint: damaged checkpoint {newest}: __1_0.distcp truncated")
        assert "\n" not in result["error"] and result["error"].endswith(f"({flag}: not loading an older one)")
        assert not any("resuming" in line for line in result["lines"])


def assert_checksums_match(ckpt: str) -> dict:
    """The checksums recorded in a checkpoint's metadata.json are those of its files, and list
    every file."""
    import json

    from megatron_ext.checkpoint.integrity import crc32_file

    with open(os.path.join(ckpt, "metadata.json")) as f:
        files = json.load(f)["checksums"]["files"]
    assert set(files) == set(os.listdir(ckpt)) - {"metadata.json"}
    for name, (size, crc) in files.items():
        assert list(crc32_file(os.path.join(ckpt, name))) == [size, crc], name
    return files


@pytest.mark.parametrize("value", [0.0, float("inf")], ids=["zeroed", "non-finite"])
def test_intact_checkpoint_with_bad_weights_is_caught_after_resume(tmp_path, value):
    """Checksums cannot tell weights saved bad from good ones. Non-finite weights: the non-finite
    check looks at the loaded parameters before the first step, names the checkpoint in one line
    and (no older one here) stops. Zeroed weights (and optimizer moments): a warning that the grad
    norm stayed exactly 0 over the first log interval."""
    save = str(tmp_path)
    argv = DENSE + ["--log-interval", "2"]
    run_distributed(2, "tests.training.jobs_ckpt:train_saving_filled_params", value=value,
                    argv=argv + ["--save", save, "--save-interval", str(SPLIT), "--exit-interval", str(SPLIT)])
    out = run_distributed(2, "tests.training.jobs_ckpt:train_capturing", argv=argv + ["--load", save])
    warned = [[line for line in rank["lines"] if "grad norm exactly 0" in line] for rank in out]
    if value == 0.0:
        assert [r["error"] for r in out] == [None, None]
        assert [(r["iteration"], r["grad norm"]) for r in out[-1]["history"]] == [(3, 0.0), (4, 0.0)]
        assert len(warned[0]) == 1 and "iterations 3-4 after resuming from iteration 2" in warned[0][0]
        assert warned[1] == []  # rank 0 only
    else:
        ckpt = os.path.join(save, f"iter_{SPLIT:07d}")
        for rank in out:
            assert rank["history"] is None
            assert rank["error"] == f"DamagedCheckpoint: --load={save}: every checkpoint is damaged ([{SPLIT}])"
        damaged_lines = [line for line in out[0]["lines"] if "damaged checkpoint" in line]
        assert len(damaged_lines) == 1 and damaged_lines[0].startswith(
            f"[checkpoint] damaged checkpoint {ckpt}: non-finite values in "), damaged_lines
        assert warned == [[], []]


def test_zero_grad_warning_only_after_a_resume():
    from types import SimpleNamespace

    from megatron_ext.training.observability import ZeroGradAfterResume

    def run(first, norms, interval=2):
        check = ZeroGradAfterResume.__new__(ZeroGradAfterResume)
        check.interval, check.first, check.all_zero, check.done, check.rank, check.warned = interval, None, True, False, 1, False
        for i, norm in enumerate(norms, start=first):
            check.after_step(i, SimpleNamespace(grad_norm=norm))
        return check.warned

    assert run(3, [0.0, 0.0]) is True
    assert run(3, [0.0, 1e-9]) is False
    assert run(3, [None, 0.0]) is False
    assert run(1, [0.0, 0.0]) is False  # a fresh start


def test_latest_marker_rule(tmp_path):
    from megatron_ext.checkpoint.dirs import read_tracker

    assert read_tracker(str(tmp_path), [2, 4]) is None  # no marker
    for text, ok in [("4", True), ("2\n", True), ("", False), ("4x", False), ("6", False), ("release", False)]:
        (tmp_path / TRACKER).write_text(text)
        assert (read_tracker(str(tmp_path), [2, 4]) is None) == ok, text


def test_checksum_of_the_bytes_as_written(tmp_path):
    """The writer's stream sums exactly the bytes that reach the file (small writes gathered,
    large ones passed through), and `tell` counts the ones not yet written."""
    import io

    import torch
    from torch.distributed.checkpoint.filesystem import _write_item

    from megatron_ext.seams import checkpointing as checksummed
    from megatron_ext.checkpoint import integrity as ckpt_integrity

    checksummed.start_recording()
    wrapped = checksummed.summing_write_item(_write_item)
    path = tmp_path / "__0_0.distcp"
    calls = []

    def write_item(transforms, stream, data, write_item, storage_key, serialization_format):
        calls.append(stream)
        start = stream.tell()
        payload = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data.numpy())
        stream.write(payload)
        assert stream.tell() - start == payload.nbytes

    with open(path, "wb") as f:
        for data in (io.BytesIO(b"header"), torch.arange(1000.0), torch.rand(50_000), torch.ones(3, 5, dtype=torch.int64)):
            checksummed.summing_write_item(write_item)(None, f, data, None, "k", None)
    sums = checksummed.recorded(str(tmp_path))
    assert sums["__0_0.distcp"][:2] == list(ckpt_integrity.crc32_file(str(path)))
    assert sums["__0_0.distcp"][2] is True
    assert all(type(s).__name__ == "_SummingStream" for s in calls)
    assert wrapped.__wrapped__ is _write_item  # megatron-core reads the signature through it


def test_dry_run_refuses_a_load_directory_whose_every_checkpoint_is_damaged(tmp_path_factory, monkeypatch):
    """The cheap look at --load (structure and metadata, no checksum pass): every checkpoint
    damaged is refused at --dry-run with one line, as the run itself stops after reading them;
    one intact checkpoint is enough to pass (the run falls back to it); a checkpoint whose bytes
    changed at their size passes the look (only the load's verification reads them)."""
    import shutil

    import arguments
    from megatron_ext.errors import ConfigError
    from megatron_ext.checkpoint import integrity as ckpt_integrity
    from tests.training import jobs_ckpt

    def no_checksum_pass(path):
        raise AssertionError(f"the dry-run read {path} whole")

    monkeypatch.setattr(ckpt_integrity, "crc32_file", no_checksum_pass)
    pristine, _ = saved("dp2-distopt", tmp_path_factory)
    copy = str(tmp_path_factory.mktemp("dry-run") / "ckpt")
    shutil.copytree(pristine, copy)
    newest, older = (os.path.join(copy, f"iter_{i:07d}") for i in (TOTAL, SPLIT))

    def dry_run():
        arguments.parse(DENSE + ["--mock-data", "--load", copy, "--dry-run"], exit_on_dry_run=False)

    jobs_ckpt._change_tensor_bytes(copy, newest)
    dry_run()
    jobs_ckpt._truncate_shard(copy, newest)
    dry_run()  # the older one is intact: the run loads it
    jobs_ckpt._remove_metadata_json(copy, older)
    with pytest.raises(ConfigError) as refused:
        dry_run()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"--load={copy}: every checkpoint is damaged (iter_{TOTAL:07d}: __1_0.distcp "
                              "truncated ("), message
    assert message.endswith(f"iter_{SPLIT:07d}: metadata.json missing)"), message


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_fsdp_dtensor_save_under_a_strategy_megatron_cannot_split_swiglu_for_is_refused(strategy):
    import arguments
    from megatron_ext.errors import ConfigError

    argv = DENSE + ["--mock-data", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--world-size", "2",
                    "--data-parallel-sharding-strategy", strategy, "--dry-run"]
    arguments.parse(argv, exit_on_dry_run=False)  # training without --save is fine
    with pytest.raises(ConfigError, match=f"^--data-parallel-sharding-strategy={strategy} with --save, "):
        arguments.parse(argv + ["--save", "ckpt", "--save-interval", "2"], exit_on_dry_run=False)
    arguments.parse([*argv[:-2], "optim_grads_params", "--dry-run", "--save", "ckpt", "--save-interval", "2"],
                    exit_on_dry_run=False)
