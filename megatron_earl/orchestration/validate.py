"""Start-up validation of a ``RunConfig`` against the job and the components: pure, run before any
process group.

    cfg = load_config(path, overrides)      # unknown keys, wrong types, per-section values
    validate_run(cfg, world_size=4)         # layouts vs world size and model, paths, env, ...

``config/`` is a leaf and cannot see the components, so every check that needs one lives here:
layouts (``ParallelLayout``), the registries of environments and advantage estimators, and the
tokenizer.

``validate_run`` takes the world size as an argument (the launcher reads it from ``WORLD_SIZE``
before ``torch.distributed`` is touched) and raises ONE ``ConfigError`` naming every problem:

- each phase's layout must be a valid ``ParallelLayout``, multiply to the world size and fit the
  model (heads, query groups, FFN, padded vocab divisible by tp; layers by pp x vpp); the nearest
  valid layout is suggested;
- every data-parallel rank of the experience and train layouts needs at least one sample;
- ``checkpoint.load`` and a local ``tokenizer`` directory must exist;
- the environment must be registered (or a dotted path that imports) and construct with
  ``env.kwargs`` (an unknown keyword or a wrong type is named here);
- the advantage estimator must be registered and accept ``train.advantage_kwargs``;
- the policy loss (``train.loss.loss_type``) must be registered;
- the demo tokenizer's vocabulary must fit ``model.vocab_size``;
- group baselines (grpo, rloo) need ``batch.samples_per_prompt >= 2``;
- a KL term (``train.loss.kl_coef > 0``) keeps the reference policy in the fixed experience
  layout, so the selector may not choose the experience layout;
- a mixture-of-experts model (``model.num_experts``) runs on the embedded engine (megatron-core's
  MoE layers in its forward) with fixed phase layouts: the rollout layout at ep 1, the
  experience and train layouts with expert groups inside the TP x CP group (ep x etp divides
  tp x cp: every rank of an expert group holds the same micro-batches). Refused otherwise, each
  naming why (docs/moe.md "In the RL loop"): SGLang engines (the push of expert weights is
  untested), the selector (no expert terms), expert groups spanning data-parallel ranks (the
  dispatcher does not plan equal micro-batch counts for them), compiled engine steps, an expert
  capacity (drops would depend on the engine step's other requests); and a layout with ep > 1
  or etp for a dense model.

What the rollout engine kind needs (the embedded engine: a tp/dp rollout layout; SGLang engines:
``rollout.engine_urls``, no selected rollout layout) is checked by each kind's
check (``orchestration.engines.checks.rollout_backend_problems``), and whether the
selector's memory budget admits any layout by ``orchestration.selection.selector_problems``: the
launchers call both next (``cli.train.checked_config``; this layer imports neither). They then call
``machine_problems``, the one check here that reads the machine rather than the config: what the
model needs that is absent (Transformer Engine and CUDA for ``model.transformer_impl=
transformer_engine``; TE-only options such as ``model.cp_comm_type``); ``validate_run`` does not
call it, so a GPU config validates on a CPU machine.
"""

from __future__ import annotations

from pathlib import Path

from megatron_earl.config.run import ConfigError, RunConfig
from megatron_earl.config.vocab import EngineKind, Phase, RoutingReplay
from megatron_earl.envs import ENVS
from megatron_earl.models.impl import machine_facts, transformer_impl_problems
from megatron_earl.parallel.layout import (
    LayoutError,
    ParallelLayout,
    nearest_layout,
    phase_layout,
)
from megatron_earl.tokenizer.demo import DemoTokenizer
from megatron_earl.training.advantages import build_estimator
from megatron_earl.training.losses import available_losses

GROUP_BASELINES = ("grpo", "rloo")


