"""--sft's data path without a model: the assistant mask against two independent maskers, packing, the
row layout the step receives, and every refusal (one line, in-process and through train.py --dry-run)."""
from __future__ import annotations

import contextlib
import io
import random

import numpy as np
import pytest
import torch

import arguments
from megatron_ext.errors import ConfigError
from megatron_ext.sft import chat, packing
from megatron_ext.sft.attention import block_causal_mask, segment_ids
from tests.sft import chats


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_chat")
    data = chats.write_jsonl(root / "chat.jsonl", [{"messages": m} for m in chats.multi_turn(40)])
    return {"root": root, "data": data, "tokenizer": chats.make_tokenizer(str(root / "tok"))}


def parse(*argv):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        args = arguments.parse(list(argv), exit_on_dry_run=False)
    return args, out.getvalue()


def template_of(args) -> chat.ChatTemplate:
    from megatron_ext.seams.sft import chat_template
    from megatron_ext.training import tokenizer

    return chat.ChatTemplate(*chat_template(tokenizer.build(args)))


# --- (a) the mask against reference maskers ----------------------------------------------------------
def test_mask_equals_transformers_generation_tags(made):
    """The prefix rule on the ChatML template = transformers' own assistant mask from a ChatML template
    whose generation tags wrap each reply and its <|im_end|>\\n, token by token (a system turn and three
    assistant turns each)."""
    args, _ = parse(*chats.argv(made["data"], made["tokenizer"], "--dry-run"))
    ours = template_of(args)
    end = ours.hf.convert_tokens_to_ids("<|im_end|>")
    for k, messages in enumerate(chats.multi_turn(12, seed=5)):
        got = ours.encode(messages, k)
        ref = ours.hf.apply_chat_template(messages, chat_template=chats.CHATML_GENERATION, tokenize=True,
                                          return_dict=True, return_assistant_tokens_mask=True)
        assert got.ids.tolist() == list(ref["input_ids"])
        assert got.assistant.tolist() == [bool(x) for x in ref["assistant_masks"]]
        closing = [i for i, t in enumerate(got.ids) if t == end and got.assistant[i]]
        assert len(closing) == 3  # each reply's end-of-turn token is learned
        assert not got.assistant[: got.ids.tolist().index(end) + 1].any()  # the system turn is not


@pytest.mark.parametrize("prompt_format", ["nemotron-h-aligned", "nemotron-nano-v2"])
def test_mask_equals_megatron_sft_tokenizer(made, prompt_format):
    """With --tokenizer-type SFTTokenizer, megatron's prompt format renders, and the mask is the one
    megatron's own per-turn masker (SFTTokenizer.tokenize_conversation's targets) gives."""
    from megatron.core.tokenizers.text.libraries.sft_tokenizer import IGNORE_INDEX, SFTTokenizer

    args, _ = parse(*chats.argv(made["data"], made["tokenizer"], "--tokenizer-type", "SFTTokenizer",
                                "--sft-tokenizer-prompt-format", prompt_format, "--dry-run"))
    ours, reference = template_of(args), SFTTokenizer(made["tokenizer"], prompt_format)
    for k, messages in enumerate(chats.multi_turn(8, seed=6)):
        got = ours.encode(messages, k)
        tokens, targets = reference.tokenize_conversation(messages, return_target=True, add_generation_prompt=False)
        assert got.ids.tolist() == tokens.tolist()
        assert got.assistant.tolist() == (targets != IGNORE_INDEX).tolist()


