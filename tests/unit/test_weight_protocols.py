"""Pure parts of the weight-update protocols: the ``rollout.sglang`` settings, serve's checks
(names/shapes/dtypes against the model, allowed directories), the group address, and the
broadcast wire formats between two threads over a real gloo group."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_earl.config.loader import load_config
from megatron_earl.config.model import ModelConfig
from megatron_earl.config.run import ConfigError
from megatron_earl.config.sglang import SGLangConfig, SGLangConfigError
from megatron_earl.rollout.serve.weights import (
    Forbidden,
    allowed_path,
    check_metadata,
    expected_hf_tensors,
)
from megatron_earl.rollout.weights.group import (
    FLATTENED,
    broadcast_bucket,
    flattened_sizes,
    host_group_store,
    join_weight_update_group,
    receive_bucket,
)
from megatron_earl.rollout.weights.transports import TRANSPORTS, group_address

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4)


def test_settings_validate_and_every_kind_has_a_transport():
    assert SGLangConfig().weight_update == "tensor"  # today's behaviour stays the default
    assert set(TRANSPORTS) == {"tensor", "disk", "distributed", "relay"}
    with pytest.raises(SGLangConfigError) as info:
        SGLangConfig(weight_update="nfs", group_backend="mpi", distributed_load_format="x")
    for needle in ("'nfs'", "'mpi'", "'x'"):
        assert needle in str(info.value)
    with pytest.raises(ConfigError, match=r"rollout\.sglang: bucket_bytes"):
        load_config(None, ["rollout.sglang.bucket_bytes=0"])
    with pytest.raises(SGLangConfigError, match="weight_update 'relay' needs relay_urls"):
        SGLangConfig(weight_update="relay")
    with pytest.raises(SGLangConfigError, match="relay_urls entry 'relay0:31000' must start"):
        SGLangConfig(weight_update="relay", relay_urls=("relay0:31000",))
    with pytest.raises(SGLangConfigError, match=r"health_interval_s \(0\) must be > 0"):
        SGLangConfig(health_interval_s=0)


def test_metadata_checks_name_the_first_mismatch():
    expected = expected_hf_tensors(MODEL, torch.float32)
    name = "model.layers.1.mlp.down_proj.weight"
    assert expected[name] == ((32, 64), torch.float32)
    check_metadata([name], [torch.float32], [[32, 64]], expected)
    cases = {
        "is not a tensor of the served model": ("model.layers.2.mlp.down_proj.weight", 32, 64),
        "has shape (64, 32), the model's is (32, 64)": (name, 64, 32),
    }
    for needle, (n, *shape) in cases.items():
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            check_metadata([name, n], [torch.float32] * 2, [[32, 64], shape], expected)
    with pytest.raises(ValueError, match="has dtype bfloat16, the model's is float32"):
        check_metadata([name], [torch.bfloat16], [[32, 64]], expected)


def test_allowed_path_resolves_symlinks_and_dot_dots(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "v1").mkdir()
    (allowed / "link").symlink_to(outside)
    dirs = (allowed.resolve(),)
    assert allowed_path(str(allowed / "v1"), dirs) == (allowed / "v1").resolve()
    for bad in (outside, allowed / "link", allowed / ".." / "outside"):
        with pytest.raises(Forbidden, match="outside the directories allowed"):
            allowed_path(str(bad), dirs)
    with pytest.raises(Forbidden, match="disabled"):
        allowed_path(str(allowed / "v1"), ())


def test_group_address():
    assert group_address(["http://127.0.0.1:1", "http://localhost:2"]) == "127.0.0.1"


@pytest.mark.parametrize("load_format", [None, FLATTENED])
def test_broadcast_wire_formats(load_format):
    store = host_group_store("127.0.0.1", 2, 30)
    port = store.port
    bucket = [("a", torch.randn(2, 3)), ("b", torch.randn(6).bfloat16()), ("c", torch.ones(1))]
    got = {}

    def engine() -> None:
        group = join_weight_update_group("127.0.0.1", port, 1, 2, "g", "gloo", 30)
        dtypes, shapes = [t.dtype for _, t in bucket], [list(t.shape) for _, t in bucket]
        got["bucket"] = receive_bucket(group, ["a", "b", "c"], dtypes, shapes, load_format)

    thread = threading.Thread(target=engine)
    thread.start()
    group = join_weight_update_group("127.0.0.1", port, 0, 2, "g", "gloo", 30, store)
    broadcast_bucket(group, bucket, load_format)
    thread.join(30)
    assert [n for n, _ in got["bucket"]] == ["a", "b", "c"]
    for (_, sent), (_, received) in zip(bucket, got["bucket"]):
        assert received.dtype == sent.dtype and torch.equal(received, sent)


SGLANG_SIDE = """
import datetime, os, sys, torch, torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend, PrefixStore, _new_process_group_helper, _world, rendezvous)
port, group_name = int(sys.argv[1]), sys.argv[2]
timeout = datetime.timedelta(seconds=30)
store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
store.set_timeout(timeout)
store = PrefixStore(group_name, store)
pg, _ = _new_process_group_helper(2, 1, [], Backend("gloo"), store, group_name=group_name,
                                  backend_options=None, timeout=timeout)