def run_problems(config: RunConfig, world_size: int) -> list[str]:
    """Every reason ``config`` cannot start on ``world_size`` ranks (empty when it can)."""
    if world_size < 1:
        return [f"world size ({world_size}) must be >= 1"]
    problems = []
    layouts = {}
    for phase in Phase:
        try:
            layouts[phase] = layout = phase_layout(config.layouts, phase)
        except LayoutError as err:
            problems.append(f"layouts.{phase} {config.layouts.of(phase)!r}: {err}")
            continue
        found = layout.problems(world_size, config.model)
        if found:
            near = nearest_layout(layout, world_size, config.model)
            hint = f"; nearest valid: '{near}'" if near else "; no layout fits"
            problems.append(f"layouts.{phase} '{layout}': " + "; ".join(found) + hint)
        elif phase != Phase.ROLLOUT and layout.dp > config.batch.samples_per_step:
            problems.append(
                f"layouts.{phase} '{layout}' has dp={layout.dp} but a step has only "
                f"{config.batch.samples_per_step} samples (batch.prompts_per_step x "
                "batch.samples_per_prompt); every data-parallel rank needs at least one"
            )
    load = config.checkpoint.load
    if load is not None and not Path(load).exists():
        problems.append(f"checkpoint.load: checkpoint path {load!r} does not exist")
    problems.extend(_tokenizer_problems(config))
    problems.extend(_env_problems(config))
    problems.extend(_advantage_problems(config))
    if config.train.loss.loss_type not in available_losses():
        problems.append(
            f"train.loss: loss_type={config.train.loss.loss_type!r}; valid: {available_losses()}"
        )
    if config.train.advantage in GROUP_BASELINES and config.batch.samples_per_prompt < 2:
        problems.append(
            f"train.advantage={config.train.advantage!r} uses a group baseline: "
            f"batch.samples_per_prompt ({config.batch.samples_per_prompt}) must be >= 2"
        )
    problems.extend(_reference_problems(config))
    problems.extend(_async_problems(config))
    problems.extend(_expert_problems(config, layouts))
    return problems


def _expert_problems(config: RunConfig, layouts: dict[Phase, ParallelLayout]) -> list[str]:
    """What the RL loop needs of a mixture-of-experts run (module docstring; docs/moe.md)."""
    expert = {
        phase: layout
        for phase, layout in layouts.items()
        if layout.ep > 1 or layout.etp is not None
    }
    routing = config.routing
    if not config.model.is_moe:
        return [
            f"layouts.{phase} '{layout}': expert parallelism (ep {layout.ep}, etp "
            f"{layout.expert_tp}) needs a mixture-of-experts model (model.num_experts); use ep1 "
            "without etp"
            for phase, layout in expert.items()
        ] + (
            [
                f"routing (replay {str(routing.replay)!r}, measure {routing.measure}) needs a "
                "mixture-of-experts model (model.num_experts); a dense model routes nothing: "
                "set routing.replay: none and routing.measure: false"
            ]
            if routing.records
            else []
        )
    moe = f"model.num_experts={config.model.num_experts}"
    problems = []
    if routing.replay is RoutingReplay.ROLLOUT and config.model.recompute_granularity is not None:
        problems.append(
            f"routing.replay={str(routing.replay)!r} with model.recompute_granularity="
            f"{config.model.recompute_granularity!r}: the recomputed forward in the backward "
            "pass would route natively, not as the rollout; set recompute_granularity: null"
        )
    if routing.records and config.model.moe_router_load_balancing_type == "sinkhorn":
        problems.append(
            f"routing (replay {str(routing.replay)!r}, measure {routing.measure}) with "
            "model.moe_router_load_balancing_type='sinkhorn': megatron-core's sinkhorn routing "
            "bypasses RouterReplay (no route is recorded or replayed); use aux_loss, seq_aux_loss, "
            "global_aux_loss or none"
        )
    if config.rollout.engine != EngineKind.EMBEDDED:
        problems.append(
            f"{moe} with rollout.engine={config.rollout.engine!r}: mixture-of-experts models "
            "roll out on the embedded engine only (the push of expert weights to SGLang engines "
            "is untested); set rollout.engine: embedded"
        )
    if config.selector.enabled:
        problems.append(
            f"{moe} with selector.enabled=true: the selector's memory and throughput models "
            "have no expert terms yet; fix the phase layouts and set selector.enabled=false"
        )
    for name in ("compile_decode", "compile_prefill"):
        if getattr(config.rollout.embedded, name):
            problems.append(
                f"{moe} with rollout.embedded.{name}=true: the MoE layers' token dispatch "
                f"sizes its buffers from the routing, which a compiled graph cannot hold; set "
                f"rollout.embedded.{name}: false"
            )
    if config.model.moe_expert_capacity_factor is not None:
        problems.append(
            f"{moe} with model.moe_expert_capacity_factor="
            f"{config.model.moe_expert_capacity_factor}: with a capacity, the tokens an expert "
            "drops depend on which other requests share the engine's step, so a rollout's "
            "routing (and its seeded tokens) would too; set it to null for RL runs"
        )
    rollout = layouts.get(Phase.ROLLOUT)
    if rollout is not None and (rollout.ep > 1 or rollout.etp is not None):
        problems.append(
            f"layouts.rollout '{rollout}': the embedded engine runs the experts in its TP group "
            f"(ep 1, etp = tp); use a rollout layout without ep or etp, e.g. "
            f"tp{rollout.tp}cp1pp1dp{rollout.world_size // rollout.tp}"
        )
    for phase, layout in layouts.items():
        if phase == Phase.ROLLOUT:
            continue
        group = layout.ep * layout.expert_tp
        if (layout.tp * layout.cp) % group:
            problems.append(
                f"layouts.{phase} '{layout}': its expert groups (ep {layout.ep} x etp "
                f"{layout.expert_tp} = {group} ranks) span data-parallel ranks (tp {layout.tp} x "
                f"cp {layout.cp}), whose micro-batch counts the dispatcher does not equalise "
                "yet; put the expert group inside tp x cp (e.g. tp2 with ep2 etp1)"
            )
    return problems


