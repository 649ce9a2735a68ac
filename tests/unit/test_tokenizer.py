"""Tokenizers: the demo tokenizer (vocabulary, round trips, ChatML template) and HF tokenizers
(a tiny BPE tokenizer built offline with ``tokenizers``, loaded through ``transformers``): the
turn-by-turn rendering the agent loop uses equals the chat template's whole-conversation text.

Run: python -m pytest -q -p no:warnings tests/unit/test_tokenizer.py
"""

from __future__ import annotations

import pytest

from megatron_earl.compat.optional import has_package
from megatron_earl.rollout.agent import assistant_turn_ids
from megatron_earl.tokenizer import DemoTokenizer, build_tokenizer
from megatron_earl.tokenizer.demo import SPECIAL_TOKENS

CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "3+4*2"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "3+4*2"}}'
        "</tool_call>",
    },
    {"role": "tool", "content": "<tool_response>11</tool_response>"},
    {"role": "assistant", "content": "11"},
]


def chatml_text(messages, add_generation_prompt=False) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def turn_by_turn(tok, messages) -> list[int]:
    """What the agent loop builds: prompt, then sampled turns and observations."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = tok.render_messages(messages[:first], add_generation_prompt=True)
    for i, m in enumerate(messages[first:], start=first):
        if m["role"] == "assistant":
            ids += assistant_turn_ids(m["content"], tok)
            if i + 1 < len(messages):
                ids += tok.end_of_turn_suffix()
        else:
            ids += tok.render_turn(m["role"], m["content"]) + tok.generation_prompt()
    return ids


def test_demo_vocabulary():
    tok = DemoTokenizer()
    assert tok.vocab_size <= 512 and tok.vocab_size % 64 == 0
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.encode(special) == [i] and tok.token_id(special) == i
    assert (tok.pad_id, tok.eos_id, tok.end_of_turn_id) == (0, 1, 3)
    assert tok.stop_ids == (3, 1)
    assert [tok.decode([t]) for t in tok.encode("3+4*2")] == list("3+4*2")  # one token each
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "3+4*2"}}</tool_call>'
    assert len(tok.encode(call)) == 12


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "héllo ✓ 漢字",
        "<|im_start|>user\nx",
        "guess higher lower 1-15",
        "\x00\xff",
    ],
)
def test_demo_round_trip(text):
    tok = DemoTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_demo_decode_skip_special_and_bad_ids():
    tok = DemoTokenizer()
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special=True) == "hi"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_demo_template_turn_by_turn_equals_whole():
    tok = DemoTokenizer()
    assert tok.render_messages(CONVERSATION, False) == tok.encode(chatml_text(CONVERSATION))
    assert tok.render_messages(CONVERSATION[:2], True) == tok.encode(
        chatml_text(CONVERSATION[:2], True)
    )
    assert turn_by_turn(tok, CONVERSATION) + tok.end_of_turn_suffix() == tok.encode(
        chatml_text(CONVERSATION)
    )
    with pytest.raises(ValueError, match="message 0 must have a 'content' string"):
        tok.render_messages([{"role": "user"}], True)


CHATML_JINJA = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    if not (has_package("transformers") and has_package("tokenizers")):
        pytest.skip("transformers/tokenizers not installed: pip install transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [chatml_text(CONVERSATION)] * 4 + ["the quick brown fox 0123456789 +-*/ {}"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML_JINJA
    path = tmp_path_factory.mktemp("hf_tok")
    fast.save_pretrained(path)
    return str(path)


def test_hf_turn_by_turn_equals_template(hf_dir):
    tok = build_tokenizer(hf_dir)
    im_end = tok.token_id("<|im_end|>")
    assert tok.end_of_turn_id == im_end and im_end in tok.stop_ids
    assert tok.decode(tok.end_of_turn_suffix()) == "\n"
    assert tok.decode(tok.generation_prompt()) == "<|im_start|>assistant\n"
    whole = tok.encode(chatml_text(CONVERSATION))
    assert turn_by_turn(tok, CONVERSATION) + tok.end_of_turn_suffix() == whole
    assert tok.decode(tok.render_turn("tool", "r")) == "<|im_start|>tool\nr<|im_end|>\n"
    assert tok.decode(tok.encode("3+4*2 héllo")) == "3+4*2 héllo"


def test_hf_rejects_unstable_template(hf_dir):
    from transformers import AutoTokenizer

    from megatron_earl.tokenizer.hf import HFTokenizer

    raw = AutoTokenizer.from_pretrained(hf_dir)
    # Renders only the last message: rendering one more message rewrites the earlier text.
    raw.chat_template = (
        "{% set m = messages[-1] %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="not prefix-stable"):
        HFTokenizer(raw)
    raw.chat_template = None
    with pytest.raises(ValueError, match="has no chat_template"):
        HFTokenizer(raw)
