"""The seams registry: each record names real upstream sites, changes something when installed, and
leaves torch and megatron-core exactly as they were when removed; a run installs the records its
flags need and teardown removes them all."""
from __future__ import annotations

import os

import megatron.core
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from megatron.core import parallel_state
from megatron.core.dist_checkpointing import optimizer as dist_ckpt_optimizer
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.distributed import distributed_data_parallel, param_and_grad_buffer
from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buffer
from megatron.core.optimizer import distrib_optimizer
from megatron.core.models.common import fine_grained_callables
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.utils import ScheduleNode
from megatron.core.tensor_parallel import layers, mappings
from megatron.core.transformer import torch_norm
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer import multi_latent_attention
from megatron.core import utils as megatron_utils
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
from megatron.core.transformer.moe import router, token_dispatcher
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.utils import GlobalMemoryBuffer
from megatron.core.tokenizers.text.libraries import huggingface_tokenizer

from megatron_ext.seams import registry as seams
from megatron_ext.seams.schedules import label_plain_schedule_passes
from megatron_ext.moe.sync_detector import SyncDetector
from tests.parsed import parsed_args

MEGATRON_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(megatron.core.__file__))))
TARGETS = {
    "torch.distributed": dist, "torch.cuda": torch.cuda, "torch.cuda.Event": torch.cuda.Event,
    "torch.cuda.Stream": torch.cuda.Stream, "mappings": mappings, "layers": layers,
    "router": router, "GlobalMemoryBuffer": GlobalMemoryBuffer, "RotaryEmbedding": RotaryEmbedding,
    "parallel_state": parallel_state, "schedules": schedules, "token_dispatcher": token_dispatcher,
    "_ParamAndGradBucketGroup": param_and_grad_buffer._ParamAndGradBucketGroup,
    "DistributedDataParallel": distributed_data_parallel.DistributedDataParallel,
    "DistributedOptimizer": distrib_optimizer.DistributedOptimizer,
    "fsdp.DataParallelBuffer": fsdp_buffer.DataParallelBuffer,
    "fsdp.ParamAndGradBuffer": fsdp_buffer.ParamAndGradBuffer, "fsdp.MegatronFSDP": megatron_fsdp.MegatronFSDP,
    "WrappedTorchNorm": torch_norm.WrappedTorchNorm,
    "filesystem_async": filesystem_async, "FileSystemReader": FileSystemReader, "serialization": serialization,
    "TemporaryBucketAllocator": fsdp_buffer.TemporaryBucketAllocator,
    "StorageResizeBasedBucketAllocator": fsdp_buffer.StorageResizeBasedBucketAllocator,
    "LocalSpecProvider": LocalSpecProvider, "QKNormConfigResolver": QKNormConfigResolver,
    "dist_ckpt_optimizer": dist_ckpt_optimizer, "SequentialMLP": SequentialMLP,
    "fine_grained_callables": fine_grained_callables, "ScheduleNode": ScheduleNode,
    "DotProductAttention": DotProductAttention, "torch.nn.RMSNorm": torch.nn.RMSNorm,
    "torch.nn.LayerNorm": torch.nn.LayerNorm, "rope_utils": rope_utils,
    "multi_latent_attention": multi_latent_attention,
    "MLASelfAttention": multi_latent_attention.MLASelfAttention,
    "FusedScaleMaskSoftmax": FusedScaleMaskSoftmax,
    "torch.nn.LayerNorm": torch.nn.LayerNorm, "rope_utils": rope_utils, "gpt_layer_specs": gpt_layer_specs,
    "megatron.core.utils": megatron_utils, "LanguageModule": LanguageModule,
    "huggingface_tokenizer": huggingface_tokenizer,
}


def snapshot() -> dict:
    return {name: dict(vars(obj)) for name, obj in TARGETS.items()}


def changed(before: dict) -> list[str]:
    now = snapshot()
    return sorted(
        f"{name}.{key}"
        for name in before
        for key in before[name].keys() | now[name].keys()
        if before[name].get(key, None) is not now[name].get(key, None)
    )


