"""The words the code uses everywhere, defined once: the phases of an RL step, the rollout
engine kinds, when old log-probs are computed, the transformer-layer implementations, the weight
update protocols and their distributed load formats, the memory tags of colocated engines and
the pause modes, the activities a rank's heartbeat reports, the vocabulary padding rules. Use the
members (``Phase.TRAIN``), never the bare strings: a typo then fails at import, not at step 300.

    from megatron_earl.config.vocab import Phase
    for phase in Phase:                       # rollout, experience, train (in step order)
        ...
    Phase("train") is Phase.TRAIN             # parse a name; an unknown one lists the valid names

Members are ``enum.StrEnum``: each equals its string, so YAML/JSON round trips, dict lookups with
either spelling and metric keys (``f"time/{phase}"``) keep working; ``repr`` is the plain string
so messages read ``('rollout', 'experience', 'train')``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Vocabulary(StrEnum):
    """A closed set of names; parsing an unknown name raises ``ValueError`` listing valid ones."""

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def _missing_(cls, value: object) -> Vocabulary:
        raise ValueError(f"unknown {cls.__name__} {value!r}; valid: {', '.join(cls)}")


def member(cls: type[Vocabulary], value: Any, problems: list[str], what: str) -> Any:
    """``value`` as a member of the vocabulary ``cls``; an unknown name appends a problem naming
    the valid ones (and ``value`` is returned as it was). For a section's ``__post_init__``."""
    try:
        return cls(value)
    except ValueError:
        problems.append(f"{what} {value!r} is not one of {tuple(cls)}")
        return value


class Phase(Vocabulary):
    """A phase of one RL step; each has its own parallel layout."""

    ROLLOUT = "rollout"
    """Multi-turn generation of trajectories."""
    EXPERIENCE = "experience"
    """Forward-only old/ref log-probs, rewards, advantages."""
    TRAIN = "train"
    """Policy loss, backward, optimizer step."""


class EngineKind(Vocabulary):
    """Which rollout engine generates the trajectories."""

    EMBEDDED = "embedded"
    """The Megatron model itself, in the rollout layout, in-process."""
    SGLANG = "sglang"
    """External SGLang servers driven over SGLang's native HTTP API."""


class OldLogprobs(Vocabulary):
    """When the experience phase computes old log-probs (``train.old_logprobs``)."""

    AUTO = "auto"
    """Only when they can differ from the train pass's own log-probs before its update
    (``RunConfig.old_logprobs_pass``); otherwise the loss uses those (ratio exactly 1)."""
    ALWAYS = "always"
    """Every step, in a forward-only pass in the experience layout."""


class TransformerImpl(Vocabulary):
    """Which implementation of Megatron-Core's transformer layers a model is built with
    (Megatron-LM's ``--transformer-impl``, plus "auto")."""

    AUTO = "auto"
    """Transformer Engine when it is importable and the compute device is CUDA, else local."""
    LOCAL = "local"
    """Megatron-Core's local spec with the project's SDPA core attention (runs anywhere)."""
    TRANSFORMER_ENGINE = "transformer_engine"
    """Megatron-Core's Transformer Engine spec (TE attention and linears; CUDA and TE required)."""


class Activity(Vocabulary):
    """What a rank of a run is doing, as its heartbeat reports it (``orchestration.watchdog``):
    the phases of a step, and what a run does around the steps."""

    STARTUP = "startup"
    """Building the models, resuming from a checkpoint, saving the reference policy."""
    SFT = "sft"
    """The supervised warm start."""
    EVAL = "eval"
    """A held-out evaluation."""
    ROLLOUT = "rollout"
    """``Phase.ROLLOUT``: weight sync (reshard / push) and generation."""
    EXPERIENCE = "experience"
    """``Phase.EXPERIENCE``: dispatch and old/ref log-probs."""
    TRAIN = "train"
    """``Phase.TRAIN``: dispatch, backward, optimizer step."""
    STEP = "step"
    """In an RL step outside its three phases (step metrics, logging)."""
    CHECKPOINT = "checkpoint"
    """Writing a checkpoint."""
    SHUTDOWN = "shutdown"
    """After the last step: stopping the producer, the final evaluation and checkpoint."""
    DONE = "done"
    """The rank left the run (normally or with an error): nothing to watch."""


PHASES: tuple[Phase, ...] = tuple(Phase)
"""The phases of a step, in order."""
ENGINE_KINDS: tuple[EngineKind, ...] = tuple(EngineKind)
"""Every rollout engine kind."""


