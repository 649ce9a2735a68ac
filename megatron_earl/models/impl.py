"""Which layer implementation a model is built with: Transformer Engine's or the local spec
(``model.transformer_impl``), decided from the machine's facts, and why a configured choice cannot
run here. Imports no Megatron code, so the start-up checks (``cli.train.check_run``) stay cheap.
"""

from __future__ import annotations

import dataclasses

from megatron_earl import runtime
from megatron_earl.compat.optional import has_transformer_engine
from megatron_earl.config.model import ModelConfig
from megatron_earl.config.vocab import TransformerImpl


def resolve_transformer_impl(
    requested: TransformerImpl | str,
    *,
    te_importable: bool,
    cuda: bool,
    embedded_engine: bool = False,
) -> TransformerImpl:
    """The layer implementation a model is built with (pure; the machine's facts are arguments).

    "auto" is Transformer Engine when it is importable and the compute device is CUDA, except for a
    model the embedded engine generates with (its slot KV cache needs an explicit attention mask,
    which Megatron's TE attention drops outside the first prefill); otherwise local. An explicit
    choice is returned as is: whether it can run is checked at start-up
    (``transformer_impl_problems``).
    """
    requested = TransformerImpl(requested)
    if requested != TransformerImpl.AUTO:
        return requested
    if te_importable and cuda and not embedded_engine:
        return TransformerImpl.TRANSFORMER_ENGINE
    return TransformerImpl.LOCAL


def machine_facts() -> dict[str, bool]:
    """What the implementation choice depends on here: TE importable, device policy on CUDA."""
    return {
        "te_importable": has_transformer_engine(),
        "cuda": runtime.policy().device.type == "cuda",
    }


def machine_transformer_impl(
    model: ModelConfig, *, embedded_engine: bool = False
) -> TransformerImpl:
    """``resolve_transformer_impl`` on this machine."""
    return resolve_transformer_impl(
        model.transformer_impl, embedded_engine=embedded_engine, **machine_facts()
    )


def transformer_impl_problems(
    model: ModelConfig, *, te_importable: bool, cuda: bool, embedded_engine: bool
) -> list[str]:
    """Why ``model`` cannot be built as configured on a machine with these facts (pure; empty when
    it can): Transformer Engine requested without the package, without CUDA, or with the embedded
    engine; a TE-only option (``cp_comm_type``) on the local implementation."""
    impl = resolve_transformer_impl(
        model.transformer_impl,
        te_importable=te_importable,
        cuda=cuda,
        embedded_engine=embedded_engine,
    )
    problems = []
    if impl == TransformerImpl.TRANSFORMER_ENGINE:
        if not te_importable:
            problems.append(
                "model.transformer_impl='transformer_engine' needs the transformer_engine package, "
                'which is not importable: pip install -e ".[te]" (on a CUDA machine), or set '
                "model.transformer_impl=auto or local"
            )
        if not cuda:
            problems.append(
                "model.transformer_impl='transformer_engine' needs a CUDA device (Transformer "
                "Engine's kernels are CUDA-only) and the device policy has none; set "
                "model.transformer_impl=auto or local"
            )
        if embedded_engine:
            problems.append(
                "model.transformer_impl='transformer_engine' cannot generate on the embedded "
                "engine (rollout.engine=embedded): its slot KV cache needs an explicit attention "
                "mask, which Megatron's TE attention drops; set model.transformer_impl=auto or "
                "local, or rollout.engine=sglang"
            )
    elif model.cp_comm_type is not None:
        problems.append(
            f"model.cp_comm_type={model.cp_comm_type!r} is a Transformer Engine option (TE's "
            f"context-parallel attention), but model.transformer_impl="
            f"{model.transformer_impl.value!r} resolves to 'local' here (transformer_engine "
            f"importable: {te_importable}, CUDA: {cuda}, embedded engine: {embedded_engine}), "
            "whose context-parallel attention always all-gathers K/V; unset model.cp_comm_type, "
            + (
                "or use rollout.engine=sglang (the embedded engine generates with local)"
                if embedded_engine
                else 'or install Transformer Engine (pip install -e ".[te]") on a CUDA machine'
            )
        )
    return problems


def pin_transformer_impl(model: ModelConfig, *, embedded_engine: bool) -> ModelConfig:
    """``model`` with "auto" replaced by what it resolves to on this machine; call once where a
    run starts (``RLLoop``, the engine server), so every model of the run is built the same way and
    one the embedded engine generates with is local."""
    impl = machine_transformer_impl(model, embedded_engine=embedded_engine)
    return dataclasses.replace(model, transformer_impl=impl)
