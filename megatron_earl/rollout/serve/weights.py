"""The weight-update endpoints of ``megatron-earl serve``: ``update_weights_from_tensor`` (either
payload format of ``tensor_payload``), SGLang's distributed protocol over gloo and
``update_weights_from_disk`` from an HF directory.

    POST /update_weights_from_tensor       {serialized_named_tensors: [payload], load_format,
                                            weight_version, ...}     -> decode, check, apply
    POST /init_weights_update_group        {master_address, master_port, rank_offset, world_size,
                                            group_name, backend}        -> join the group
    POST /update_weights_from_distributed  {names, dtypes, shapes, group_name, load_format, ...}
                                            -> receive one bucket broadcast by rank 0, apply it
    POST /destroy_weights_update_group     {group_name}
    POST /begin_weight_update, /end_weight_update   {selector} / {}  -> SGLang's session
    POST /update_weights_from_disk         {model_path, load_format, weight_version, ...}
    GET|POST /get_weights_by_name          {name, truncate_size} -> the first values of a
                                            served tensor (read back what was loaded)

``WeightEndpoints`` is mixed into ``server.Server`` (it uses the server's ``engine``,
``_update`` and ``_json``). Rules, beyond SGLang's (which does neither check):

- a tensor payload is portable (``torch.load(weights_only=True)``) or SGLang's
  ``MultiprocessingSerializer`` format read by a restricted unpickler (never ``pickle.loads``):
  a global it does not need is refused (400 naming it) before anything is called; CPU tensors
  only (named shared memory of the same host; a CUDA IPC handle is refused);
- metadata first: every name must be a tensor of the served model, with its shape and dtype;
  the first mismatch is refused (400, naming it) before a byte is received or anything changes,
  so the old version keeps serving. The trainer's broadcast of a refused bucket has no receiver,
  so the group is destroyed with the refusal (the trainer's send fails at once instead of
  waiting for the group's timeout) and must be initialised again;
- the group is joined in a thread (the HTTP loop keeps serving while the trainer joins); a
  trainer that never joins gets a 400 naming the rendezvous after ``--dist-timeout`` seconds;
- with ``--tp-size N`` every TP rank joins, as ``rank_offset + tp_rank`` (SGLang's rule: the
  trainer's ``rollout.sglang.engine_tp`` must be N), and receives every bucket; joins and
  receives then run as engine steps, so generation waits meanwhile (as SGLang's scheduler
  does); see ``serve.tp``;
- a disk update reads only below a directory given by ``--weight-dirs`` (symlinks resolved;
  none by default): anything else is answered 403 and nothing is read. Every file it reads is a
  regular file inside the resolved ``model_path`` (an index's shard names included: absolute,
  ``..`` or symlinked out is a 403 before any file is opened). ``model_path`` is an HF
  directory (``model.safetensors`` or a sharded index, as the streaming exporter
  ``convert.export_hf`` writes it and SGLang loads it; names, shapes and dtypes are checked
  after reading, before loading) or a ``torch.save``'d full Megatron state file (the older
  form: read whole, then its names and shapes are checked before loading);
- a group is replaced, or a ``weight_version`` accepted, only once the whole request is valid;
- SGLang's weight-update session, as 0.5.23 keeps it: ``update_weights_from_tensor`` and
  ``update_weights_from_distributed`` are refused (400, SGLang's message) outside a
  ``/begin_weight_update`` ... ``/end_weight_update`` pair; a second begin, or an end without a
  begin, is refused; ``update_weights_from_disk`` needs no session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from megatron_earl import runtime
from megatron_earl.rollout.serve.auth import error_response
from megatron_earl.rollout.serve.generate_api import BadRequest, parse_weight_version
from megatron_earl.rollout.serve.tp import TPGroup
from megatron_earl.rollout.weights.group import (
    FLATTENED,
    LOAD_FORMATS,
    NamedTensor,
    flattened_sizes,
    join_weight_update_group,
    receive_bucket,
)
from megatron_earl.rollout.weights.tensor_payload import is_portable, take_payload

logger = logging.getLogger("megatron_earl.serve")

TENSOR_UPDATE_FIELDS = frozenset(
    {
        "rid",
        "serialized_named_tensors",
        "load_format",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "selector",
        "torch_empty_cache",
    }
)
INIT_GROUP_FIELDS = frozenset(
    {"rid", "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
)
DISTRIBUTED_UPDATE_FIELDS = frozenset(
    {
        "rid",
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "load_format",
        "selector",
        "torch_empty_cache",
    }
)
DESTROY_GROUP_FIELDS = frozenset({"rid", "group_name"})
DISK_UPDATE_FIELDS = frozenset(
    {
        "rid",
        "model_path",
        "load_format",
        "abort_all_requests",
        "weight_version",
        "is_async",
        "torch_empty_cache",
        "keep_pause",
        "recapture_cuda_graph",
        "token_step",
        "flush_cache",
        "manifest",
    }
)
SESSION_FIELDS = frozenset({"rid", "selector"})
"""Fields of SGLang's ``BeginWeightUpdateReqInput`` (``EndWeightUpdateReqInput``: ``rid``)."""
SESSION_SELECTORS = ("target", "draft", "all")
GET_WEIGHTS_FIELDS = frozenset({"rid", "http_worker_ipc", "name", "truncate_size"})
"""Fields of SGLang's ``GetWeightsByNameReqInput``."""
DISK_LOAD_FORMATS = (None, "auto", "safetensors", "pt")
MAX_GROUP_WORLD_SIZE = 65536
"""Largest ``world_size`` a weight-update group may have (a trainer rank 0 plus engines)."""


