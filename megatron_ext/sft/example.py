"""A small chat data set and a tokenizer for it, made here (nothing downloaded): what
recipes/tiny_sft.yaml trains on, and what the tests build their tokenizers from.

    python scripts/prepare_data.py --chat-example DIR    ->  DIR/conversations.jsonl, DIR/tokenizer/

Conversations are arithmetic, a calculator answering and following up (a system turn in half of them,
one to three assistant turns; some lines hold two conversations, each starting with its system turn, as
Megatron-LM's SFT data may), so a tiny model's loss on the assistant tokens visibly falls. The tokenizer
is a byte-level BPE trained on them with ChatML's turn markers and chat template.
"""
from __future__ import annotations

import json
import os
import random

SYSTEM = "You are a careful calculator. Write the arithmetic out."
CHATML = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_OPS = (("plus", "+", lambda a, b: a + b), ("minus", "-", lambda a, b: a - b), ("times", "*", lambda a, b: a * b))


def conversation(rng: random.Random, system: bool) -> list[dict]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    word, sign, op = rng.choice(_OPS)
    value = op(a, b)
    ask = rng.choice(("What is {a} {w} {b}?", "Compute {a} {w} {b}.", "{a} {w} {b}, please."))
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    messages += [{"role": "user", "content": ask.format(a=a, w=word, b=b)},
                 {"role": "assistant", "content": f"{a} {sign} {b} = {value}."}]
    for _ in range(rng.randint(0, 2)):
        c = rng.randint(2, 9)
        word, sign, op = rng.choice(_OPS)
        messages += [{"role": "user", "content": f"And {word} {c}?"},
                     {"role": "assistant", "content": f"{value} {sign} {c} = {op(value, c)}."}]
        value = op(value, c)
    return messages


def lines(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages = conversation(rng, system=rng.random() < 0.5)
        if rng.random() < 0.1:  # a second conversation on the same line, starting at its system turn
            messages = conversation(rng, system=True) + conversation(rng, system=True)
        out.append({"messages": messages})
    return out


def make_tokenizer(texts: list[str], out_dir: str, vocab_size: int = 320, special: tuple = (),
                   template: str = CHATML, eos: str = "<|im_end|>", pad: str | None = "<|endoftext|>") -> str:
    """A byte-level BPE over `texts` with ChatML's markers (and `special` tokens), saved as a Hugging
    Face tokenizer folder with `template` as its chat template."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL + list(special),
                            show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=eos, pad_token=pad)
    tokenizer.save_pretrained(out_dir)
    # the template and class in tokenizer_config.json: what transformers 4 and 5 both read
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=template)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def write(out_dir: str, count: int = 300, seed: int = 0) -> dict:
    """DIR/conversations.jsonl and DIR/tokenizer/."""
    os.makedirs(out_dir, exist_ok=True)
    records = lines(count, seed)
    data = os.path.join(out_dir, "conversations.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    texts = ["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in r["messages"]) for r in records]
    return {"data": data, "tokenizer": make_tokenizer(texts, os.path.join(out_dir, "tokenizer"))}
