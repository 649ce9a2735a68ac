"""The demo tokenizer as a Hugging Face fast tokenizer (same ids), for HF-side tools (TRL).

    tok = demo_hf_tokenizer()                      # transformers.PreTrainedTokenizerFast
    tok("<|im_start|>user\\n3+4*2<|im_end|>\\n")["input_ids"] == DemoTokenizer().encode(...)

Built with ``tokenizers`` from the demo vocabulary (``tokenizer.demo``): the special tokens and
the word pieces are *added tokens* (matched leftmost-longest before the model runs, which is the
demo tokenizer's greedy longest match over the same strings), every other character falls back
to its UTF-8 bytes through a byte-level BPE without merges (byte ``b`` is id 8 + b, as in the
demo). Ids from the real vocabulary (288) up to the padded model vocabulary (320) are special
placeholders ``<|unused_K|>``: the demo tokenizer decodes them to nothing, so does this one with
``skip_special_tokens=True``. ``tests/unit/test_demo_hf_tokenizer.py`` checks that both encode
and decode the environments' prompts and random id sequences identically. Needs
``transformers`` (the ``[hf]`` extra).
"""

from __future__ import annotations

from megatron_earl.tokenizer.demo import NUM_BYTES, SPECIAL_TOKENS, WORD_PIECES, DemoTokenizer


def byte_symbols() -> list[str]:
    """The printable character standing for each byte value in a byte-level BPE vocabulary
    (GPT-2's convention, which ``tokenizers``' ``ByteLevel`` pre-tokenizer and decoder use):
    printable Latin-1 bytes stand for themselves, the others are shifted past 255 in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols: dict[int, str] = {b: chr(b) for b in keep}
    shift = 0
    for b in range(NUM_BYTES):
        if b not in symbols:
            symbols[b] = chr(256 + shift)
            shift += 1
    return [symbols[b] for b in range(NUM_BYTES)]


def demo_hf_tokenizer():
    """A ``PreTrainedTokenizerFast`` with the demo tokenizer's ids: pad ``<|pad|>`` (0), eos
    ``<|im_end|>`` (3, the end of an assistant turn, which TRL stops generation on), left
    padding (what TRL's GRPOTrainer requires)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    demo = DemoTokenizer()
    # Every id lives in the BPE model's vocabulary (so the ids are the demo's); adding the
    # special tokens and word pieces as added tokens (which reuse an id already in the
    # vocabulary) makes them match before the byte fallback.
    padded = [f"<|unused_{i}|>" for i in range(demo._num_real, demo.vocab_size)]
    first_byte = len(SPECIAL_TOKENS)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({s: first_byte + b for b, s in enumerate(byte_symbols())})
    vocab.update({t: first_byte + NUM_BYTES + i for i, t in enumerate([*WORD_PIECES, *padded])})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *padded)]
    )
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in WORD_PIECES])
    expected = {t: demo.token_id(t) for t in (*SPECIAL_TOKENS, *WORD_PIECES)}
    got = {t: backend.token_to_id(t) for t in expected}
    if got != expected:
        raise RuntimeError(f"tokenizers numbered the demo pieces {got}, expected {expected}")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        padding_side="left",
        model_max_length=1 << 20,
    )
