"""Conversations, data files and tokenizers for the SFT tests, made here (nothing downloaded)."""
from __future__ import annotations

import json
import os
import random

from megatron_ext.sft import example

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "tiny_sft.yaml")
# megatron's SFTTokenizer prompt formats name these tokens; "Assistant" as one token keeps
# nemotron-nano-v2's assistant header the 3 tokens its PromptConfig declares
NEMOTRON = ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>", "<unk>", "Assistant")
# ChatML with transformers' generation tags around what the prefix rule calls assistant text: the
# reference masker (apply_chat_template(..., return_assistant_tokens_mask=True))
CHATML_GENERATION = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def multi_turn(count: int, seed: int = 1) -> list[list[dict]]:
    """Conversations with a system turn and three assistant turns."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        messages = example.conversation(rng, system=True)
        if sum(m["role"] == "assistant" for m in messages) == 3:
            out.append(messages)
    return out


def make_tokenizer(out_dir: str, **kwargs) -> str:
    """The example's tokenizer recipe, with nemotron's tokens too (ChatML template unless given)."""
    texts = ["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in r["messages"])
             for r in example.lines(200)]
    texts += [f"<SPECIAL_11>User\n{t}\n<SPECIAL_11>Assistant\n" for t in texts[:50]]
    return example.make_tokenizer(texts, out_dir, vocab_size=400, special=NEMOTRON, **kwargs)


def write_jsonl(path, records) -> str:
    """`records`: dicts (written as JSON) or raw lines (written as they are)."""
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def argv(data: str, tokenizer: str, *extra) -> list[str]:
    return ["--recipe", RECIPE, "--data-path", data, "--tokenizer-model", tokenizer, *extra]
