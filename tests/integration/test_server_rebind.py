"""``ServerProcess(rebind_on_conflict=True)``: a port picked free that another socket takes before
the server binds it (the race every ``free_port()`` caller has) gives a server on a new free port,
not a failed fixture."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from megatron_earl.config.model import ModelConfig
from megatron_earl.rollout.sglang.launcher import LaunchConfig, ServerProcess

MODEL = ModelConfig(
    num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=128
)


def _launch(tmp_path, port: int, name: str, rebind: bool) -> ServerProcess:
    (tmp_path / "model.json").write_text(json.dumps(MODEL.to_dict()))
    config = LaunchConfig(
        model_path="random",
        port=port,
        module="megatron_earl.rollout.serve.server",
        extra_args=("--model-config", str(tmp_path / "model.json"), "--max-seq-len", "64"),
    )
    return ServerProcess(
        config, log_path=str(tmp_path / f"{name}.log"), rebind_on_conflict=rebind,
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_a_taken_port_is_replaced_by_a_free_one(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with _launch(tmp_path, port, "rebind", rebind=True) as server:
            server.wait_healthy(timeout_s=120)
            assert server.config.port != port and server.url.endswith(f":{server.config.port}")
    with pytest.raises(ValueError, match="rebind_on_conflict needs log_path"):
        ServerProcess(LaunchConfig(model_path="random"), rebind_on_conflict=True)


WORLD_OF_ONE = """
import os, torch.distributed as dist
from megatron_earl import runtime
runtime.initialize(timeout_s=10)
port = int(os.environ["MASTER_PORT"])
dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False).set("seen", "yes")
print(port, dist.get_rank(), dist.get_world_size(), runtime._RENDEZVOUS.get("seen").decode())
try:
    runtime.host_rendezvous(1)
except RuntimeError as err:
    print(err)
"""


def test_a_world_of_one_binds_its_rendezvous_port_itself():
    """``runtime.initialize`` without a launcher: the store is bound on a port the OS picks at
    bind time (no port picked free and bound later, which another process can take between),
    and ``MASTER_PORT`` names it."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    done = subprocess.run(
        [sys.executable, "-c", WORLD_OF_ONE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.strip().splitlines()
    port, rank, world, seen = first.split()
    assert int(port) > 0 and (rank, world, seen) == ("0", "1", "yes")
    assert second == f"this process already hosts a rendezvous (port {port})"