def test_pad_equal_to_eos_keeps_eos_in_the_loss(made, tmp_path):
    """Where the pad token is EOS, the end of each reply stays in the loss: rows mask by position, not
    by the label's value (megatron's SFTDataset drops every label equal to pad)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(made["tokenizer"])
    tok.pad_token = tok.eos_token
    tok.save_pretrained(tmp_path / "pad_is_eos")
    args, _ = parse(*chats.argv(made["data"], str(tmp_path / "pad_is_eos"), "--dry-run"))
    from megatron_ext.sft.dataset import filler_id
    from megatron_ext.training import tokenizer

    eos = tok.eos_token_id
    assert filler_id(tokenizer.build(args)) == eos == tok.pad_token_id
    encoded = [template_of(args).encode(m, k) for k, m in enumerate(chats.multi_turn(2, seed=7))]
    row = packing.assemble([(e.ids, e.assistant) for e in encoded], 400, eos)
    eos_labels = row["labels"] == eos
    learned = eos_labels & (row["loss_mask"] > 0)
    assert int(learned.sum()) == 6  # 3 replies x 2 conversations end in EOS, all learned
    assert int((eos_labels & (row["loss_mask"] == 0)).sum()) > 100  # the padding's EOS labels are not


# --- packing ---------------------------------------------------------------------------------------
def _first_fit_reference(lengths, capacity):
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, room in enumerate(free):
            if room >= lengths[i]:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def test_first_fit_decreasing_is_first_fit():
    rng = random.Random(0)
    for n in (1, 7, 300):
        lengths = [rng.randint(1, 64) for _ in range(n)]
        rows = packing.first_fit_decreasing(lengths, 64)
        assert rows == _first_fit_reference(lengths, 64)
        assert sorted(i for r in rows for i in r) == list(range(n))


def test_row_layout():
    """Positions restart per conversation, labels shift inside a conversation only, the last token of a
    conversation and the padding predict nothing, cu_seqlens ends each segment; the mask is causal
    inside each segment and closed between them."""
    a = (np.array([5, 6, 7, 8]), np.array([0, 0, 1, 1], bool))
    b = (np.array([9, 10, 11]), np.array([0, 1, 1], bool))
    row = packing.assemble([a, b], 10, 0)
    assert row["tokens"].tolist() == [5, 6, 7, 8, 9, 10, 11, 0, 0, 0]
    assert row["labels"].tolist() == [6, 7, 8, 0, 10, 11, 0, 0, 0, 0]
    assert row["loss_mask"].tolist() == [0, 1, 1, 0, 1, 1, 0, 0, 0, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert row["cu_seqlens"].tolist() == [0, 4, 7, 10] + [10] * 7 and int(row["max_seqlen"]) == 4
    full = packing.assemble([b, a, b], 10, 0)  # no padding: cu_seqlens [0, 3, 7, 10, 10, ...]
    segments = segment_ids(torch.stack([row["cu_seqlens"], full["cu_seqlens"]]), 10)
    assert segments.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]]
    mask = block_causal_mask(segments)[0, 0]
    allowed = [[j for j in range(10) if not mask[i, j]] for i in range(10)]
    assert allowed[3] == [0, 1, 2, 3] and allowed[4] == [4] and allowed[6] == [4, 5, 6] and allowed[9] == [7, 8, 9]


def test_thd_inputs_carry_the_same_segments():
    """On the transformer-engine spec a micro-batch of two rows becomes one row of 2S tokens whose THD
    cu_seqlens bound the same segments the local spec's mask keeps apart (S apart)."""
    from types import SimpleNamespace

    from megatron_ext.sft.attention import packed_inputs

    a = (np.array([5, 6, 7, 8]), np.array([0, 0, 1, 1], bool))
    b = (np.array([9, 10, 11]), np.array([0, 1, 1], bool))
    rows = [packing.assemble([a, b], 10, 0), packing.assemble([b, a, b], 10, 0)]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    te = SimpleNamespace(config=SimpleNamespace(transformer_impl="transformer_engine"))
    local = SimpleNamespace(config=SimpleNamespace(transformer_impl="local"))
    flat, packed = packed_inputs(dict(batch), te, "cpu")
    params = packed["packed_seq_params"]
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 4
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 4, 7, 10, 13, 17, 20]
    assert flat["tokens"].tolist() == [batch["tokens"].view(-1).tolist()] and "attention_mask" not in flat
    assert flat["position_ids"].tolist() == [batch["position_ids"].view(-1).tolist()]
    shown, none = packed_inputs(dict(batch), local, "cpu")
    assert none == {} and shown["attention_mask"].shape == (2, 1, 10, 10)
    ends = params.cu_seqlens_q.tolist()
    for r in range(2):  # the mask's open blocks are exactly the THD segments of that row
        blocks = [(lo - 10 * r, hi - 10 * r) for lo, hi in zip(ends, ends[1:]) if 10 * r <= lo < 10 * (r + 1)]
        for lo, hi in blocks:
            assert not shown["attention_mask"][r, 0, hi - 1, lo:hi].any()
            assert shown["attention_mask"][r, 0, hi - 1, :lo].all() and shown["attention_mask"][r, 0, lo, lo + 1:].all()


# --- (d) refusals, one line each ----------------------------------------------------------------------
STRICT = ("{% for m in messages %}{% if m['role'] == 'system' %}S:{{ m['content'] }}\n{% elif m['role'] == 'user' %}"
          "U:{{ m['content'] }}\n{% elif m['role'] == 'assistant' %}A:{{ m['content'] }}\n{% endif %}{% endfor %}")
