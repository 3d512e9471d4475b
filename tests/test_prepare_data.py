"""scripts/prepare_data.py: input it cannot tokenize is refused in one line, and no failure leaves a
partial .bin/.idx behind (an earlier dataset under the same prefix stays as it was)."""
from __future__ import annotations

import json
import os

import pytest

from tests.scripts import load_script

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _run(argv) -> str:
    with pytest.raises(SystemExit) as e:
        load_script("prepare_data").main(argv)
    return str(e.value.code)


def test_chat_messages_are_refused_by_key_pointing_at_sft(tmp_path):
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps(CHAT) + "\n")
    line = _run(["--input", str(src), "--json-keys", "messages", "--output-prefix", str(tmp_path / "out")])
    assert line.startswith(f"error: {src}:1: --json-keys messages: a list of chat messages") and "--sft" in line
    assert "\n" not in line
    assert sorted(os.listdir(tmp_path)) == ["chat.jsonl"]  # nothing written, not even an empty .bin


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failure_midway_leaves_the_earlier_dataset_as_it_was(tmp_path, workers):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(3)))
    prefix = str(tmp_path / "d")
    load_script("prepare_data").main(["--input", str(good), "--output-prefix", prefix])
    before = {name: (tmp_path / name).read_bytes() for name in ("d_text_document.bin", "d_text_document.idx")}

    bad = tmp_path / "bad.jsonl"  # two documents written, then a line that is not JSON
    bad.write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n{not json\n")
    line = _run(["--input", str(bad), "--output-prefix", prefix, "--workers", str(workers)])
    assert line.startswith(f"error: {bad}:3: not a JSON line")
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "d_text_document.bin", "d_text_document.idx", "good.jsonl"]
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_chat_example_writes_what_the_sft_recipe_trains_on(tmp_path, capsys):
    """`prepare_data.py --chat-example DIR` (docs/finetune.md, docs/offline.md) writes the conversations and the
    tokenizer that recipes/tiny_sft/ holds, byte for byte."""
    written = load_script("prepare_data").main(["--chat-example", str(tmp_path / "chat")])
    assert f"wrote {written['data']} and {written['tokenizer']}/" in capsys.readouterr().out
    committed = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny_sft")
    mine = sorted(os.path.relpath(os.path.join(d, f), tmp_path / "chat") for d, _, fs in os.walk(tmp_path / "chat")
                  for f in fs)
    theirs = sorted(os.path.relpath(os.path.join(d, f), committed) for d, _, fs in os.walk(committed) for f in fs)
    assert mine == theirs and "conversations.jsonl" in mine
    for name in mine:
        with open(tmp_path / "chat" / name, "rb") as a, open(os.path.join(committed, name), "rb") as b:
            assert a.read() == b.read(), name