def _async_problems(config: RunConfig) -> list[str]:
    """``rollout.mode: async`` needs SGLang-protocol engines (their own processes), not the
    colocated release/resume cycle, and a buffer that can hold a step's groups."""
    r = config.rollout
    if r.mode != "async":
        return []
    problems = []
    if r.engine != EngineKind.SGLANG:
        problems.append(
            f"rollout.mode=async needs rollout.engine=sglang (engines in their own processes: "
            f"SGLang servers, or megatron-earl serve), got {r.engine!r}; the embedded engine "
            "shares the trainer's processes and generates in the synchronous loop only"
        )
    if r.sglang.colocated:
        problems.append(
            "rollout.mode=async cannot use rollout.sglang.colocated=true: the engines keep "
            "generating while the trainer trains, so their memory is never released"
        )
    n = config.batch.prompts_per_step
    if r.max_buffered_groups is not None and r.max_buffered_groups < n:
        problems.append(
            f"rollout.max_buffered_groups ({r.max_buffered_groups}) < batch.prompts_per_step "
            f"({n}): a step's batch could never be assembled; raise it to >= {n}"
        )
    if r.sglang.pause_mode == "abort" and r.partial_rollout == "continue":
        problems.append(
            "rollout.partial_rollout=continue with rollout.sglang.pause_mode=abort: the push "
            "would abort the in-flight requests it should continue; use pause_mode retract or "
            "in_place (or partial_rollout=restart)"
        )
    return problems


def _reference_problems(config: RunConfig) -> list[str]:
    kl_coef = config.train.loss.kl_coef
    if kl_coef > 0 and config.selector.enabled and Phase.EXPERIENCE in config.selector.phases:
        return [
            f"train.loss.kl_coef={kl_coef} keeps a frozen reference policy in the fixed "
            f"experience layout, but selector.phases {list(config.selector.phases)} lets the "
            "selector choose the experience layout per step; remove 'experience' from "
            "selector.phases, set selector.enabled=false, or set train.loss.kl_coef=0"
        ]
    return []


def machine_problems(config: RunConfig) -> list[str]:
    """What ``config.model`` needs that this machine lacks (Transformer Engine, CUDA); each
    problem names the option and the package. Reads the machine (TE importable, the device
    policy); no process group."""
    return transformer_impl_problems(
        config.model,
        embedded_engine=config.rollout.engine == EngineKind.EMBEDDED,
        **machine_facts(),
    )


def validate_run(config: RunConfig, world_size: int) -> None:
    """Raise one ``ConfigError`` listing every problem of ``config`` on ``world_size`` ranks."""
    problems = run_problems(config, world_size)
    if problems:
        raise ConfigError(
            f"configuration cannot run on {world_size} rank{'s' * (world_size != 1)}:\n  "
            + "\n  ".join(problems)
        )


def _tokenizer_problems(config: RunConfig) -> list[str]:
    if config.tokenizer == "demo":
        vocab = DemoTokenizer().vocab_size
        if config.model.vocab_size < vocab:
            return [
                f"model.vocab_size ({config.model.vocab_size}) < the demo tokenizer's vocabulary "
                f"({vocab})"
            ]
        return []
    if not Path(config.tokenizer).is_dir():
        return [f"tokenizer {config.tokenizer!r} is neither 'demo' nor an existing directory"]
    return []


def _env_problems(config: RunConfig) -> list[str]:
    """The environment must resolve and construct with ``env.kwargs`` (constructed once here,
    so an unknown or mistyped keyword is a config error, not every trajectory's failure after
    the processes started; constructors are expected to be cheap)."""
    try:
        factory = ENVS.resolve(config.env.name)
    except (KeyError, ImportError) as err:
        return [f"env.name: {err.args[0] if err.args else err}"]
    kwargs = dict(config.env.kwargs)
    try:
        factory(**kwargs)
    except Exception as err:
        return [
            f"env.kwargs {kwargs}: constructing env.name={config.env.name!r} raised "
            f"{type(err).__name__}: {err}"
        ]
    return []


def _advantage_problems(config: RunConfig) -> list[str]:
    try:
        build_estimator(config.train.advantage, **config.train.advantage_kwargs)
    except (ValueError, TypeError) as err:
        return [f"train: advantage {config.train.advantage!r}: {err}"]
    return []
