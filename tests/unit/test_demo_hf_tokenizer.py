"""The demo tokenizer's Hugging Face twin (``tokenizer.demo_hf``, used by the TRL side of
``bench peer``) encodes and decodes exactly like ``DemoTokenizer``: the environments' rendered
prompts and whole demonstrations, text with every piece boundary case, random id sequences; the
prompt texts TRL is given tokenize to the ids our agent loop renders.

Run: python -m pytest -q -p no:warnings tests/unit/test_demo_hf_tokenizer.py
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from megatron_earl.envs import ENVS
from megatron_earl.tokenizer.demo import SPECIAL_TOKENS, WORD_PIECES, DemoTokenizer
from megatron_earl.tokenizer.demo_hf import byte_symbols, demo_hf_tokenizer

DEMO = DemoTokenizer()
ENV_NAMES = ("arithmetic", "guessing", "python_sum", "longtail")


@pytest.fixture(scope="module")
def hf():
    return demo_hf_tokenizer()


def _conversations():
    for name in ENV_NAMES:
        env = ENVS.build(name)
        for seed in range(25):
            yield name, seed, env.demonstration(seed)


def test_byte_symbols_are_distinct_single_characters():
    symbols = byte_symbols()
    assert len(set(symbols)) == 256 and all(len(s) == 1 for s in symbols)
    assert symbols[ord("a")] == "a" and symbols[ord(" ")] != " "


def test_ids_and_specials(hf):
    assert len(hf) == DEMO.vocab_size == 320
    assert (hf.pad_token_id, hf.eos_token_id) == (DEMO.pad_id, DEMO.end_of_turn_id)
    assert hf.padding_side == "left"
    for token in (*SPECIAL_TOKENS, *WORD_PIECES):
        assert hf.convert_tokens_to_ids(token) == DEMO.token_id(token), token


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendered_conversations_encode_identically(hf, generation_prompt):
    for name, seed, messages in _conversations():
        for end in range(1, len(messages) + 1):
            ids = DEMO.render_messages(messages[:end], add_generation_prompt=generation_prompt)
            text = DEMO.decode(ids)
            got = hf(text, add_special_tokens=False)["input_ids"]
            assert got == ids, (name, seed, end, text)
            assert hf.decode(got) == text


def test_boundary_texts_encode_identically(hf):
    texts = [
        "",
        "userassistant usersystem",
        "for  in range(sum(print(",
        '{"name": "{"name": ""}}"}}',
        "<|im_start|<|im_start|><tool_call</tool_call>",
        "é漢字 \t\n\r\x00 ~\x7f",
        "calculatorcalculator toolx tool",
    ]
    for text in texts:
        assert hf(text, add_special_tokens=False)["input_ids"] == DEMO.encode(text), text


def test_random_text_and_ids_round_trip_identically(hf):
    rng = random.Random(0)
    alphabet = [*"0123456789+-*/() \n", "é", "漢", *SPECIAL_TOKENS, *WORD_PIECES]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        assert hf(text, add_special_tokens=False)["input_ids"] == DEMO.encode(text), text
    for _ in range(200):
        ids = [rng.randrange(DEMO.vocab_size) for _ in range(rng.randint(1, 40))]
        assert hf.decode(ids, skip_special_tokens=True) == DEMO.decode(ids, skip_special=True)


def test_trl_prompt_ids_are_ours():
    from megatron_earl.bench.peer_trl import prompt_texts
    from megatron_earl.bench.peer_workload import WORKLOADS, PeerSettings, workload_config

    workload = WORKLOADS["multi-turn-tool"]
    settings = PeerSettings.from_run(workload_config("configs/demo_cpu.yaml", workload), workload)
    seeds = list(range(40))
    texts = prompt_texts(settings, seeds, DEMO)
    env = ENVS.build(settings.env)
    for seed, ids in zip(seeds, demo_hf_tokenizer()(texts)["input_ids"], strict=True):
        prompt, _ = env.make_task(seed)
        assert ids == DEMO.render_messages(prompt, add_generation_prompt=True), seed
