"""The local spec's RMSNorms: ``torch.nn.RMSNorm`` as Megatron's ``WrappedTorchNorm`` builds it,
usable under sequence parallelism.

Megatron-Core 0.16's ``WrappedTorchNorm`` refuses ``config.sequence_parallel`` (only TE's and
Apex's norms mark their weights for it). Under sequence parallelism a norm over hidden states sees
1/tp of the sequence on each TP rank, so its weight's gradient is partial: ``HiddenRMSNorm`` marks
the weight ``sequence_parallel = True`` and Megatron's ``finalize_model_grads`` sums it over the
TP group, as it does for TE's norms. ``HeadRMSNorm`` (q/k layernorm, over the head dimension)
sees the whole sequence after the QKV projection's all-gather; Megatron sums its gradient over TP
by name (``qk_layernorm``), with or without sequence parallelism, so it is left unmarked.

Both return a plain ``torch.nn.RMSNorm`` (what the embedded engine's batched forward reads).
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig


def _rms_norm(config: TransformerConfig, hidden_size: int, eps: float) -> torch.nn.RMSNorm:
    if config.normalization != "RMSNorm":
        raise ValueError(
            f"normalization {config.normalization!r}: the local spec's norms here are RMSNorm only"
        )
    if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
        raise ValueError(
            "layernorm_zero_centered_gamma / memory_efficient_layer_norm are not supported by "
            "torch.nn.RMSNorm (the local spec's norm); use the Transformer Engine spec"
        )
    return torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)


class HeadRMSNorm:
    """A q/k layernorm over the head dimension (Qwen3); never marked for sequence parallelism.
    Megatron's norm-module signature (the unused arguments are Megatron's)."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> torch.nn.RMSNorm:
        return _rms_norm(config, hidden_size, eps)


class HiddenRMSNorm(HeadRMSNorm):
    """A norm over hidden states (input, pre-MLP and final layernorm): ``HeadRMSNorm``'s, its
    weight marked for Megatron's TP reduction under sequence parallelism."""

    def __new__(cls, config: TransformerConfig, *args, **kwargs) -> torch.nn.RMSNorm:
        norm = super().__new__(cls, config, *args, **kwargs)
        if config.sequence_parallel:
            norm.weight.sequence_parallel = True
        return norm