class LocalGroup:
    """The weight-update group of a TP1 server: joined, received and shut down in threads."""

    def __init__(self, group: Any) -> None:
        self.group = group

    async def receive(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[int]],
        load_format: str | None,
    ) -> list[NamedTensor]:
        args = (self.group, names, dtypes, shapes, load_format)
        return await asyncio.to_thread(receive_bucket, *args)

    async def shutdown(self) -> None:
        self.group.shutdown()


async def join_group(
    engine: Any,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    name: str,
    backend: str,
    timeout_s: float,
) -> Any:
    """Join the group with every TP rank of ``engine`` (rank ``rank_offset + tp_rank``); returns
    an object with ``receive`` and ``shutdown`` (``LocalGroup`` or ``serve.tp.TPGroup``)."""
    args = (master_address, master_port, rank_offset, world_size, name, backend, timeout_s)
    if engine.tp_size > 1:
        return await TPGroup.join(engine, *args)
    return LocalGroup(await asyncio.to_thread(join_weight_update_group, *args))


class Forbidden(PermissionError):
    """The request is not allowed (HTTP 403)."""


def expected_hf_tensors(model_config, dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
    """{HF name: (shape, dtype)} of every tensor of the served model (computed on meta)."""
    from megatron_earl.models.hf_mapping import full_megatron_to_hf, global_shapes

    meta = {
        k: torch.empty(s, dtype=dtype, device="meta")
        for k, s in global_shapes(model_config).items()
    }
    return {
        n: (tuple(t.shape), t.dtype) for n, t in full_megatron_to_hf(meta, model_config).items()
    }


def check_metadata(
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
    expected: dict[str, tuple[tuple, torch.dtype]],
) -> None:
    """``ValueError`` naming the first tensor whose name, shape or dtype the model does not have."""
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if name not in expected:
            raise ValueError(f"{name!r} is not a tensor of the served model")
        want_shape, want_dtype = expected[name]
        if tuple(shape) != want_shape:
            raise ValueError(f"{name} has shape {tuple(shape)}, the model's is {want_shape}")
        if dtype != want_dtype:
            raise ValueError(
                f"{name} has dtype {str(dtype).removeprefix('torch.')}, the model's is "
                f"{str(want_dtype).removeprefix('torch.')}"
            )


def check_named(named: Iterable[NamedTensor], expected: dict) -> None:
    named = list(named)
    check_metadata(
        [n for n, _ in named], [t.dtype for _, t in named], [t.shape for _, t in named], expected
    )


def parse_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return dtype


def allowed_path(path: str, weight_dirs: Sequence[Path]) -> Path:
    """``path`` resolved (symlinks followed); ``Forbidden`` unless it lies in a ``weight_dirs``."""
    if not weight_dirs:
        raise Forbidden(
            "update_weights_from_disk is disabled: no directory is allowed (start serve with "
            "--weight-dirs DIR[,DIR])"
        )
    resolved = Path(path).resolve()
    if not any(resolved.is_relative_to(d) for d in weight_dirs):
        raise Forbidden(
            f"model_path {path!r} (resolved: {resolved}) is outside the directories allowed by "
            f"--weight-dirs {[str(d) for d in weight_dirs]}"
        )
    return resolved


def read_weights(path: Path, load_format: str | None) -> tuple[str, Any]:
    """("hf", [(name, tensor)]) of an HF safetensors directory, or ("full", state) of a
    ``torch.save``'d full Megatron state file. ``path`` is resolved; every file read must be a
    regular file inside it (``HFReader(confined=True)``), else ``PermissionError`` and nothing
    is read."""
    from megatron_earl.convert.hf_io import HFReader

    if path.is_dir():
        if load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {load_format!r} does not read an HF directory")
        reader = HFReader(path, confined=True)
        names = sorted(n for n in reader.names() if not n.endswith("rotary_emb.inv_freq"))
        return "hf", list(reader.read(names).items())
    if load_format not in (None, "auto", "pt"):
        raise ValueError(f"load_format {load_format!r} does not read a full-state file")
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if not path.is_file():  # a FIFO or device would block the reading thread for good
        raise PermissionError(f"{path} is not a directory or a regular file")
    state = torch.load(path, weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a full Megatron state dict")
    return "full", state


class WeightEndpoints:
    """SGLang's distributed and disk weight updates (module docstring); mixed into ``Server``."""

    weight_dirs: tuple[Path, ...] = ()
    dist_timeout_s: float = 300.0

    def _init_weight_endpoints(self) -> None:
        """The endpoints' state (``Server.__init__`` calls it)."""
        self.weight_session: str | None = None
        """The open weight-update session's ``selector`` (None: no session is open)."""
        self.groups: dict[str, Any] = {}
        """Joined weight-update groups by name (``LocalGroup`` or ``serve.tp.TPGroup``)."""
        self._expected_hf: dict[str, tuple[tuple, torch.dtype]] | None = None

    def _expected(self) -> dict[str, tuple[tuple, torch.dtype]]:
        if self._expected_hf is None:
            dtype = next(self.engine.model_chunks[0].parameters()).dtype
            self._expected_hf = expected_hf_tensors(self.engine.model_config, dtype)
        return self._expected_hf

    async def _drop_group(self, name: str) -> None:
        group = self.groups.pop(name, None)
        if group is not None:
            try:
                await group.shutdown()
            except Exception:  # already broken: dropping the object closes its sockets
                logger.exception("shutdown of weight-update group %s", name)

    # ------------------------------------------------------------------ session

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        body = await self._json(request, SESSION_FIELDS, "begin_weight_update")
        selector = body.get("selector", "all")
        if selector not in SESSION_SELECTORS:
            raise BadRequest(f"selector {selector!r:.80} is not one of {SESSION_SELECTORS}")
        if self.weight_session is not None:
            raise BadRequest(
                "a weight-update session is already open; call end_weight_update() first"
            )
        self.weight_session = selector
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await self._json(request, frozenset({"rid"}), "end_weight_update")
        if self.weight_session is None:
            raise BadRequest("no weight-update session is open; call begin_weight_update() first")
        self.weight_session = None
        return web.json_response({"success": True, "message": "Success"})

    def _check_session(self, endpoint: str) -> None:
        """SGLang 0.5.23's rule: tensor and distributed updates run inside a session."""
        if self.weight_session is None:
            raise BadRequest(
                f"{endpoint} must run between begin_weight_update() and end_weight_update()"
            )

    # ------------------------------------------------------------------ tensor

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        from megatron_earl.models.hf_mapping import apply_hf_tensor, hf_target
        from megatron_earl.rollout.serve.generate_api import BadRequest

        body = await self._json(request, TENSOR_UPDATE_FIELDS, "update_weights_from_tensor")
        self._check_session("update_weights_from_tensor")
        payloads = body.pop("serialized_named_tensors", None)
        tp = self.engine.tp_size
        if not isinstance(payloads, list) or len(payloads) != tp:
            raise BadRequest(
                f"serialized_named_tensors must be a list of {tp} payload(s) (tp={tp})"
            )
        if is_portable(payloads[0]) and any(p != payloads[0] for p in payloads[1:]):
            raise BadRequest(  # the bytes travel: one copy for every rank, as serve loads it
                "serialized_named_tensors: serve loads the full tensors of the first payload on "
                f"every TP rank, so all {tp} portable payloads must be identical"
            )
        load_format = body.get("load_format")
        if load_format not in LOAD_FORMATS:  # before decoding up to a whole bucket
            raise BadRequest(f"load_format {load_format!r:.80} is not one of {LOAD_FORMATS}")
        if (bad := next((p for p in payloads if not isinstance(p, str)), None)) is not None:
            raise BadRequest(
                f"serialized_named_tensors holds base64 strings, got {type(bad).__name__}"
            )
        # Each distinct payload once, dropped as soon as it is decoded (take_payload).
        distinct = list(dict.fromkeys(payloads))
        del payloads
        try:
            # SGLang gives payload r to TP rank r; serve loads the full tensors of the first on
            # every rank. The others are opened too (an sglang payload's shared memory is freed
            # once its handle is opened) and must hold the same names.
            named = None
            for i in range(len(distinct)):
                tensors = await asyncio.to_thread(take_payload, distinct, i, load_format)
                if named is None:
                    named = tensors
                elif [n for n, _ in tensors] != [n for n, _ in named]:
                    raise ValueError("the TP ranks' payloads hold different tensors")
            for name, _ in named:
                hf_target(name, self.engine.model_config)
            check_named(named, self._expected())
        except (ValueError, KeyError) as err:
            raise BadRequest(
                f"update_weights_from_tensor refused, nothing changed: {err}"
            ) from None

        def apply(full: dict[str, torch.Tensor]) -> None:
            for name, tensor in named:
                apply_hf_tensor(full, name, tensor, self.engine.model_config)

        return await self._update(body, apply)

    # ------------------------------------------------------------------ read back

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's ``/get_weights_by_name`` (GET or POST ``{name, truncate_size=100}``): the
        served tensor of HF name ``name`` as float32 values, ``tolist()[:truncate_size]`` as
        SGLang's ``LlamaForCausalLM.get_weights_by_name`` answers it (the first
        ``truncate_size`` rows of a matrix, the first entries of a vector). A tied
        ``lm_head.weight`` reads the embedding, as in SGLang."""
        from megatron_earl.models.hf_mapping import hf_target, hf_tensor, read_name

        body = await self._json(request, GET_WEIGHTS_FIELDS, "get_weights_by_name")
        name, size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str):
            raise BadRequest(f"get_weights_by_name needs name (a string), got {name!r:.80}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadRequest(f"truncate_size must be an integer >= 0, got {size!r:.80}")
        self.check_weights_resident("get_weights_by_name")
        model = self.engine.model_config
        if read_name(name, model) not in self._expected():
            valid = sorted(self._expected())
            raise BadRequest(
                f"get_weights_by_name: {name!r} is not a parameter of the served model "
                f"({len(valid)} parameters, e.g. {valid[:3]})"
            )
        key = hf_target(read_name(name, model), model).key
        tensor = hf_tensor(await self.engine.state_dict(frozenset({key})), name, model)
        return web.json_response(tensor[:size].to(torch.float32).tolist())

    # ------------------------------------------------------------------ distributed

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._json(request, INIT_GROUP_FIELDS, "init_weights_update_group")
        missing = sorted({"master_address", "master_port", "rank_offset", "world_size"} - set(body))
        if missing:
            raise BadRequest(f"init_weights_update_group needs {missing}")
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        on_cuda = runtime.policy().device.type == "cuda"
        if backend not in (("gloo", "nccl") if on_cuda else ("gloo",)):
            raise BadRequest(
                f"backend {backend!r}: this server computes on {runtime.policy().device.type} "
                f"and joins with {'gloo or nccl' if on_cuda else 'gloo'} (NCCL needs CUDA)"
            )
        ints = {k: body[k] for k in ("master_port", "rank_offset", "world_size")}
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints.values()):
            raise BadRequest(f"master_port, rank_offset, world_size must be integers: {ints}")
        if not 1 <= ints["master_port"] <= 65535:
            raise BadRequest(f"master_port {ints['master_port']} must be in [1, 65535]")
        tp = self.engine.tp_size
        if ints["world_size"] > MAX_GROUP_WORLD_SIZE:
            raise BadRequest(
                f"world_size {ints['world_size']} must be at most {MAX_GROUP_WORLD_SIZE}"
            )
        if not 1 <= ints["rank_offset"] <= ints["world_size"] - tp:
            raise BadRequest(
                f"rank_offset {ints['rank_offset']} must be in [1, world_size - tp = "
                f"{ints['world_size'] - tp}] (rank 0 is the trainer; this server's {tp} TP "
                "rank(s) join as rank_offset + tp_rank)"
            )
        address = body["master_address"]
        if not isinstance(address, str) or not address:
            raise BadRequest(f"master_address must be a non-empty string, got {address!r:.80}")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"group_name must be a non-empty string, got {name!r}")
        await self._drop_group(name)  # SGLang replaces a group of the same name (a new trainer)
        try:
            group = await join_group(
                self.engine,
                address,
                ints["master_port"],
                ints["rank_offset"],
                ints["world_size"],
                name,
                backend,
                self.dist_timeout_s,
            )
        except (TimeoutError, RuntimeError, ValueError, TypeError) as err:
            raise BadRequest(f"Failed to initialize custom process group: {err}") from None
        self.groups[name] = group
        return web.json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        from megatron_earl.models.hf_mapping import apply_hf_tensor

        body = await self._json(
            request, DISTRIBUTED_UPDATE_FIELDS, "update_weights_from_distributed"
        )
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            raise BadRequest(
                f"weight-update group {name!r} does not exist (groups: {sorted(self.groups)}); "
                "call init_weights_update_group first"
            )
        load_format = body.get("load_format")
        try:
            self._check_session("update_weights_from_distributed")
            if load_format not in LOAD_FORMATS:
                raise ValueError(f"load_format {load_format!r} is not one of {LOAD_FORMATS}")
            names, shapes = body.get("names"), body.get("shapes")
            raw_dtypes = body.get("dtypes")
            lists = (names, raw_dtypes, shapes)
            if not all(isinstance(x, list) for x in lists) or len({len(x) for x in lists}) != 1:
                raise ValueError("names, dtypes and shapes must be lists of one length")
            if not names:
                raise ValueError("names is empty")
            dtypes = [parse_dtype(d) for d in raw_dtypes]
            if not all(
                isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s)
                for s in shapes
            ):
                raise ValueError(f"shapes must be lists of non-negative integers: {shapes!r:.200}")
            check_metadata(names, dtypes, shapes, self._expected())
            self.check_weights_resident("update_weights_from_distributed")
            if load_format == FLATTENED:
                flattened_sizes(names, dtypes, shapes)
            if body.get("weight_version") is not None:
                parse_weight_version(body["weight_version"])  # _update parses it after receiving
        except (ValueError, TypeError) as err:
            await self._drop_group(name)  # its sender has no receiver for this bucket
            raise BadRequest(
                f"update_weights_from_distributed refused, nothing received or changed: {err}; "
                f"weight-update group {name!r} destroyed (initialise it again)"
            ) from None
        received: list[NamedTensor] = []

        async def receive() -> None:
            try:
                received.extend(await self.groups[name].receive(names, dtypes, shapes, load_format))
            except RuntimeError as err:
                await self._drop_group(name)
                raise BadRequest(
                    f"receiving the bucket over weight-update group {name!r} failed: {err}; "
                    "group destroyed, nothing changed"
                ) from None

        def apply(full: dict[str, torch.Tensor]) -> None:
            for hf_name, tensor in received:
                apply_hf_tensor(full, hf_name, tensor, self.engine.model_config)

        return await self._update(body, apply, before=receive)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._json(request, DESTROY_GROUP_FIELDS, "destroy_weights_update_group")
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            raise BadRequest(f"The group to be destroyed does not exist: {name!r}")
        await self._drop_group(name)
        return web.json_response(
            {"success": True, "message": "Succeeded to destroy custom process group."}
        )

    # ------------------------------------------------------------------ disk

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        from megatron_earl.models.hf_mapping import apply_hf_tensor

        body = await self._json(request, DISK_UPDATE_FIELDS, "update_weights_from_disk")
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest(f"model_path must be a non-empty string, got {path!r}")
        load_format = body.get("load_format")
        if load_format not in DISK_LOAD_FORMATS:
            raise BadRequest(f"load_format {load_format!r} is not one of {DISK_LOAD_FORMATS}")
        try:
            resolved = allowed_path(path, self.weight_dirs)
        except Forbidden as err:
            return error_response(403, str(err))
        try:
            kind, weights = await asyncio.to_thread(read_weights, resolved, load_format)
            if kind == "hf":
                check_named(weights, self._expected())
        except PermissionError as err:
            return error_response(403, f"update_weights_from_disk refused: {err}")
        except Exception as err:
            raise BadRequest(
                f"update_weights_from_disk refused, nothing changed: cannot load {path!r}: {err}"
            ) from None
        if kind == "full":
            return await self._update(body, lambda full: full.update(weights))

        def apply(full: dict[str, torch.Tensor]) -> None:
            for hf_name, tensor in weights:
                apply_hf_tensor(full, hf_name, tensor, self.engine.model_config)

        return await self._update(body, apply)
