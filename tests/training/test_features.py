"""The startup summary: one block, each capability's own line (its ``summary`` hook) with the setting
the run really has."""
from __future__ import annotations

import contextlib
import io

import arguments
from megatron_ext.training import features


def _summary(argv: list[str]) -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):
        args = arguments.parse(argv, exit_on_dry_run=False)
    return features.summary(args).splitlines()


def test_the_summary_says_each_capabilitys_effective_setting():
    moe = _summary(["--recipe", "recipes/tiny_moe.yaml", "--mock-data", "--moe-sync-free-dispatcher",
                    "--moe-zero-sync-dropless", "--moe-dropless-budget-factor", "1.5", "--activation-offload-modules",
                    "core_attn", "expert_fc1", "--activation-offload-pool-mb", "256", "--attention-backend", "unfused"])
    assert moe[0] == "[capabilities]"
    names = [line.split(":")[0].strip() for line in moe[1:]]
    # one line per package with the hook, in features.CAPABILITIES' order (schedules says "overlap")
    assert names == ["attention", "lora", "fp8", "moe", "offload", "overlap", "sft"]
    assert len(names) == sum(hasattr(p, "summary") for p in features.CAPABILITIES)
    said = dict(line.strip().split(": ", 1) for line in moe[1:])
    assert said["attention"].startswith("unfused (--attention-backend unfused on the local spec")
    assert said["moe"] == ("8 experts, top-2; dispatcher sync-free multihot (--moe-sync-free-dispatcher, alltoall "
                           "communication); dropless, zero-sync (--moe-zero-sync-dropless: budget 1.5 x the balanced "
                           "load, overflow error)")
    assert said["offload"].startswith("core_attention router_fc1; host pool 256 MiB in 4 MiB chunks, tensors from 64 KiB")
    assert said["lora"].startswith("off") and said["sft"].startswith("off") and said["overlap"].startswith("off")
    assert said["fp8"] == "off"

    dense = dict(line.strip().split(": ", 1) for line in _summary([
        "--recipe", "recipes/tiny_dense.yaml", "--mock-data", "--lora-rank", "4", "--lora-alpha", "8",
        "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"])[1:])
    assert dense["moe"].startswith("off") and dense["offload"].startswith("off")
    assert dense["attention"].startswith("sdpa (--attention-backend auto on the local spec")
    assert dense["lora"].startswith("rank 4, scale 2, dropout 0; on ")
    assert dense["fp8"] == "hybrid tensorwise through torchao (--fp8-format hybrid)"
