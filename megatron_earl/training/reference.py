"""The frozen reference policy: a second Megatron model, possibly in another parallel layout, whose
log-probs are computed in the experience phase (for the KL term). No grads, no optimizer, no DDP.

    ref = ReferencePolicy(model_config, ReferenceConfig(layout=ParallelLayout(dp=4)))
    ref.load_from(shard_pieces(policy_chunks))   # taken while the policy layout was current
    ref_logprobs = ref.logprobs(samples)          # switches to ref's layout and back
    ref_logprobs = ref.micro_batch_logprobs(whole)  # the loop's path: dispatched packed batches

In the RL loop (``orchestration.loop``, ``train.loss.kl_coef > 0``) the reference lives in the
experience layout and holds the *initial* policy: the weights the first RL step starts from (after
``checkpoint.load`` and the SFT warm start), as verl and slime do. ``orchestration.run`` saves
them once under ``<checkpoint_dir>/reference`` and loads them back on resume.

The model is built, loaded and run with its own layout current (``parallel.state.use_layout``; a
cached switch costs no communication after the first), and the caller's layout is restored
afterwards. Weights arrive from the policy by ``redistribute.weight_exec.reshard_weights``
(point-to-point, any layout to any layout) or from a whole-model state dict. Its parameters have
``requires_grad=False`` and the modules are in eval mode (no dropout).

Which ranks call every method: every rank of the world (layout switches and the pipeline schedule
are collectives), each with the samples of its DP rank *in the reference layout*.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_earl.config.model import ModelConfig
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.training.logprobs import DEFAULT_CHUNK_SIZE
from megatron_earl.training.microbatch import Sample


@dataclass(frozen=True)
class ReferenceConfig:
    """Where and how the reference policy computes log-probs."""

    layout: ParallelLayout
    """The reference model's parallel layout (may differ from the training layout)."""
    max_tokens_per_micro_batch: int = 8192
    """Per-rank token budget of one forward micro-batch."""
    logprob_chunk_size: int = DEFAULT_CHUNK_SIZE
    """Tokens per output-layer chunk (bounds the logits memory)."""
    vocab_size: int | None = None
    """Real vocabulary size (padded output rows beyond it are excluded from the softmax)."""

    def __post_init__(self) -> None:
        if self.max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}; valid: >= 1"
            )
        if self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size={self.logprob_chunk_size}; valid: >= 1")


class ReferencePolicy:
    """A frozen model in its own layout; ``logprobs`` gives per-sample reference log-probs."""

    def __init__(self, model: ModelConfig, config: ReferenceConfig) -> None:
        from megatron_earl.models.gpt import build_model
        from megatron_earl.redistribute.geometry import shard_pieces

        self.model = model
        self.config = config
        self.loaded = False
        """Whether weights were loaded (a fresh reference holds its random initialisation)."""
        with self.in_layout():
            self.chunks = build_model(model, vpp=config.layout.vpp)
            for chunk in self.chunks:
                chunk.eval()
                chunk.requires_grad_(False)
            # this rank's parameter pieces, taken in the reference layout: the reshard target
            self.pieces = shard_pieces(self.chunks)

    @contextlib.contextmanager
    def in_layout(self) -> Iterator[None]:
        """Make the reference layout current, restoring the caller's layout on exit."""
        from megatron_earl.parallel.state import current_layout, use_layout

        previous = current_layout()
        use_layout(self.config.layout)
        try:
            yield
        finally:
            if previous is not None and previous != self.config.layout:
                use_layout(previous)

    @torch.no_grad()
    def load_from(self, policy_pieces: Sequence, *, bucket_bytes: int = 64 << 20) -> None:
        """Copy the policy's weights in, from ``shard_pieces(policy_chunks)`` taken while the
        policy layout was current (point-to-point reshard; any layout to any layout)."""
        from megatron_earl.redistribute.weight_exec import reshard_weights

        reshard_weights(policy_pieces, self.pieces, bucket_bytes=bucket_bytes)
        self.loaded = True

    @torch.no_grad()
    def load_full_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shards out of whole tensors (``geometry.full_state_dict``). Local."""
        from megatron_earl.redistribute.geometry import load_full_state_dict

        load_full_state_dict(self.chunks, weights)
        self.loaded = True

    def logprobs(self, samples: Sequence[Sample]) -> list[torch.Tensor] | None:
        """Per-sample reference log-probs of ``labels`` (fp32, [L] each, in ``samples`` order) on
        the reference layout's last pipeline stage; None on other stages."""
        from megatron_earl.training.rl_step import forward_logprobs

        with self.in_layout():
            out = forward_logprobs(
                self.chunks,
                samples,
                max_tokens=self.config.max_tokens_per_micro_batch,
                chunk_size=self.config.logprob_chunk_size,
                vocab_size=self.config.vocab_size,
                entropy=False,
            )
        return None if out is None else out[0]

    def micro_batch_logprobs(self, whole: Sequence[dict]) -> list[torch.Tensor] | None:
        """Reference log-probs of packed micro-batches ``whole`` (``microbatch.thd_micro_batch``,
        dispatched for the reference layout), one fp32 tensor of real tokens per micro-batch, on
        the last pipeline stage; None on other stages. The loop's path: no unpack/repack."""
        from megatron_earl.training.rl_step import micro_batch_logprobs

        with self.in_layout():
            return micro_batch_logprobs(
                self.chunks,
                whole,
                chunk_size=self.config.logprob_chunk_size,
                vocab_size=self.config.vocab_size,
            )
