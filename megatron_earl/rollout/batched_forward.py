"""The embedded engine's forward: Megatron's own modules run on a ragged batch with a row cache.

    fwd = BatchedForward(gpt_model, max_batch_size=64, max_seq_len=1024)
    logits_kV = fwd(Batch.prefill(row0=3, contexts=[[5, 9, 2], [7, 1]]))     # 2 new requests
    logits_nV = fwd(Batch.decode(lengths=[4, 3, 9], tokens=[11, 12, 13]))    # rows 0..2

Why not ``GPTModel.forward``: Megatron's static inference path (0.16) batches statically -- one
write offset for the whole batch, keys cached un-rotated and the whole cache re-rotated on every
step, GQA keys repeated per step -- and runs one request's prefill per call. Here every step is
one forward of *packed* tokens ``[T, 1, h]`` (a decode step: one token per running request; a
prefill step: the whole contexts of the requests admitted together), through the model's own
submodules in the order ``TransformerLayer`` applies them:

    embedding -> per layer: input_layernorm, self_attention.get_query_key_value_tensors (fused
    QKV, qkv bias, q/k layernorm, TP split), RoPE at each token's position, KV-cache write,
    attention, self_attention.linear_proj (TP reduce), residual, pre_mlp_layernorm, mlp (TP
    reduce), residual -> final_layernorm and output_layer (TP gather) on each sequence's last
    token only.

Every weight and every projection is Megatron's module; only the layer's control flow, RoPE
(the formula of Megatron's ``_apply_rotary_pos_emb_bshd``, with the cos/sin tables of the model's
own rotary module computed once) and attention over the cache are here. ``check_supported``
rejects model features this order does not cover. Attention: SDPA, GQA without repeating keys
(decode: the query heads of a group attend as a group; prefill: ``enable_gqa``), a key-padding
mask for rows of different lengths. All tensors of a step are built on the host from Python ints
and moved to the compute device once (boundary "engine step inputs", docs/devices.md).

Legend: T = tokens in the step, k = sequences in the step, n = running rows, L = cached length,
h = hidden, np/ng = query heads/groups on this TP rank, hn = head dim, V = padded vocabulary.
No communication except inside Megatron's TP modules (every rank of the TP group runs the step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config
from torch import nn

from megatron_earl import runtime
from megatron_earl.parallel.ddp import unwrap_chunk
from megatron_earl.rollout.kv_cache import RowCache


@dataclass(frozen=True)
class Batch:
    """One step's sequences: rows ``[row0, row0 + k)``, each with new tokens after its cache."""

    row0: int
    """First cache row of the step (the rows are contiguous)."""
    tokens: tuple[tuple[int, ...], ...]
    """New token ids per sequence (decode: one each; prefill: the whole context)."""
    starts: tuple[int, ...]
    """Tokens already cached per sequence (the position of its first new token)."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.starts) or not self.tokens:
            raise ValueError(
                f"a step needs >= 1 sequence and one start per sequence, got "
                f"{len(self.tokens)} token lists and {len(self.starts)} starts"
            )
        if any(not t for t in self.tokens):
            raise ValueError("every sequence of a step needs at least one new token")

    @classmethod
    def prefill(cls, row0: int, contexts: Sequence[Sequence[int]]) -> Batch:
        return cls(row0, tuple(tuple(c) for c in contexts), (0,) * len(contexts))

    @classmethod
    def decode(cls, lengths: Sequence[int], tokens: Sequence[int]) -> Batch:
        return cls(0, tuple((int(t),) for t in tokens), tuple(lengths))

    @property
    def is_decode(self) -> bool:
        return all(len(t) == 1 for t in self.tokens)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def check_supported(gpt: nn.Module) -> None:
    """Raise ``ValueError`` naming the first model feature the batched forward does not cover."""
    config = gpt.config
    problems = {
        "pipeline stages (pre_process and post_process both needed)": not (
            gpt.pre_process and gpt.post_process
        ),
        f"position_embedding_type={gpt.position_embedding_type!r}": gpt.position_embedding_type
        not in ("rope", "yarn"),
        "rotary_interleaved": config.rotary_interleaved,
        "multi_latent_attention": config.multi_latent_attention,
        "apply_residual_connection_post_layernorm": (
            config.apply_residual_connection_post_layernorm
        ),
        "attention_output_gate": getattr(config, "attention_output_gate", False),
        "num_moe_experts": bool(config.num_moe_experts),
        "sequence_parallel": config.sequence_parallel,
        "context_parallel_size > 1": config.context_parallel_size > 1,
        "no_rope_freq": bool(getattr(config, "no_rope_freq", None)),
    }
    bad = [name for name, hit in problems.items() if hit]
    if bad:
        raise ValueError(f"the embedded engine's batched forward does not support {bad[0]}")


class BatchedForward:
    """Runs steps (``Batch``) through one GPT model chunk and its row cache (module docstring)."""

    def __init__(self, model: nn.Module, max_batch_size: int, max_seq_len: int) -> None:
        gpt = unwrap_chunk(model)
        check_supported(gpt)
        self.gpt = gpt
        self.layers = list(gpt.decoder.layers)
        attn = self.layers[0].self_attention
        self.num_groups = attn.num_query_groups_per_partition
        self.num_heads = attn.num_attention_heads_per_partition
        self.head_dim = attn.hidden_size_per_attention_head
        self.scale = self.layers[0].self_attention.core_attention.softmax_scale
        weight = attn.linear_qkv.weight
        self.device = weight.device
        self.cache = RowCache(
            len(self.layers),
            self.num_groups,
            self.head_dim,
            max_batch_size,
            max_seq_len,
            dtype=weight.dtype,
            device=weight.device,
        )
        self.cos, self.sin = self._rope_tables(max_seq_len, weight.dtype)

    @torch.no_grad()
    def _rope_tables(self, max_seq_len: int, dtype: torch.dtype):
        """cos/sin ``[max_seq_len, 1, 1, rot]`` of the model's rotary module, scaled by mscale as
        Megatron's attention does, on the compute device."""
        emb = self.gpt.rotary_pos_emb(max_seq_len)
        freqs = emb[0] if isinstance(emb, tuple) else emb
        freqs = freqs.to(self.device)
        mscale = _yarn_get_concentration_factor_from_config(self.gpt.config)
        return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.cache.move_row(src, dst, length)

    @torch.inference_mode()
    def __call__(self, batch: Batch) -> torch.Tensor:
        """Full-vocabulary logits ``[k, V]`` (fp32) at the last new token of each sequence; the
        new tokens' keys and values are written to the cache."""
        index = _StepIndex.build(batch)
        ids, pos_T, rows_T, seq_T, local_T, last_k, key_len, new_len = (
            runtime.to_device(t) for t in index.tensors
        )
        cos, sin = self.cos[pos_T], self.sin[pos_T]
        x = self.gpt.embedding(input_ids=ids[None], position_ids=pos_T[None])  # [T, 1, h]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attention
            q, k, v = attn.get_query_key_value_tensors(layer.input_layernorm(x))
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            self.cache.write(i, rows_T, pos_T, k[:, 0], v[:, 0])
            keys, values = self.cache.view(i, batch.row0, len(batch.tokens), index.max_key_len)
            if index.is_decode:
                ctx = self._attend_decode(q[:, 0], keys, values, key_len)
            else:
                ctx = self._attend_ragged(
                    q[:, 0], keys, values, index, seq_T, local_T, key_len - new_len
                )
            x = _residual(x, attn.linear_proj(ctx[:, None]))
            x = _residual(x, layer.mlp(layer.pre_mlp_layernorm(x)))
        hidden = self.gpt.decoder.final_layernorm(x[last_k])  # [k, 1, h]
        weight = None
        if self.gpt.share_embeddings_and_output_weights:
            weight = self.gpt.shared_embedding_or_output_weight()
        logits, _ = self.gpt.output_layer(hidden, weight=weight, runtime_gather_output=True)
        return logits[:, 0].float()

    def _attend_decode(self, q_Tnh, keys, values, key_len):
        """One query per row: the heads of a group attend together (no key repeat)."""
        n, rep = q_Tnh.size(0), self.num_heads // self.num_groups
        q = q_Tnh.reshape(n, self.num_groups, rep, self.head_dim)
        mask = torch.arange(keys.size(2), device=q.device)[None, :] < key_len[:, None]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None, None, :], scale=self.scale
        )
        return out.reshape(n, self.num_heads * self.head_dim)

    def _attend_ragged(self, q_Tnh, keys, values, index, seq_T, local_T, start):
        """Sequences of several new tokens, padded to the longest: causal over each sequence's
        cached prefix and new tokens, padding keys masked."""
        k_seqs, width = keys.size(0), index.max_new
        q = q_Tnh.new_zeros(k_seqs, width, self.num_heads, self.head_dim)
        q[seq_T, local_T] = q_Tnh
        q = q.transpose(1, 2)  # [k, np, width, hn]
        if index.fresh:  # no cached prefix: right padding never reaches a real query
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            q_pos = start[:, None] + torch.arange(width, device=q.device)[None, :]
            k_pos = torch.arange(keys.size(2), device=q.device)
            mask = k_pos[None, None, :] <= q_pos[:, :, None]
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask[:, None], scale=self.scale, enable_gqa=True
            )
        return out.transpose(1, 2)[seq_T, local_T].reshape(len(seq_T), -1)