ONLY_REPLIES = "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
NO_REPLIES = "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
LAST_THINKS = ("{% for m in messages %}{{ m['role'] }}: {% if loop.last and m['role'] == 'assistant' %}<think></think>"
               "{% endif %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
NO_TOOLS = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}"
            "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
OTHER_PROMPT = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}bot: {% endif %}")
GOOD = {"messages": [{"role": "user", "content": "1 plus 1?"}, {"role": "assistant", "content": "1 + 1 = 2."}]}
TWO_TURNS = {"messages": GOOD["messages"] + [{"role": "user", "content": "And plus 1?"},
                                             {"role": "assistant", "content": "2 + 1 = 3."}]}
NO_REPLY = {"messages": [{"role": "system", "content": "Hi."}, {"role": "user", "content": "1 plus 1?"}]}
TOOL = {"messages": GOOD["messages"][:1] + [{"role": "tool", "content": "2"}] + GOOD["messages"][1:]}
NARRATOR = {"messages": [{"role": "narrator", "content": "Once."}] + GOOD["messages"]}

REFUSALS = {
    "not JSON": ([GOOD, GOOD, '{"messages": [', GOOD], (), r"^--data-path=\S+chat\.jsonl: line 3: not JSON \("),
    "no assistant turn": ([GOOD, NO_REPLY], (), r"^--data-path=\S+: line 2: a conversation with no assistant turn"),
    "unknown role": ([GOOD, NARRATOR], ("--chat-template", STRICT),
                     r"^--data-path=\S+: line 2: unknown role 'narrator' \(message 1\)"),
    "template refuses": ([GOOD, TOOL], ("--chat-template", NO_TOOLS),
                         r"^--data-path=\S+: line 2: the chat template refuses it: no tool turns$"),
    "generation prompt": ([GOOD], ("--chat-template", OTHER_PROMPT),
                          r"^--data-path=\S+: line 1: assistant turn at message 2: the chat template's render up to it "
                          r"does not begin with the render before it and the generation prompt$"),
    "mask covers every token": ([GOOD], ("--chat-template", ONLY_REPLIES),
                                r"^--data-path=\S+: line 1: the assistant mask covers every token"),
    "mask covers none": ([GOOD], ("--chat-template", NO_REPLIES),
                         r"^--data-path=\S+: line 1: the assistant mask covers no token"),
    "not prefix-stable": ([GOOD, TWO_TURNS], ("--chat-template", LAST_THINKS),
                          r"^--data-path=\S+: line 2: assistant turn at message 2: the chat template renders it "
                          r"differently once later turns follow"),
    "empty validation split": ([GOOD] * 20, ("--split", "99,1,0"),
                               r"^--data-path=\S+ \(--split=99,1,0\): the validation split \(0 of 20 lines\) holds no "
                               r"conversation"),
    "mock data": ([GOOD] * 20, ("--mock-data",), r"^--sft with --mock-data"),
    "tokenizer type": ([GOOD] * 20, ("--tokenizer-type", "NullTokenizer", "--vocab-size", "320"),
                       r"^--tokenizer-type=NullTokenizer with --sft"),
    "document flags": ([GOOD] * 20, ("--reset-position-ids",), r"^--reset-position-ids=True with --sft"),
    "multi-token prediction": ([GOOD] * 20, ("--mtp-num-layers", "1"), r"^--mtp-num-layers=1 with --sft"),
    "prompt format": ([GOOD] * 20, ("--tokenizer-type", "SFTTokenizer", "--sft-tokenizer-prompt-format", "chatml"),
                      r"^--sft-tokenizer-prompt-format=chatml: one of nemotron-h-aligned, nemotron-nano-v2, identity, "
                      r"default"),
    "prompt format unread": ([GOOD] * 20, ("--sft-tokenizer-prompt-format", "default"),
                             r"^--sft-tokenizer-prompt-format=default: read only by --tokenizer-type SFTTokenizer"),
    "template with SFTTokenizer": ([GOOD] * 20, ("--tokenizer-type", "SFTTokenizer", "--chat-template", STRICT),
                                   r"^--chat-template with --tokenizer-type=SFTTokenizer"),
    "packed micro-batches on a pipeline": (
        [GOOD] * 20, ("--platform", "cuda", "--assume-te", "--transformer-impl", "transformer_engine", "--world-size", "2",
                      "--pipeline-model-parallel-size", "2"),
        r"^--micro-batch-size=2 with --sft, --transformer-impl=transformer_engine and "
        r"--pipeline-model-parallel-size=2: packed \(THD\)"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_in_one_line(made, tmp_path, case):
    lines, flags, expected = REFUSALS[case]
    data = chats.write_jsonl(tmp_path / "chat.jsonl", lines)
    with pytest.raises(ConfigError, match=expected) as refused:
        parse(*chats.argv(data, made["tokenizer"], "--dry-run", *flags))
    assert "\n" not in str(refused.value)


def test_a_role_the_template_renders_is_accepted(made, tmp_path):
    """ChatML's template renders any role: a tool turn is rendered and stays out of the loss."""
    args, _ = parse(*chats.argv(made["data"], made["tokenizer"], "--dry-run"))
    encoded = template_of(args).encode(TOOL["messages"], 1)
    text = template_of(args).hf.decode(encoded.ids[encoded.assistant].tolist())
    assert text == "1 + 1 = 2.<|im_end|>\n"


def test_refusals_without_a_template_or_file(made, tmp_path):
    bare = chats.make_tokenizer(str(tmp_path / "bare"), template=None)
    with pytest.raises(ConfigError, match=r"^--tokenizer-type=HuggingFaceTokenizer --tokenizer-model=\S+bare: the "
                       r"tokenizer has no chat template: give one with --chat-template"):
        parse(*chats.argv(made["data"], bare, "--dry-run"))
    with pytest.raises(ConfigError, match=r"^--data-path=\S+missing\.jsonl: No such file or directory"):
        parse(*chats.argv(str(tmp_path / "missing.jsonl"), made["tokenizer"], "--dry-run"))


def test_refusal_through_train_dry_run(made, tmp_path, capsys, monkeypatch):
    """train.py's entry point (errors.run around train.main, as its __main__ runs it; the process itself
    is tests/config/test_rules.py's): one line on stderr, exit status 1."""
    import train
    from megatron_ext import errors

    monkeypatch.setenv("RANK", "0")
    data = chats.write_jsonl(tmp_path / "chat.jsonl", [GOOD, "not json"])
    with pytest.raises(SystemExit) as exited:
        errors.run(lambda: train.main(chats.argv(data, made["tokenizer"], "--dry-run")), explain=arguments.explain)
    assert exited.value.code == 1
    assert capsys.readouterr().err == f"error: --data-path={data}: line 2: not JSON (Expecting value at column 1)\n"


# --- what the configuration says -----------------------------------------------------------------------
def test_dry_run_names_the_packed_attention(made):
    """--sft on transformer-engine (a CUDA cluster, checked from here) packs with THD PackedSeqParams;
    on the local spec with the per-conversation mask; the loss is per token in both."""
    args, out = parse(*chats.argv(made["data"], made["tokenizer"], "--dry-run", "--platform", "cuda", "--assume-te",
                                  "--transformer-impl", "transformer_engine"))
    assert args.transformer_impl == "transformer_engine" and args.sft_attention.startswith("thd: ")
    assert "sft_attention" in out and "PackedSeqParams" in out
    assert args.calculate_per_token_loss and args.config_sources["calculate_per_token_loss"].startswith("sft")
    args, out = parse(*chats.argv(made["data"], made["tokenizer"], "--dry-run", "--platform", "cuda", "--assume-no-te"))
    assert args.transformer_impl == "local" and args.sft_attention.startswith("mask: ")


def test_sft_tokenizer_prepares_pretraining_data(made, tmp_path):
    """megatron's SFTTokenizer flags in scripts/prepare_data.py (its --sft-tokenizer-prompt-format was
    missing there): the documents tokenize as the tokenizer does; --sft itself is refused."""
    from scripts import prepare_data

    source = chats.write_jsonl(tmp_path / "docs.jsonl", [{"text": "12 plus 5 is 17."}] * 3)
    out = prepare_data.main(["--input", source, "--output-prefix", str(tmp_path / "docs"), "--tokenizer-type",
                             "SFTTokenizer", "--tokenizer-model", made["tokenizer"], "--sft-tokenizer-prompt-format",
                             "default", "--append-eod"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(made["tokenizer"])
    assert out["documents"] == 3 and out["eod"] == tok.eos_token_id
    assert out["tokens"] == 3 * (len(tok("12 plus 5 is 17.")["input_ids"]) + 1)
    with pytest.raises(SystemExit):
        prepare_data.main(["--input", source, "--output-prefix", str(tmp_path / "x"), "--sft"])
