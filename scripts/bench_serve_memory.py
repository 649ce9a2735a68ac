"""Peak memory of ``megatron-earl serve`` around one keyed ``/update_weights_from_tensor``.

    python scripts/bench_serve_memory.py --mib 400

Starts ``serve`` (random tiny model, an API key), resets the process's peak-RSS mark
(``/proc/PID/clear_refs``, Linux), posts one portable payload of ``--mib`` MiB of base64 JSON
(one fp32 tensor under a name the model lacks, so the update is refused after the whole body is
read and decoded: the same path as an accepted update up to the apply, whose cost is the
model's size, not the body's), and prints the peak RSS gained over the body's size. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile

import aiohttp
import torch

from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess
from megatron_earl.rollout.weights.tensor_payload import serialize_portable
from megatron_earl.testing.distributed import free_port

KEY = "bench-key"


def rss_mib(pid: int, field: str) -> float:
    """``field`` (VmRSS, VmHWM) of ``/proc/PID/status`` in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def reset_peak(pid: int) -> None:
    """Set the process's peak RSS (VmHWM) to its current RSS."""
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")


def update_body(mib: int) -> bytes:
    """A keyed update's JSON body of about ``mib`` MiB (base64 is 4/3 of the tensor bytes)."""
    numel = (mib << 20) * 3 // 4 // 4
    payload = serialize_portable([("model.layers.0.mlp.absent.weight", torch.ones(numel))])
    return json.dumps({"serialized_named_tensors": [payload]}).encode()


async def post(url: str, body: bytes) -> tuple[int, str]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
        async with session.post(url + "/update_weights_from_tensor", data=body) as resp:
            return resp.status, (await resp.text())[:160]


def measure(mib: int, log_dir: str) -> dict:
    """Peak RSS gained by ``serve`` over one update of ``mib`` MiB (a fresh server)."""
    body = update_body(mib)
    launch = LaunchConfig(
        model_path="random",
        port=free_port(),
        api_key=KEY,
        module="megatron_earl.rollout.serve.server",
        extra_args=("--max-seq-len", "64"),
    )
    with ServerProcess(launch, log_path=f"{log_dir}/serve.log") as proc:
        proc.wait_healthy(timeout_s=120)
        pid = proc.process.pid
        reset_peak(pid)
        before = rss_mib(pid, "VmRSS")
        status, answer = asyncio.run(post(proc.url, body))
        peak = rss_mib(pid, "VmHWM")
    size = len(body) / 2**20
    return {"body_mib": size, "status": status, "answer": answer, "rss_mib": before,
            "peak_mib": peak, "ratio": (peak - before) / size}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=400, help="size of the update's body")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        r = measure(args.mib, tmp)
    print(f"answer: HTTP {r['status']} {r['answer']}")
    print(
        f"body {r['body_mib']:.0f} MiB: serve RSS {r['rss_mib']:.0f} MiB, peak "
        f"{r['peak_mib']:.0f} MiB (+{r['peak_mib'] - r['rss_mib']:.0f} MiB = "
        f"{r['ratio']:.2f}x the body)"
    )


if __name__ == "__main__":
    main()