@dataclass(frozen=True)
class _StepIndex:
    """Host index tensors of a step (built once from Python ints)."""

    tensors: tuple[torch.Tensor, ...]
    """ids, positions, rows, sequence and local index per token; last-token index, key length and
    new-token count per sequence."""
    is_decode: bool
    fresh: bool
    max_new: int
    max_key_len: int

    @classmethod
    def build(cls, batch: Batch) -> _StepIndex:
        lengths = [len(t) for t in batch.tokens]
        ids = [t for seq in batch.tokens for t in seq]
        pos, seq, local = [], [], []
        for s, (start, n) in enumerate(zip(batch.starts, lengths)):
            pos.extend(range(start, start + n))
            seq.extend([s] * n)
            local.extend(range(n))
        last, total = [], 0
        for n in lengths:
            total += n
            last.append(total - 1)
        key_len = [start + n for start, n in zip(batch.starts, lengths)]
        long = torch.long
        tensors = (
            torch.tensor(ids, dtype=long),
            torch.tensor(pos, dtype=long),
            torch.tensor(seq, dtype=long) + batch.row0,
            torch.tensor(seq, dtype=long),
            torch.tensor(local, dtype=long),
            torch.tensor(last, dtype=long),
            torch.tensor(key_len, dtype=long),
            torch.tensor(lengths, dtype=long),
        )
        return cls(
            tensors,
            is_decode=max(lengths) == 1,
            fresh=not any(batch.starts),
            max_new=max(lengths),
            max_key_len=max(key_len),
        )


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``[T, 1, heads, hn]`` with per-token tables ``[T, 1, 1, rot]`` (Megatron's
    non-interleaved formula; dims beyond ``rot`` pass through)."""
    rot = cos.size(-1)
    head, tail = t[..., :rot], t[..., rot:]
    x1, x2 = torch.chunk(head, 2, dim=-1)
    rotated = head * cos + torch.cat((-x2, x1), dim=-1) * sin
    return rotated if tail.numel() == 0 else torch.cat((rotated, tail), dim=-1)


def _residual(residual: torch.Tensor, out_bias) -> torch.Tensor:
    """Megatron's bias-dropout-add in eval mode: ``residual + (out + bias)``."""
    out, bias = out_bias
    return residual + (out if bias is None else out + bias)