_world.pg_group_ranks[pg] = {0: 0, 1: 1}
t = torch.empty(3)
dist.broadcast(t, src=0, group=pg)
print(t.tolist(), flush=True)
os._exit(0)  # gloo's threads may abort a normal interpreter exit ("terminate called ...")
"""
"""What SGLang 0.5.23's ``init_custom_process_group`` does for an engine TP rank (rank 1 here),
in torch's own calls: ``rendezvous`` on ``tcp://``, ``PrefixStore(group_name)``, then
``_new_process_group_helper`` (which adds its own group and device prefixes); then a broadcast
from rank 0. The real function is met in ``tests/sglang``."""


def test_the_trainers_group_meets_a_rank_joined_the_way_sglang_joins():
    """Fails if the trainer's rendezvous keys and SGLang's disagree (the trainer on
    ``PrefixStore(group_name)`` alone waits for ``/g/0/1`` while SGLang's rank writes
    ``/g/g//cpu//0/1``)."""
    import subprocess
    import sys

    store = host_group_store("127.0.0.1", 2, 30)
    port = store.port
    peer = subprocess.Popen(
        [sys.executable, "-c", SGLANG_SIDE, str(port), "weights"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        group = join_weight_update_group("127.0.0.1", port, 0, 2, "weights", "gloo", 30, store)
        broadcast_bucket(group, [("a", torch.tensor([1.0, 2.0, 3.0]))])
        out, err = peer.communicate(timeout=30)
    finally:
        peer.kill()
    assert peer.returncode == 0, err[-2000:]
    assert out.strip() == "[1.0, 2.0, 3.0]"


def test_a_peer_that_never_joins_times_out():
    store = host_group_store("127.0.0.1", 2, 1)
    with pytest.raises(TimeoutError, match="not every rank joined within 1 s"):
        join_weight_update_group("127.0.0.1", store.port, 0, 2, "g", "gloo", 1, store)


def test_a_store_bound_in_advance_is_rank_0s_at_its_own_port():
    store = host_group_store("127.0.0.1", 2, 1)
    with pytest.raises(ValueError, match="rank 0's, at its own port"):
        join_weight_update_group("127.0.0.1", store.port, 1, 2, "g", "gloo", 1, store)
    with pytest.raises(ValueError, match=f"at its own port {store.port}"):
        join_weight_update_group("127.0.0.1", store.port + 1, 0, 2, "g", "gloo", 1, store)


def test_flattened_buckets_keep_every_tensor_aligned():
    assert flattened_sizes(["a", "b"], [torch.float32, torch.bfloat16], [[3], [5]]) == [12, 10]
    with pytest.raises(ValueError, match=r"c \(float32\) would start at byte 10"):
        flattened_sizes(["b", "c"], [torch.bfloat16, torch.float32], [[5], [1]])


def test_launcher_passes_weight_dirs_to_serve_only():
    from megatron_earl.rollout.sglang.launcher import LaunchConfig, build_command

    serve = LaunchConfig(
        model_path="m", module="megatron_earl.rollout.serve.server", weight_dirs=("/a", "/b")
    )
    assert build_command(serve)[-2:] == ["--weight-dirs", "/a,/b"]
    with pytest.raises(ValueError, match="SGLang has no --weight-dirs"):
        LaunchConfig(model_path="m", weight_dirs=("/a",))
