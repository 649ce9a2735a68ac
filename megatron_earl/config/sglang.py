"""Settings of the trainer's SGLang engines (``rollout.sglang``): how weights reach them.

    rollout:
      engine: sglang
      engine_urls: [http://10.0.0.2:30000, http://10.0.0.3:30000]
      sglang:
        weight_update: distributed      # tensor (default) | disk | distributed | relay
        tensor_payload: portable        # tensor: portable (default) | sglang (colocated)
        bucket_bytes: 536870912
        router_url: http://10.0.0.1:30100   # SGLang's router in front of the engines (optional)
        colocated: false                    # engines share the trainer's GPUs: release/resume

``rollout/weights/transports.py`` implements each ``weight_update`` kind; its docstring and
``docs/engines.md`` say what each needs from the engines (a shared directory they are allowed to
read for ``disk``, a port of the trainer's rank 0 they can reach for ``distributed``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_earl.config.vocab import DistributedLoadFormat, PauseMode, TensorPayload, WeightUpdate

PAUSE_MODES = tuple(PauseMode)
GROUP_BACKENDS = ("gloo", "nccl")
DISTRIBUTED_LOAD_FORMATS = tuple(DistributedLoadFormat)
TENSOR_LOAD_FORMATS = tuple(DistributedLoadFormat)  # the same two layouts


class SGLangConfigError(ValueError):
    """An invalid ``rollout.sglang`` section."""


@dataclass(frozen=True)
class SGLangConfig:
    """How the trainer pushes weights to its SGLang engines."""

    weight_update: WeightUpdate = WeightUpdate.TENSOR
    """ "tensor" (``update_weights_from_tensor``), "disk" (``update_weights_from_disk`` of an HF
    directory), "distributed" (``update_weights_from_distributed`` over a process group) or
    "relay" (published once to the relay tier, ``megatron-earl relay``)."""
    bucket_bytes: int = 512 << 20
    """Tensor bytes per bucket at most (tensor and distributed; one tensor larger travels
    alone)."""
    pause_mode: str = "retract"
    """``pause_generation`` mode around a push: "retract", "in_place" or "abort"."""
    weight_dir: str | None = None
    """disk: directory the trainer writes each version's HF directory into (``v<version>``,
    the previous one removed after the engines loaded the new one); the engines must read it
    at the same path (a shared filesystem) and allow it (serve: ``--weight-dirs``). None:
    ``<run dir>/engine_weights``."""
    group_backend: str | None = None
    """distributed: "gloo" or "nccl"; None: "nccl" when the trainer computes on CUDA, else
    "gloo"."""
    group_address: str | None = None
    """distributed: address of the trainer's rank 0 the engines connect to; None: 127.0.0.1
    when every engine URL is on loopback, else this host's address on the route to the first
    engine."""
    group_port: int = 0
    """distributed: port of the group's rendezvous on the trainer's rank 0; 0: one the OS picks
    when rank 0 binds its store."""
    group_timeout_s: float = 300.0
    """distributed: how long joining the group and each broadcast may take."""
    distributed_load_format: str = "tensors"
    """distributed: "tensors" (one broadcast per tensor, SGLang's default) or
    "flattened_bucket" (one broadcast of the bucket's bytes)."""
    tensor_payload: TensorPayload = TensorPayload.PORTABLE
    """tensor: format of the payloads. "portable" (base64 ``torch.save``; ``megatron-earl
    serve`` only, any host) or "sglang" (SGLang's ``MultiprocessingSerializer`` format: CUDA
    IPC handles / host shared memory, so the engines must run on the trainer's node; what a real
    SGLang server accepts; serve accepts it too)."""
    tensor_load_format: str = "tensors"
    """tensor: "tensors" (a list of (name, tensor); SGLang's default ``load_format``, the
    model's ``load_weights``) or "flattened_bucket" (one uint8 tensor of the bucket's bytes plus
    metadata; needs ``tensor_payload: sglang``)."""
    health_interval_s: float = 5.0
    """Period of the trainer's health checks of every engine during rollouts (each must answer
    within it); an engine that fails two in a row is taken out of routing and the requests it
    holds move to the others (a stopped or partitioned engine); it rejoins when it answers."""
    relay_urls: tuple[str, ...] = ()
    """relay: the root relays the trainer publishes to (``megatron-earl relay``), first healthy
    first; the relays that feed the engines pull from them (``--upstream``)."""
    engine_relays: tuple[str, ...] = ()
    """relay with ``rollout.repack``: the relay that feeds each ``rollout.engine_urls`` entry
    (same order; started with ``--release-holders`` = the trainer's process count), which the
    trainer's producers tell when an engine holds none of their trajectories."""
    relay_timeout_s: float = 600.0
    """relay: how long a publish may take, and (synchronous loop) how long the trainer waits
    for every engine to report the published version."""
    engine_tp: int | None = None
    """TP ranks of each engine, its ``--tp-size`` (SGLang's or ``megatron-earl serve``'s; ranks
    it joins the group with; payloads per tensor push). None: read from the engines at start-up
    (``/get_server_info``'s ``tp_size``); set, it must equal theirs (checked at start-up)."""
    router_url: str | None = None
    """SGLang's router (``sglang-router``) in front of ``rollout.engine_urls``: generation goes
    through it (its policy balances the requests and retries those of a failed engine); weight
    pushes and pause/flush/continue still go to every engine directly. None: the trainer's own
    engine pool routes (least loaded, sticky trajectories, failover)."""
    api_key_env: str = "SGLANG_API_KEY"
    """Environment variable holding the engines' (and the router's) ``--api-key``, sent as
    ``Authorization: Bearer``; unset or empty: no key. Keys are never written in the config."""
    admin_api_key_env: str = "SGLANG_ADMIN_API_KEY"
    """Environment variable holding the engines' ``--admin-api-key`` (weight updates and control
    calls); unset or empty: those calls use the API key."""
    colocated: bool = False
    """The engines share GPUs with the trainer: after every rollout each engine releases its
    memory (``release_memory_occupation``, every tag), and before the next one the trainer
    resumes ``weights``, pushes the weights, then resumes ``kv_cache`` and ``cuda_graph``
    (slime's order). The engines need ``--enable-memory-saver`` (SGLang)."""

    def __post_init__(self) -> None:
        problems = []
        try:
            object.__setattr__(self, "weight_update", WeightUpdate(self.weight_update))
        except ValueError as err:
            problems.append(f"weight_update: {err}")
        if self.bucket_bytes < 1:
            problems.append(f"bucket_bytes ({self.bucket_bytes}) must be >= 1")
        if self.pause_mode not in PAUSE_MODES:
            problems.append(f"pause_mode {self.pause_mode!r} is not one of {PAUSE_MODES}")
        if self.group_backend is not None and self.group_backend not in GROUP_BACKENDS:
            problems.append(
                f"group_backend {self.group_backend!r} is not one of {GROUP_BACKENDS} or null"
            )
        if not 0 <= self.group_port < 65536:
            problems.append(f"group_port ({self.group_port}) must be in [0, 65536)")
        if self.group_timeout_s <= 0:
            problems.append(f"group_timeout_s ({self.group_timeout_s}) must be > 0")
        if self.distributed_load_format not in DISTRIBUTED_LOAD_FORMATS:
            problems.append(
                f"distributed_load_format {self.distributed_load_format!r} is not one of "
                f"{DISTRIBUTED_LOAD_FORMATS}"
            )
        try:
            object.__setattr__(self, "tensor_payload", TensorPayload(self.tensor_payload))
        except ValueError as err:
            problems.append(f"tensor_payload: {err}")
        if self.tensor_load_format not in TENSOR_LOAD_FORMATS:
            problems.append(
                f"tensor_load_format {self.tensor_load_format!r} is not one of "
                f"{TENSOR_LOAD_FORMATS}"
            )
        elif (
            self.tensor_load_format == DistributedLoadFormat.FLATTENED_BUCKET
            and self.tensor_payload != TensorPayload.SGLANG
        ):
            problems.append(
                f"tensor_load_format 'flattened_bucket' needs tensor_payload 'sglang', got "
                f"{self.tensor_payload!r}"
            )
        object.__setattr__(self, "relay_urls", tuple(self.relay_urls))
        for url in self.relay_urls:
            if not str(url).startswith(("http://", "https://")):
                problems.append(f"relay_urls entry {url!r} must start with http:// or https://")
        object.__setattr__(self, "engine_relays", tuple(self.engine_relays))
        for url in self.engine_relays:
            if not str(url).startswith(("http://", "https://")):
                problems.append(f"engine_relays entry {url!r} must start with http:// or https://")
        if self.engine_relays and self.weight_update != WeightUpdate.RELAY:
            problems.append(
                f"engine_relays need weight_update 'relay', got {str(self.weight_update)!r}"
            )
        if self.weight_update == WeightUpdate.RELAY and not self.relay_urls:
            problems.append(
                "weight_update 'relay' needs relay_urls (the root relays, `megatron-earl relay`)"
            )
        if not self.health_interval_s > 0:
            problems.append(f"health_interval_s ({self.health_interval_s}) must be > 0")
        if self.relay_timeout_s <= 0:
            problems.append(f"relay_timeout_s ({self.relay_timeout_s}) must be > 0")
        if self.engine_tp is not None and self.engine_tp < 1:
            problems.append(f"engine_tp ({self.engine_tp}) must be >= 1")
        if self.router_url is not None and not self.router_url.startswith(("http://", "https://")):
            problems.append(f"router_url {self.router_url!r} must start with http:// or https://")
        for name in ("api_key_env", "admin_api_key_env"):
            if not getattr(self, name).isidentifier():
                problems.append(
                    f"{name} {getattr(self, name)!r} is not an environment variable name"
                )
        if problems:
            raise SGLangConfigError("sglang: " + "; ".join(problems))

    def api_key(self) -> str | None:
        """The engines' API key from ``api_key_env`` (None when unset or empty)."""
        return os.environ.get(self.api_key_env) or None

    def admin_api_key(self) -> str | None:
        """The key of weight updates and control calls: the admin key, else the API key."""
        return os.environ.get(self.admin_api_key_env) or self.api_key()
