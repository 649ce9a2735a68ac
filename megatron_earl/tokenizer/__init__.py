"""Tokenizers for the agent loop: one interface (``ChatTokenizer``), the self-contained demo
tokenizer and HF tokenizers (optional ``transformers``). ``build_tokenizer("demo")`` or
``build_tokenizer("/path/to/hf/dir")``."""

from __future__ import annotations

from megatron_earl.tokenizer.base import ChatTokenizer, Message
from megatron_earl.tokenizer.demo import DemoTokenizer


def build_tokenizer(name_or_path: str) -> ChatTokenizer:
    """``"demo"`` -> ``DemoTokenizer``; anything else is a local HF tokenizer directory."""
    if name_or_path == "demo":
        return DemoTokenizer()
    from megatron_earl.tokenizer.hf import HFTokenizer

    return HFTokenizer.from_pretrained(name_or_path)


__all__ = ["ChatTokenizer", "DemoTokenizer", "Message", "build_tokenizer"]
