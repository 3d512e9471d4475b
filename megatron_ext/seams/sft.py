"""Seams of supervised fine-tuning on chat data (megatron_ext/sft/).

  chat_template            the Hugging Face tokenizer and chat template inside megatron's tokenizer: a
                           HuggingFaceTokenizer's (its library object's ``tokenizer``, megatron/core/
                           tokenizers/text/libraries/huggingface_tokenizer.py:70, and the template it settled
                           from --chat-template or the tokenizer, text_tokenizer.py:43-52), or an
                           SFTTokenizer's (libraries/sft_tokenizer.py:68: the tokenizer, and the prompt
                           format's PromptConfig, :70-105: its template and assistant_prefix_len).
  packed_causal_mask       (Patch) the local spec's attention takes an explicit mask, the per-conversation
                           block-diagonal causal mask of a packed row, in its torch softmax
                           (fusions/fused_softmax.py:329), but two paths drop a mask given to a causal
                           layer: a sliding-window layer replaces it with its window (:321-322, gpt-oss),
                           and the fused kernel applies only the causal triangle (:285-290). With a mask
                           given to a causal layer, the window (where the layer has one) is added to it (a
                           key is attended only where both allow it) and the torch softmax runs.
  token_weighted_evaluation  megatron's evaluate() averages per-micro-batch means when args.sft is set
                           (megatron/training/training.py:4274-4282); without it, it sums every micro-batch's
                           [loss sum, tokens] over data-parallel ranks (:4283-4286), the token-weighted loss
                           training reports. args.sft reads False for the evaluation.
"""
from __future__ import annotations

import contextlib

from megatron.core.fusions import fused_softmax
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.transformer.enums import AttnMaskType

from megatron_ext.patching import Patch, set_attr


def chat_template(tokenizer) -> tuple:
    """(Hugging Face tokenizer, chat template, assistant prefix tokens) inside megatron's tokenizer.
    ValueError (one line) for a tokenizer that has none: a library other than Hugging Face's, a slow
    tokenizer (no character offsets), no template."""
    from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer
    from megatron.core.tokenizers.text.libraries.sft_tokenizer import SFTTokenizer

    library = getattr(tokenizer, "_tokenizer", None)
    if isinstance(library, SFTTokenizer):
        config = library._prompt_config
        hf, template, prefix = library._tokenizer, config.custom_chat_template, config.assistant_prefix_len
    elif isinstance(library, HuggingFaceTokenizer):
        hf, template, prefix = library.tokenizer, tokenizer.chat_template, 0
    else:
        raise ValueError("--sft renders conversations with a Hugging Face tokenizer's chat template: use "
                         "--tokenizer-type HuggingFaceTokenizer (an import's tokenizer/) or SFTTokenizer")
    if not getattr(hf, "is_fast", False):
        raise ValueError("--sft maps the chat template's turns to tokens by character offsets, which only a fast "
                         "(tokenizer.json) tokenizer gives")
    if not template:
        raise ValueError("the tokenizer has no chat template: give one with --chat-template, or use "
                         "SFTTokenizer with --sft-tokenizer-prompt-format")
    return hf, template, prefix


class _WithoutWindow:
    """A FusedScaleMaskSoftmax seen without its sliding window (the mask given already holds it)."""

    window_size = None

    def __init__(self, softmax):
        self._softmax = softmax

    def __getattr__(self, name):
        return getattr(self._softmax, name)


def _install_packed_causal_mask():
    original = FusedScaleMaskSoftmax.forward

    def forward(self, input, mask, softmax_offset=None):
        if mask is None or self.attn_mask_type != AttnMaskType.causal:
            return original(self, input, mask, softmax_offset)
        if self.window_size is not None:
            window = fused_softmax.get_sliding_window_causal_mask(input.size(2), input.size(3), self.window_size)
            mask = mask | window.to(mask.device)
        return FusedScaleMaskSoftmax.forward_torch_softmax(_WithoutWindow(self), input, mask, softmax_offset)

    return set_attr(FusedScaleMaskSoftmax, "forward", forward)


PACKED_CAUSAL_MASK = Patch(
    name="sft.packed_causal_mask",
    upstream=["megatron/core/fusions/fused_softmax.py:233", "megatron/core/fusions/fused_softmax.py:285",
              "megatron/core/fusions/fused_softmax.py:321"],
    why="a packed row's per-conversation causal mask reaches the softmax of every local-spec attention layer: "
        "sliding-window layers add their window to it, the fused causal kernel (which takes no mask) is not used",
    install=_install_packed_causal_mask,
)
SEAMS = (PACKED_CAUSAL_MASK,)


def for_run(args):
    """The local spec's attention needs the mask seam; transformer-engine's takes packed sequences (THD)."""
    if args.sft and args.transformer_impl == "local":
        return (PACKED_CAUSAL_MASK,)
    return ()


@contextlib.contextmanager
def token_weighted_evaluation(args):
    """megatron's evaluate() under --sft: the token-weighted loss, as training reports it."""
    sft = args.sft
    args.sft = False
    try:
        yield
    finally:
        args.sft = sft
