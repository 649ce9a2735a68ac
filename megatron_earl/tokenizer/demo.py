"""The project's demo tokenizer: self-contained, byte-level with a few whole-word pieces.

Vocabulary (< 512 ids): 8 special tokens (pad, eos, ``<|im_start|>``, ``<|im_end|>``,
``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``), the 256 byte
values (any text round-trips), then whole-word pieces that keep the demo environments' turns
short (role names, the calculator call's JSON skeleton, game words). Encoding is greedy
longest-match over special tokens and pieces, falling back to UTF-8 bytes. Chat template
(ChatML without a default system prompt):

    <|im_start|>{role}\\n{content}<|im_end|>\\n

A tiny CPU model can learn arithmetic with the calculator tool in this vocabulary: digits and
operators are one token each, a tool call is ~10 tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from megatron_earl.tokenizer.base import ChatTokenizer, Message, check_roles

SPECIAL_TOKENS = (
    "<|pad|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
"""Special tokens, ids 0..7 in this order."""

WORD_PIECES = (
    "system",
    "user",
    "assistant",
    "tool",
    '{"name": "',
    '", "arguments": {',
    '"expression": "',
    '"code": "',
    '"}}',
    "calculator",
    "python",
    "print(",
    "answer",
    "guess",
    "higher",
    "lower",
    "correct",
    "invalid",
    "error",
    "between",
    "range(",
    "sum(",
    "for ",
    " in ",
)
"""Multi-character pieces, ids 264.. in this order."""

NUM_BYTES = 256


class DemoTokenizer(ChatTokenizer):
    """Byte-level tokenizer with ChatML specials and demo word pieces (vocab 288, padded to 320)."""

    def __init__(self) -> None:
        pieces = list(SPECIAL_TOKENS) + list(WORD_PIECES)
        self._piece_to_id = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
        base = len(SPECIAL_TOKENS) + NUM_BYTES
        self._piece_to_id.update({t: base + i for i, t in enumerate(WORD_PIECES)})
        self._id_to_bytes: list[bytes] = [t.encode() for t in SPECIAL_TOKENS]
        self._id_to_bytes += [bytes([b]) for b in range(NUM_BYTES)]
        self._id_to_bytes += [t.encode() for t in WORD_PIECES]
        alternation = "|".join(re.escape(p) for p in sorted(pieces, key=len, reverse=True))
        self._pattern = re.compile(f"({alternation})|(.)", re.DOTALL)
        self._num_real = len(self._id_to_bytes)

    @property
    def vocab_size(self) -> int:
        # Padded to a multiple of 64 (Megatron pads the embedding anyway); ids >= the real
        # vocabulary decode to nothing.
        return (self._num_real + 63) // 64 * 64

    @property
    def eos_id(self) -> int:
        return 1

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def im_start_id(self) -> int:
        return 2

    @property
    def im_end_id(self) -> int:
        return 3

    @property
    def end_of_turn_id(self) -> int:
        return self.im_end_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.im_end_id, self.eos_id)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for m in self._pattern.finditer(text):
            if m.group(1) is not None:
                ids.append(self._piece_to_id[m.group(1)])
            else:
                ids.extend(len(SPECIAL_TOKENS) + b for b in m.group(2).encode())
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        out = bytearray()
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside the vocabulary [0, {self.vocab_size})")
            if i >= self._num_real or (skip_special and i < len(SPECIAL_TOKENS)):
                continue
            out += self._id_to_bytes[i]
        return out.decode("utf-8", errors="replace")

    def render_turn(self, role: str, content: str) -> list[int]:
        return [
            self.im_start_id,
            *self.encode(f"{role}\n{content}"),
            self.im_end_id,
            *self.end_of_turn_suffix(),
        ]

    def generation_prompt(self) -> list[int]:
        return [self.im_start_id, *self.encode("assistant\n")]

    def end_of_turn_suffix(self) -> list[int]:
        return self.encode("\n")

    def render_messages(
        self, messages: Sequence[Message], add_generation_prompt: bool
    ) -> list[int]:
        check_roles(messages)
        ids = [t for m in messages for t in self.render_turn(m["role"], m["content"])]
        return ids + self.generation_prompt() if add_generation_prompt else ids
