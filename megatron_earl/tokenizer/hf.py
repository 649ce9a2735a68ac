"""HF tokenizers from a local directory (``transformers``, optional), with the HF chat template
rendered one turn at a time.

The template is a whole-conversation Jinja program; the agent loop needs it per turn. We recover
the pieces by differencing renders of a fixed context (system, user, assistant):

    render_turn(role, c) = tmpl(ctx + [{role, c}]) - tmpl(ctx)              (text diff, encoded)
    generation_prompt()  = tmpl(ctx[:2], add_generation_prompt) - tmpl(ctx[:2])
    end_of_turn_suffix() = text after the assistant's end-of-turn token in tmpl(ctx)

Templates whose rendering of a message depends on later messages (e.g. ones that drop the
reasoning of earlier assistant turns) are not prefix-stable; ``HFTokenizer`` checks that the
diff is a true prefix extension and raises naming the template otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_earl.compat.optional import has_package
from megatron_earl.tokenizer.base import ChatTokenizer, Message, check_roles

_CTX: list[Message] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]


class HFTokenizer(ChatTokenizer):
    """Wraps a ``transformers`` tokenizer that has a chat template."""

    def __init__(self, tokenizer: Any, extra_stop_tokens: Sequence[str] = ("<|im_end|>",)) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template")
        self._tok = tokenizer
        stops = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        vocab = tokenizer.get_vocab()
        stops += [vocab[t] for t in extra_stop_tokens if t in vocab and vocab[t] not in stops]
        if not stops:
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r} has no eos token and none of "
                f"{list(extra_stop_tokens)}: give the end-of-turn token in extra_stop_tokens"
            )
        self._stop_ids = tuple(stops)
        base = self._template(_CTX, False)
        stop_texts = [tokenizer.convert_ids_to_tokens(i) for i in self._stop_ids]
        ends = [base.rfind(t) + len(t) for t in stop_texts]
        cut = max(ends)
        self._end_of_turn = self._stop_ids[ends.index(cut)]
        if cut <= 0 or base.rfind("A") > cut:
            raise ValueError(
                f"chat template of {tokenizer.name_or_path!r} does not end an assistant turn "
                f"with any of {stop_texts}"
            )
        self._suffix = self.encode(base[cut:])
        prompt = self._template(_CTX[:2], False)
        self._gen = self.encode(self._diff(prompt, self._template(_CTX[:2], True)))
        self.render_turn("tool", "probe")  # fails early on a template that is not prefix-stable

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> HFTokenizer:
        """Load from a local directory (no network access is attempted)."""
        if not has_package("transformers"):
            raise ImportError("HFTokenizer needs `transformers`: pip install transformers")
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path, local_files_only=True), **kwargs)

    def _template(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return self._tok.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _diff(self, before: str, after: str) -> str:
        if not after.startswith(before):
            raise ValueError(
                f"chat template of {self._tok.name_or_path!r} is not prefix-stable: rendering "
                f"one more message changed the earlier text ({before[-40:]!r} -> "
                f"{after[: len(before)][-40:]!r}); turn-by-turn rendering needs a stable template"
            )
        return after[len(before) :]

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_id(self) -> int:
        return self._stop_ids[0]

    @property
    def pad_id(self) -> int:
        pad = self._tok.pad_token_id
        return self.eos_id if pad is None else pad

    @property
    def end_of_turn_id(self) -> int:
        return self._end_of_turn

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def render_turn(self, role: str, content: str) -> list[int]:
        msg = {"role": role, "content": content}
        return self.encode(
            self._diff(self._template(_CTX, False), self._template([*_CTX, msg], False))
        )

    def generation_prompt(self) -> list[int]:
        return list(self._gen)

    def end_of_turn_suffix(self) -> list[int]:
        return list(self._suffix)

    def render_messages(
        self, messages: Sequence[Message], add_generation_prompt: bool
    ) -> list[int]:
        check_roles(messages)
        return self.encode(self._template(messages, add_generation_prompt))
