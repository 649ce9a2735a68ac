"""Prefix-shared (tree) packing against whole-sample packing: one RL train step and one
forward-only log-prob pass on the same GRPO-shaped micro-batch, interleaved in one process.

    python scripts/bench_prefix_sharing.py [--rounds 5] [--cases 13:43:8:4,512:64:8:2] [--hf]

A case is ``prompt:completion:group_size:groups``: ``groups`` prompts of ``prompt`` tokens, each
with ``group_size`` completions of up to ``completion`` tokens (lengths spread over the upper
half, as sampled rollouts are), one micro-batch. Model: ``configs/demo_cpu.yaml``'s (4 layers,
hidden 128, fp32 today), 1 process x 1 thread, random weights. Each
timed call includes its packing (``thd_micro_batch`` or ``tree_micro_batch``: the prefix
detection and the attention plan too). Prints per case the tokens each packing computes and the
median seconds of each (train step: forward, backward, optimizer step; log-probs: forward only),
with the ratio whole / tree.

``--hf`` adds, interleaved in the same rounds, a Hugging Face train step in the layout TRL's
``GRPOTrainer`` trains on, on the same samples: a ``LlamaForCausalLM`` of the same shape (the
config ``convert`` writes; its own random weights), one batch with the completions right-padded
to the longest (the samples of a case share their prompt length, so TRL's left padding of the
prompts is empty here), logits of the completion positions, a clipped-ratio loss over the
completion tokens, backward, gradient clipping at 1.0 and torch's fused AdamW (GRPOConfig's
``adamw_torch_fused``). The padded batch is built once, outside the timing (ours is timed with
its packing). TRL 1.16 itself does more per step: its fused log-prob head scores every position
of the padded batch, prompt included, and computes the entropy: this step leaves that work
out. It prints the positions of the padded batch and its median seconds next to our tree
step's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from megatron_earl.config import load_config
from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
MODEL = dataclasses.replace(
    load_config(ROOT / "configs" / "demo_cpu.yaml").model, max_position_embeddings=4096
)
"""The demo's model (its shape, fp32), with room for the long-prompt case."""


