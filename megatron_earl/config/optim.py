"""``OptimConfig``: the optimizer and learning-rate schedule settings (Megatron
``OptimizerConfig`` subset and ``OptimizerParamScheduler`` arguments) that
``training.setup.build_optimizer`` / ``build_lr_scheduler`` read; the run config's ``train``
section extends it. Schedule lengths count optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZERS = ("adam", "sgd")
"""Optimizers of Megatron-Core's ``get_megatron_optimizer`` this project builds."""
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
"""Decay styles of Megatron-Core's ``OptimizerParamScheduler``."""
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
"""Styles of the decay phase of a WSD schedule."""


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
    optimizer: str = "adam"
    """``adam`` (AdamW, decoupled weight decay) or ``sgd`` (with ``sgd_momentum``)."""
    sgd_momentum: float = 0.9
    """Momentum of SGD."""
    lr_decay_style: str = "constant"
    """Learning-rate schedule after warm-up: constant, linear, cosine, inverse-square-root, WSD
    (Megatron-Core's ``OptimizerParamScheduler``)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from ``lr_warmup_init`` to ``lr``."""
    lr_warmup_fraction: float | None = None
    """Warm-up as a fraction of ``lr_decay_steps`` (instead of ``lr_warmup_steps``)."""
    lr_warmup_init: float = 0.0
    """Learning rate at the first warm-up step."""
    lr_decay_steps: int | None = None
    """Optimizer steps over which the rate decays to ``min_lr`` (None: the whole run,
    ``steps x batch.num_mini_batches``)."""
    lr_wsd_decay_style: str = "exponential"
    """Decay phase of a WSD schedule: exponential, linear, cosine, minus_sqrt."""
    lr_wsd_decay_steps: int | None = None
    """Optimizer steps of the WSD decay phase (required with lr_decay_style WSD)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0, got {self.clip_grad}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError(
                f"adam betas must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {OPTIMIZERS}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(
                f"lr_decay_style {self.lr_decay_style!r} is not one of {LR_DECAY_STYLES}"
            )
        if self.lr_wsd_decay_style not in LR_WSD_DECAY_STYLES:
            raise ValueError(
                f"lr_wsd_decay_style {self.lr_wsd_decay_style!r} is not one of "
                f"{LR_WSD_DECAY_STYLES}"
            )
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_steps is None:
            raise ValueError("lr_decay_style WSD needs lr_wsd_decay_steps")
        if self.lr_warmup_steps and self.lr_warmup_fraction is not None:
            raise ValueError(
                f"lr_warmup_steps ({self.lr_warmup_steps}) and lr_warmup_fraction "
                f"({self.lr_warmup_fraction}) both set: give one"
            )
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction < 1:
            raise ValueError(f"lr_warmup_fraction must be in [0, 1), got {self.lr_warmup_fraction}")
        if self.lr_warmup_steps < 0 or (
            self.lr_decay_steps is not None and self.lr_decay_steps < 1
        ):
            raise ValueError(
                f"lr_warmup_steps ({self.lr_warmup_steps}) must be >= 0 and lr_decay_steps "
                f"({self.lr_decay_steps}) >= 1"
            )
        if not 0 <= self.min_lr <= self.lr or not 0 <= self.lr_warmup_init <= self.lr:
            raise ValueError(
                f"min_lr ({self.min_lr}) and lr_warmup_init ({self.lr_warmup_init}) must be in "
                f"[0, lr ({self.lr})]"
            )
