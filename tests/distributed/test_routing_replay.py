"""Routing replay in the trainer's forward (``training.schedule.routing_context``): the routes a
one-process forward recorded, replayed on 2 processes in a train-like layout -- tp2 with
sequence parallelism and ep2 etp1 (each TP rank's routers see their half of the tokens, two
experts per rank), and cp2 ep2 (each CP rank holds two chunks of every sample) -- give that
forward's log-probs within the fp32 bound of its sums in another order; routes shifted to other
experts give log-probs far outside it (the replay is in effect), and measuring the shifted
routes counts every compared (token, layer) route as differing, padding (-1) excluded.

Tolerance: ``FORWARD_TERMS`` of ``tests.distributed.test_moe`` (one forward's chain of fp32 sums
over the longest sample), terms of magnitude <= 1.
"""

from __future__ import annotations

import pytest
import torch

from megatron_earl.parallel.layout import ParallelLayout
from megatron_earl.testing.distributed import run_distributed
from tests.distributed.test_moe import FORWARD_TERMS, MOE, _setup
from tests.tolerances import fp32_tol

LENGTHS = (13, 21, 6)


def _samples():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, MOE.vocab_size, (n,), generator=gen) for n in LENGTHS]


def _recorded():
    """One process: the weights, every sample's routes ``[n, L, k]`` and log-probs ``[n - 1]``."""
    from megatron_earl.models.routing import moe_routers, recording

    chunks, _, _, weights = _setup(ParallelLayout(), None, MOE)
    model = chunks[0].eval()
    routers = moe_routers(chunks)
    routes, logprobs = [], []
    with torch.no_grad():
        for tokens in _samples():
            with recording(routers) as recorded:
                logits = model(tokens[None], torch.arange(tokens.numel())[None], None)
                routes.append(recorded())
            full = torch.log_softmax(logits[0, :-1, : MOE.vocab_size].float(), dim=-1)
            logprobs.append(full.gather(1, tokens[1:, None])[:, 0])
    return weights, routes, logprobs


def _replayed(layout: ParallelLayout, weights, routes, shift: int, action: str):
    """Log-probs of the samples (one micro-batch, all samples) with ``routes`` (each expert id
    shifted by ``shift`` mod the experts), replayed or measured (``action``), and the measured
    counts (differing, compared) summed over the world."""
    from megatron_earl.models.routing import Disagreement, RouteAction
    from megatron_earl.training.microbatch import ROUTES, thd_micro_batch
    from megatron_earl.training.rl_step import micro_batch_logprobs

    chunks, _, _, _ = _setup(layout, weights, MOE)
    samples = _samples()
    routes = [(r + shift) % MOE.num_experts for r in routes]
    for r in routes:  # as from an engine: no route for the last token
        r[-1] = -1
    fields = {
        "tokens": torch.cat(samples),
        "labels": torch.cat([torch.cat([s[1:], s.new_zeros(1)]) for s in samples]),
        "loss_mask": torch.cat([torch.ones(n) for n in LENGTHS]),
        ROUTES: torch.cat(routes),
    }
    mb = thd_micro_batch(fields, list(LENGTHS), layout.cp, sp=layout.tp)
    counter = Disagreement()
    mb["routing"] = RouteAction.REPLAY if action == "replay" else counter
    (out,) = micro_batch_logprobs([c.eval() for c in chunks], [mb], vocab_size=MOE.vocab_size)
    taken = counter.take()
    counts = None if taken is None else torch.stack(taken).double()
    if counts is not None:
        torch.distributed.all_reduce(counts)
    return out, counts


@pytest.fixture(scope="module")
def recorded():
    return run_distributed(_recorded, 1, timeout_s=180)[0]


LAYOUTS = [ParallelLayout(tp=2, ep=2, etp=1), ParallelLayout(cp=2, ep=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_replayed_routes_reproduce_the_recorded_forward(recorded, layout):
    weights, routes, logprobs = recorded
    bound = fp32_tol(FORWARD_TERMS, 1.0)
    want = torch.cat(logprobs)

    def run(shift, action):
        out, counts = run_distributed(
            _replayed, 2, args=(layout, weights, routes, shift, action), timeout_s=180
        )[0]
        real = torch.cat([out[sum(LENGTHS[:i]) : sum(LENGTHS[: i + 1]) - 1] for i in range(3)])
        return real, counts

    same, _ = run(0, "replay")
    assert (same - want).abs().max() <= bound, ((same - want).abs().max(), bound)
    shifted, _ = run(1, "replay")
    assert (shifted - want).abs().max() > 100 * bound  # other experts: another function
    native, counts = run(1, "measure")
    assert (native - want).abs().max() <= bound  # measuring routes natively
    computed = sum(n - 1 for n in LENGTHS) * MOE.num_layers  # -1 rows excluded
    assert counts.tolist() == [computed, computed]  # every shifted route differs
