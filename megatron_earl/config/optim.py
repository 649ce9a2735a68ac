"""``OptimConfig``: the optimizer settings (Megatron ``OptimizerConfig`` subset) that
``training.setup.build_optimizer`` reads; the run config's ``train`` section extends it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer settings (Megatron ``OptimizerConfig`` subset used by RL post-training)."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the learning-rate schedule."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (Megatron's distributed optimizer, ZeRO-1)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0, got {self.clip_grad}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError(
                f"adam betas must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}"
            )
