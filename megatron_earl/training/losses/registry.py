"""Registry of policy losses by name: ``@register_loss`` on a ``PolicyLoss`` subclass makes its
``name`` a valid ``PolicyLossConfig.loss_type``; ``build_loss(config)`` picks it (once, at the
start of a train step)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_earl.config.loss import PolicyLossConfig
    from megatron_earl.training.losses.base import PolicyLoss

_REGISTRY: dict[str, type[PolicyLoss]] = {}


def register_loss(cls: type[PolicyLoss]) -> type[PolicyLoss]:
    """Class decorator: register ``cls`` under ``cls.name`` (unique)."""
    name = cls.name
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"policy loss {name!r} is already registered by {_REGISTRY[name]}")
    _REGISTRY[name] = cls
    return cls


def available_losses() -> tuple[str, ...]:
    """Registered loss names, sorted."""
    return tuple(sorted(_REGISTRY))


def registered_loss(loss_type: str) -> type[PolicyLoss]:
    """The class registered as ``loss_type``."""
    if loss_type not in _REGISTRY:
        raise ValueError(f"loss_type={loss_type!r}; valid: {available_losses()}")
    return _REGISTRY[loss_type]


def build_loss(config: PolicyLossConfig) -> PolicyLoss:
    """The registered loss ``config.loss_type``, configured by ``config``."""
    return registered_loss(config.loss_type)(config)
