"""The tokenizer interface the agent loop uses: encode/decode plus turn-by-turn chat rendering.

The agent loop never re-tokenizes model output. It renders the prompt once
(``render_messages``), keeps the sampled ids of every model turn, and appends each observation
as ``end_of_turn_suffix() + render_turn(role, text) + generation_prompt()``, tokenized once.
A tokenizer therefore exposes its chat template piecewise:

    prompt      = render_messages([...], add_generation_prompt=True)
    model turn  = sampled ids, ending with one of ``stop_ids`` (kept)
    observation = end_of_turn_suffix() + render_turn("tool", text) + generation_prompt()

so that ``prompt + turn + observation + turn ...`` equals the template rendering of the whole
conversation (tested for both implementations in ``tests/unit/test_tokenizer.py``).
Implementations: ``DemoTokenizer`` (self-contained, vocab < 512) and ``HFTokenizer``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

Message = dict[str, str]
"""One chat message: ``{"role": ..., "content": ...}``."""


class ChatTokenizer(ABC):
    """Encode/decode and a chat template that can be rendered one turn at a time."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (max id + 1)."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """End-of-sequence id."""

    @property
    @abstractmethod
    def pad_id(self) -> int:
        """Padding id."""

    @property
    @abstractmethod
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a model turn (end-of-turn and eos); the matched id stays in the output."""

    @property
    @abstractmethod
    def end_of_turn_id(self) -> int:
        """The stop id the chat template closes an assistant turn with (e.g. ``<|im_end|>``)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in the text become their special ids."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; special tokens are written as their strings unless skipped."""

    @abstractmethod
    def render_turn(self, role: str, content: str) -> list[int]:
        """Ids of one complete turn (``role`` says who speaks) including the separator the
        template writes after it, as rendered after an assistant turn and its suffix."""

    @abstractmethod
    def generation_prompt(self) -> list[int]:
        """Ids that open an assistant turn (the model continues after them)."""

    @abstractmethod
    def end_of_turn_suffix(self) -> list[int]:
        """Ids the template puts after an assistant turn's stop token (e.g. a newline)."""

    @abstractmethod
    def render_messages(
        self, messages: Sequence[Message], add_generation_prompt: bool
    ) -> list[int]:
        """Ids of a whole conversation (the prompt), as the chat template renders it."""

    def token_id(self, token: str) -> int:
        """Id of a single (special) token string; raises ``KeyError`` naming it when absent."""
        ids = self.encode(token)
        if len(ids) != 1:
            raise KeyError(f"{token!r} is not a single token (encodes to {ids})")
        return ids[0]


def check_roles(messages: Sequence[Message]) -> None:
    """Raise ``ValueError`` naming the bad message when a message lacks role/content strings."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a 'role' string, got {m!r}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must have a 'content' string, got {m!r}")
