"""(b) Packed rows on the model megatron-core builds (local spec, the one CPU and GPUs without
transformer-engine run): every conversation's logits are the ones it has alone, so positions restart
and attention never crosses a conversation, with and without a sliding window (megatron_ext/seams/sft.py);
the padding changes nothing and is out of the loss; a resumed run reads the rows an uninterrupted one does."""
from __future__ import annotations

from tests.dist import run_distributed
from tests.sft import chats

# fp32 on CPU: the packed row's attention sums over more (masked, exactly zero) keys and rotates at
# larger angles than each conversation alone; the difference stays at rounding level
ROUNDING = 2e-5


def test_packed_row_equals_each_conversation_alone():
    argv = ["--recipe", chats.RECIPE, "--train-iters", "4", "--eval-iters", "0"]
    result = run_distributed(1, "tests.sft.jobs:packed_rows", argv=argv, windowed=["--window-size", "5,0"])[0]
    for name in ("plain", "window"):
        got = result[name]
        assert got["conversations"] >= 2 and got["positions_restart"], name
        assert got["max_abs_diff_alone"] <= ROUNDING * got["logit_scale"], (name, got)
        assert not got["padding_changes_real_logits"] and got["padding_in_loss"] == 0, name
        assert got["unpacked_max_abs_diff"] > 1e-3, name  # negative control: one causal mask crosses conversations
    assert result["resume"]