@pytest.fixture
def pristine():
    seams.uninstall()
    yield snapshot()
    seams.uninstall()


def test_every_seam_names_existing_upstream_lines():
    assert len(seams.SEAMS) >= 7
    for seam in seams.SEAMS.values():
        assert seam.why and seam.upstream, seam.name
        for site in seam.upstream:
            path, line = site.split(":")
            assert path.startswith("megatron/"), site
            with open(os.path.join(MEGATRON_ROOT, path)) as f:
                assert int(line) <= len(f.readlines()), site


@pytest.mark.parametrize("name", sorted(seams.SEAMS))
def test_seam_installs_and_uninstalls_cleanly(pristine, name):
    seam = seams.SEAMS[name]
    held = seam.active
    with seam.without():  # one the platform holds for the process (a CPU shim) is put back after
        before = snapshot()
        seam.apply()
        seam.apply()  # idempotent
        touched = changed(before)
        assert seam.active and touched, name
        seam.remove()
        assert not seam.active and changed(before) == [], name
    assert seam.active == held


def active() -> set:
    return {name for name, seam in seams.SEAMS.items() if seam.active}


def test_run_installs_what_its_flags_need_and_teardown_restores(pristine):
    held = active()  # for the process: the torch-norm seam on CPU (its CPU shim)
    assert held == ({"training.torch_norm_sequence_parallel"} if not torch.cuda.is_available() else set())
    seams.install(parsed_args(overlap_tp_comm_1f1b=False, transformer_impl="local"))
    # megatron's defaults: the local spec with --attention-backend auto, torch's attention
    assert active() - held == {"sharded_params.post_param_sync", "sharded_params.forward_pre_hook",
                               "sharded_params.own_buffers_param_sync", "attention.torch_attention",
                               "attention.te_environment"}
    seams.install(parsed_args(overlap_tp_comm_1f1b=True, transformer_impl="local"))
    assert {"schedules.tp_collectives", "schedules.lane_memory_buffers"} <= active()
    assert "torch.distributed.all_reduce" in changed(pristine)
    seams.uninstall()
    assert changed(pristine) == [] and active() == held


def test_scoped_seams_last_only_for_their_block(pristine):
    with label_plain_schedule_passes():
        assert changed(pristine) == ["schedules.backward_step", "schedules.forward_step"]
    assert changed(pristine) == []
    with SyncDetector():
        assert "token_dispatcher.maybe_move_tensor_to_cpu" in changed(pristine)
    assert changed(pristine) == []


def test_the_local_files_tokenizer_lasts_only_while_megatron_builds_one(pristine, tmp_path, monkeypatch):
    """GPT-2's hub name with local vocab/merges files builds GPT-2's tokenizer from them, no hub
    look-up, inside the block (training/tokenizer.py build holds it there) and nowhere else."""
    import json
    from types import SimpleNamespace

    from megatron_ext.training import tokenizer

    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}))
    merges.write_text("#version: 0.2\na b\n")
    seam = seams.SEAMS["megatron_training.local_files_tokenizer"]
    with seam.applied():
        assert changed(pristine) == ["huggingface_tokenizer.AutoTokenizer"]
        made = huggingface_tokenizer.AutoTokenizer.from_pretrained("gpt2", vocab_file=str(vocab), merges_file=str(merges))
        assert type(made).__name__.startswith("GPT2Tokenizer") and made("ab")["input_ids"] == [2]
    assert changed(pristine) == []
    seen = []

    def build_tokenizer(view):  # megatron's builder, as training/tokenizer.py calls it
        seen.append(seam.active)
        return SimpleNamespace()

    from megatron.core.tokenizers.utils import build_tokenizer as builder

    monkeypatch.setattr(builder, "build_tokenizer", build_tokenizer)
    monkeypatch.setattr(tokenizer, "check", lambda args: None)
    monkeypatch.setattr(tokenizer, "_CACHE", {})
    tokenizer.build(SimpleNamespace(tokenizer_type="GPT2BPETokenizer"))
    assert seen == [True] and changed(pristine) == []