def _fields(prompt: int, completion: int, group_size: int, groups: int):
    from megatron_earl.training.microbatch import next_token_sample

    gen = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(groups):
        head = torch.randint(0, MODEL.vocab_size, (prompt,), generator=gen)
        for _ in range(group_size):
            n = int(torch.randint(completion // 2, completion + 1, (1,), generator=gen))
            tokens = torch.cat([head, torch.randint(0, MODEL.vocab_size, (n,), generator=gen)])
            s = next_token_sample(tokens, torch.arange(tokens.numel()) >= prompt)
            s["advantages"] = torch.randn(1, generator=gen).expand(tokens.numel()).clone()
            samples.append(s)
    fields = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
    return fields, [s["tokens"].numel() for s in samples]


def _hf_step(fields: dict[str, torch.Tensor], lengths: list[int], prompt: int):
    """HF's train step in TRL's layout of the samples (``--hf``, module doc): a callable, and
    the positions of its padded batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_earl.convert.families import family_by_name, hf_config_from_model

    hf_fields = hf_config_from_model(MODEL, family_by_name("llama"))
    config = LlamaConfig.from_dict({**hf_fields, "attn_implementation": "sdpa"})
    torch.manual_seed(11)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    samples = torch.split(fields["tokens"], lengths)
    width = max(lengths) - prompt  # the longest completion
    ids = torch.zeros(len(samples), prompt + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, tokens in enumerate(samples):
        ids[i, : tokens.numel()], mask[i, : tokens.numel()] = tokens, 1
    completion, keep = ids[:, prompt:], mask[:, prompt:].float()
    advantages = torch.randn(len(samples), 1, generator=torch.Generator().manual_seed(0))

    def step() -> None:
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=width + 1).logits
        logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, completion[..., None])
        ratio = torch.exp(logps[..., 0] - logps[..., 0].detach())
        clipped = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.28) * advantages)
        loss = -(clipped * keep).sum() / keep.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return step, ids.numel()


def _job(cases: list[tuple[int, int, int, int]], rounds: int, hf: bool = False) -> list[dict]:
    torch.set_num_threads(1)
    from megatron_earl import runtime
    from megatron_earl.config.loss import PolicyLossConfig
    from megatron_earl.models.gpt import build_model
    from megatron_earl.parallel.state import initialize_layout
    from megatron_earl.training.microbatch import thd_micro_batch
    from megatron_earl.training.prefix_tree import tree_micro_batch
    from megatron_earl.training.rl_step import (
        RLStepConfig,
        micro_batch_logprobs,
        train_micro_batches,
    )
    from megatron_earl.training.setup import (
        OptimConfig,
        build_optimizer,
        wire_schedule_hooks,
        wrap_ddp,
    )

    initialize_layout(ParallelLayout())
    runtime.seed(11)
    chunks = build_model(MODEL)
    optim = OptimConfig(lr=1e-5)
    ddp = wrap_ddp(chunks, optim)
    optimizer = build_optimizer(ddp, optim)
    wire_schedule_hooks(ddp, optimizer)
    config = RLStepConfig(loss=PolicyLossConfig(), vocab_size=MODEL.vocab_size)
    packings = {"whole": thd_micro_batch, "tree": tree_micro_batch}
    out = []
    for case in cases:
        fields, lengths = _fields(*case)
        times: dict[str, list[float]] = {f"{p} {k}": [] for p in packings for k in ("train", "lp")}
        tokens = {p: pack(fields, lengths)["tokens"].numel() for p, pack in packings.items()}
        if hf:
            hf_step, tokens["hf"] = _hf_step(fields, lengths, case[0])
            times["hf train"] = []
        for r in range(rounds + 1):  # round 0 warms up
            for name, pack in packings.items():
                start = time.perf_counter()
                train_micro_batches(ddp, optimizer, [pack(fields, lengths)], config)
                middle = time.perf_counter()
                with torch.no_grad():
                    micro_batch_logprobs(chunks, [pack(fields, lengths)])
                end = time.perf_counter()
                if r:
                    times[f"{name} train"].append(middle - start)
                    times[f"{name} lp"].append(end - middle)
            if hf:
                start = time.perf_counter()
                hf_step()
                if r:
                    times["hf train"].append(time.perf_counter() - start)
        medians = {k: statistics.median(v) for k, v in times.items()}
        out.append({"case": case, "tokens": tokens, "medians": medians})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per case")
    parser.add_argument("--cases", default="13:43:8:4,512:64:8:2", help="p:c:group_size:groups")
    parser.add_argument("--hf", action="store_true", help="also HF's train step, TRL's layout")
    args = parser.parse_args(argv)
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",") if c]
    if args.rounds < 1 or any(len(c) != 4 or min(c) < 1 for c in cases):
        parser.error(f"--rounds {args.rounds} < 1 or --cases {args.cases!r} not p:c:g:n >= 1")
    (results,) = run_distributed(_job, 1, args=(cases, args.rounds, args.hf), timeout_s=1800)
    print(
        f"model {MODEL.num_layers} layers x hidden {MODEL.hidden_size}, fp32, 1 process x 1 "
        f"thread, median of {args.rounds} interleaved rounds, packing included"
    )
    for res in results:
        p, c, g, n = res["case"]
        m, t = res["medians"], res["tokens"]
        print(
            f"prompt {p}, completions <= {c}, {n} groups x {g}: tokens whole {t['whole']}, tree "
            f"{t['tree']} ({t['tree'] / t['whole']:.2f}); train step whole {m['whole train']:.4f} "
            f"s, tree {m['tree train']:.4f} s ({m['whole train'] / m['tree train']:.2f}x); "
            f"log-probs whole {m['whole lp']:.4f} s, tree {m['tree lp']:.4f} s "
            f"({m['whole lp'] / m['tree lp']:.2f}x)"
            + (
                f"; HF train step (TRL's padded batch) {t['hf']} positions {m['hf train']:.4f} s "
                f"(HF / tree {m['hf train'] / m['tree train']:.2f}x)"
                if "hf" in t
                else ""
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