class WeightUpdate(Vocabulary):
    """How the trainer pushes new weights to SGLang engines (``rollout.sglang.weight_update``;
    SGLang's weight-update endpoints, ``rollout/weights/transports.py``)."""

    TENSOR = "tensor"
    """``update_weights_from_tensor``: serialized tensors over HTTP (colocated engines)."""
    DISK = "disk"
    """``update_weights_from_disk``: an HF directory on a filesystem the engines share."""
    DISTRIBUTED = "distributed"
    """``init_weights_update_group`` once, then ``update_weights_from_distributed`` per bucket
    while the trainer broadcasts it over the group (NCCL on GPUs, gloo on CPU)."""
    RELAY = "relay"
    """Published once to a root relay (``megatron-earl relay``); the relays fan it out and load
    it into their engines (``update_weights_from_tensor``), each engine on its own."""


class MemoryTag(Vocabulary):
    """What ``release_memory_occupation`` / ``resume_memory_occupation`` free and rebuild
    (SGLang's ``GPU_MEMORY_TYPE_*`` in ``sglang/srt/constants.py``, in its order; colocated
    engines, ``rollout.sglang.colocated``)."""

    KV_CACHE = "kv_cache"
    """The KV cache (SGLang flushes its prefix cache with it)."""
    WEIGHTS = "weights"
    """The model weights."""
    CUDA_GRAPH = "cuda_graph"
    """Captured CUDA graphs (``serve`` captures none: nothing to free)."""


MEMORY_TAGS: tuple[MemoryTag, ...] = tuple(MemoryTag)
"""Every tag: what ``tags: null`` (or ``[]``) means, as in SGLang."""


class TensorPayload(Vocabulary):
    """The format of ``update_weights_from_tensor``'s ``serialized_named_tensors``
    (``rollout.sglang.tensor_payload``; ``rollout/weights/tensor_payload.py``)."""

    PORTABLE = "portable"
    """base64 of ``torch.save([(name, tensor), ...])``: the bytes travel (any host);
    ``megatron-earl serve`` only."""
    SGLANG = "sglang"
    """SGLang's ``MultiprocessingSerializer`` format (base64 ``ForkingPickler``): handles
    travel, the bytes stay (CUDA IPC / host shared memory; colocated engines only)."""


class PauseMode(Vocabulary):
    """What ``pause_generation`` does with the requests in flight (SGLang's ``mode``)."""

    ABORT = "abort"
    """Abort every request (SGLang's default)."""
    IN_PLACE = "in_place"
    """Keep the requests and their KV cache; they continue after ``continue_generation``."""
    RETRACT = "retract"
    """Put the running requests back in the queue; their context is prefilled again later."""


class DistributedLoadFormat(Vocabulary):
    """How a bucket of SGLang's distributed weight update travels over the group
    (``rollout.sglang.distributed_load_format``; ``rollout/weights/group.py``)."""

    TENSORS = "tensors"
    """One broadcast per tensor (SGLang's default; ``load_format`` null on the wire)."""
    FLATTENED_BUCKET = "flattened_bucket"
    """One broadcast of the bucket's bytes, tensors back to back (``load_format``
    ``"flattened_bucket"``)."""


class RoutingReplay(Vocabulary):
    """Where the trainer's MoE routers take their experts from (``routing.replay``)."""

    NONE = "none"
    """Their own top-k of the trainer's router logits."""
    ROLLOUT = "rollout"
    """The experts the rollout engine routed each token to (R3)."""


class RepackPolicy(Vocabulary):
    """Where asynchronous trajectories run across weight versions (``rollout.repack.policy``)."""

    NONE = "none"
    """Engines take each new version when it comes; in-flight trajectories go on under it."""
    DRAIN = "drain"
    """Each trajectory runs on one weight version: an engine behind the newest takes no new
    trajectory and is loaded once none is left on it."""
    REPACK = "repack"
    """Drain, and the few trajectories left on a draining engine move to another engine on the
    same version, so the freed engine is loaded and starts new prompts."""


class VocabPadding(Vocabulary):
    """How the embedding/output vocabulary is padded (``model.vocab_padding``;
    ``config.model.padded_vocab_size``)."""

    EARL = "earl"
    """To a multiple of ``make_vocab_size_divisible_by``: the same shape in every layout."""
    MEGATRON_LM = "megatron-lm"
    """Megatron-LM's rule: to a multiple of ``make_vocab_size_divisible_by`` x the tensor-parallel
    size of the Megatron-LM run (``model.vocab_padding_tp``), fixed for every layout here."""


class Fanout(Vocabulary):
    """How the dispatcher sends one piece to several ranks (``dispatch.route.RouteConfig``)."""

    NODE_RELAY = "node_relay"
    """One copy per remote node, forwarded inside it by a leader (fast intra-node links)."""
    DIRECT = "direct"
    """One copy per consuming rank."""
