"""SGLang's distributed weight-update protocol on NCCL (``rollout.sglang.group_backend: nccl``):
the trainer's side (``rollout.weights.transports.DistributedTransport``, its weight-update group
of ``rollout.weights.group``) on GPU 0 pushes weights to a ``megatron-earl serve`` engine on
GPU 1, per tensor and in flattened buckets; the engine then generates what an engine started
with those weights loaded directly (on the same GPU) generates, and reports the pushed version.
The bodies, model and weights of tests/integration/test_serve_weight_protocols.py, which checks
the same on gloo.

Tolerance: greedy ids equal, log-probs within the fp32 bound of their chain of sums
(``tests/tolerances.py``): both engines run the same kernels on the same GPU, and only cuBLAS's
choice of algorithm (by alignment of the weights' buffers) may sum in another order."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from megatron_earl.config.sglang import SGLangConfig
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess, stop_all
from megatron_earl.rollout.weights.sync import hf_named_tensors
from megatron_earl.testing.distributed import free_port, run_distributed
from tests.gpu import requires_gpus, visible_gpus
from tests.integration import test_serve_weight_protocols as cpu
from tests.tolerances import fp32_tol, gpt_terms

pytestmark = [pytest.mark.gpu, requires_gpus(2)]
LOGPROB_TERMS = gpt_terms(cpu.MODEL, len(cpu.PROMPT) + cpu.GREEDY.max_new_tokens)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A reference engine serving ``cpu.W`` loaded from a file and a target engine started with
    random weights, both on the second visible GPU: the trainer's rank computes on the first
    (NCCL refuses two ranks of one communicator on one device)."""
    tmp = tmp_path_factory.mktemp("nccl_push")
    (tmp / "model.json").write_text(json.dumps(cpu.MODEL.to_dict()))
    torch.save(cpu.W, tmp / "w.pt")
    common = ("--model-config", str(tmp / "model.json"), "--max-seq-len", "64")
    configs = {
        "ref": LaunchConfig(
            model_path=str(tmp / "w.pt"), port=free_port(),
            module="megatron_earl.rollout.serve.server", extra_args=common,
        ),
        "target": LaunchConfig(
            model_path="random", port=free_port(), module="megatron_earl.rollout.serve.server",
            extra_args=(*common, "--seed", "3", "--dist-timeout", "120"),
        ),
    }  # fmt: skip
    procs = {
        name: ServerProcess(
            config,
            log_path=str(tmp / f"{name}.log"),
            env={"CUDA_VISIBLE_DEVICES": visible_gpus()[1], "OMP_NUM_THREADS": "1"},
            rebind_on_conflict=True,
        )
        for name, config in configs.items()
    }
    try:
        for proc in procs.values():
            proc.wait_healthy(timeout_s=300)
        yield {"ref": procs["ref"].url, "target": procs["target"].url, "tmp": str(tmp)}
    finally:
        stop_all(list(procs.values()), stop_timeout_s=30)


def _push_over_nccl(urls: dict[str, str], settings: SGLangConfig, version: int) -> dict:
    """On the trainer's GPU: push other weights, then ``cpu.W``, over one NCCL group (one
    transport, as the trainer keeps it); the outputs of both engines after each push."""
    from megatron_earl.rollout.sglang.client import SGLangClient
    from megatron_earl.rollout.weights.transports import build_transport
    from tests.integration.engine_calls import outputs, reported_version

    transport = build_transport(settings, cpu.MODEL, Path(urls["tmp"]))

    async def body() -> dict:
        client = SGLangClient(urls["target"])
        try:
            other = hf_named_tensors(cpu.weights(5), cpu.MODEL)
            await transport.push([client], other, version - 1)
            before = await outputs(urls["target"], cpu.PROMPT, cpu.GREEDY)
            stats = await transport.push([client], hf_named_tensors(cpu.W, cpu.MODEL), version)
            after = await outputs(urls["target"], cpu.PROMPT, cpu.GREEDY)
            reported = await reported_version(urls["target"])
        finally:
            await transport.close([client])
            await client.close()
        reference = await outputs(urls["ref"], cpu.PROMPT, cpu.GREEDY)
        return {"before": before, "after": after, "reference": reference, "stats": stats,
                "reported": reported, "backend": transport.backend}  # fmt: skip

    return asyncio.run(body())


@pytest.mark.parametrize(
    "settings",
    [
        SGLangConfig(weight_update="distributed", group_backend="nccl", bucket_bytes=64 << 10,
                     group_timeout_s=120),
        SGLangConfig(weight_update="distributed", group_backend="nccl", bucket_bytes=64 << 10,
                     group_timeout_s=120, distributed_load_format="flattened_bucket"),
    ],
    ids=["per-tensor", "flattened"],
)  # fmt: skip
def test_nccl_pushed_weights_serve_like_weights_loaded_directly(engines, settings):
    version = 200 + len(str(settings.distributed_load_format))
    (res,) = run_distributed(_push_over_nccl, 1, args=(engines, settings, version), timeout_s=600)
    assert res["backend"] == "nccl"
    ref_ids, ref_lp = res["reference"]
    assert res["before"][0] != ref_ids  # the other weights generate something else
    ids, lp = res["after"]
    assert ids == ref_ids
    tol = fp32_tol(LOGPROB_TERMS, max(abs(x) for x in ref_lp))
    assert lp == pytest.approx(ref_lp, abs=tol)
    assert res["reported"] == version
    hf = hf_named_tensors(cpu.W, cpu.MODEL)
    assert res["stats"].bytes_sent == sum(t.numel() * t.element_size() for _, t in hf)
    assert res["stats"].num_buckets > 1
