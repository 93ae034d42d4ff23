"""MaruKVConnector: vLLM's paged KV cache saved to and loaded from maru, by token prefix.

The prompt is cut into chunks of ``maru_kv_chunk_tokens`` tokens (a multiple of vLLM's block
size). Chunk ``i`` is one maru entry holding the KV of all layers for its tokens; its key is a
hash chained over the chunks before it, so it names the whole prefix up to its end, under a
tag of the model and its KV layout: different models, layouts or dtypes never share a key,
and a prompt that shares only its first chunks with a stored one reuses those chunks.

Scheduler side (vLLM's engine core): for a new request, the longest run of stored chunks is
looked up in the namespace's shared index and held (``batch_pin``: a stored chunk is not
evicted between the lookup and the load; the holds end when the request finishes). Worker
side: the chunks are retrieved (the pool's own pages) and copied into the request's blocks;
KV computed in a step is copied from the paged cache straight into pool memory allocated for
each chunk and published once every layer is in (``batch_store``: one exchange per step).

Configuration (``kv_connector_extra_config``), the original's names:
``maru_storage_backend`` (``cxl``, the default, and ``cpu``: this host's marud, whatever its
pools are; ``remote``: a memory node's pool over NIXL), ``maru_server_url`` (default
``maru://localhost:5555``: this host's marud), ``maru_pool_size`` (a check, default 1G),
``maru_kv_chunk_tokens`` (default 256), ``maru_instance_id``, ``maru_cache_namespace`` (or
maru's ``maru_namespace``; default ``vllm``); ``maru_chunk_size`` and ``maru_eager_map`` are
accepted and unused (an entry's size follows from the model's KV layout; entries are mapped
when retrieved); plus maru's ``maru_timeout_ms`` and ``maru_retry_s`` (how long an
unreachable marud is left alone). The remote backend reads ``maru_remote_url``
(``tcp://HOST:PORT``), ``maru_remote_token``, ``maru_remote_ucx_device``,
``maru_remote_staging_size`` (the registered staging buffer, default ``maru_pool_size``),
``maru_remote_load_reserve``, ``maru_remote_timeout_s`` (one transfer),
``maru_remote_retry_s`` and ``maru_node_id``, and needs ``kv_load_failure_policy``
``recompute``. A store that cannot be reached is a miss: vLLM computes, nothing fails.
``maru_engine_id`` names the engine to marud when ``maru_instance_id`` does not.

``maru_async_load``: the scheduler is told a load is asynchronous; the request waits (vLLM's
WAITING_FOR_REMOTE_KVS) while a worker thread retrieves its chunks and copies them into its
blocks, off the forward pass, and the worker reports it through ``get_finished``; a chunk that
cannot be loaded is a load error for its blocks, which vLLM recomputes.
``maru_async_store``: a step's chunks are copied from the paged cache and published by a
worker thread after the step; a finished request's blocks are kept (``request_finished``
answers True) until its saves are done, and a preempted request's saves finish before vLLM
reuses its blocks (``handle_preemptions``).

``kv_role``: ``kv_both`` loads and saves; ``kv_producer`` (a prefill instance) saves and never
loads; ``kv_consumer`` (a decode instance) loads and never saves, and logs what it had to
compute.
"""

from __future__ import annotations

import hashlib
import re
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from maru.tensors import frombuffer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

DEFAULT_CHUNK_TOKENS = 256


def parse_size(value: Any) -> int:
    """Bytes of ``4G``, ``500M``, ``1.5G`` or an integer."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(value).upper())
    if not m:
        raise ValueError(f"not a size: {value!r} (an integer, or like 4G, 500M)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " "))


#: The original's ``maru_storage_backend`` values: ``cxl`` and ``cpu`` are this host's marud
#: (whatever its pools are: CXL, DAX or DRAM), ``remote`` a memory node's pool over NIXL.
BACKENDS = ("cxl", "cpu", "remote")
#: Keys only the remote backend reads.
REMOTE_KEYS = (
    "maru_remote_url", "maru_remote_token", "maru_remote_ucx_device", "maru_remote_staging_size",
    "maru_remote_load_reserve", "maru_remote_timeout_s", "maru_remote_retry_s",
)


def handler_config(extra: Dict[str, Any], entry_bytes: int):
    """The MaruConfig ``kv_connector_extra_config`` describes; ValueError on a setting that
    cannot work (never ignored in silence)."""
    from maru import MaruConfig

    backend = str(extra.get("maru_storage_backend", "cxl"))
    if backend not in BACKENDS:
        raise ValueError(f"MaruKVConnector: maru_storage_backend {backend!r} is not one of {', '.join(BACKENDS)}")
    ns = extra.get("maru_namespace")
    cache_ns = extra.get("maru_cache_namespace")
    if ns is not None and cache_ns is not None and str(ns) != str(cache_ns):
        raise ValueError(
            f"MaruKVConnector: maru_namespace {ns!r} and maru_cache_namespace {cache_ns!r} name two "
            "namespaces; give one"
        )
    common = dict(
        chunk_size_bytes=entry_bytes,
        # The original's engine id names this engine to marud (its client list) unless an
        # instance id does.
        instance_id=extra.get("maru_instance_id", extra.get("maru_engine_id")),
        timeout_ms=int(extra.get("maru_timeout_ms", 5000)),
        namespace=str(cache_ns if cache_ns is not None else ns if ns is not None else "vllm"),
        auto_connect=False,
    )
    if backend != "remote":
        stray = [k for k in REMOTE_KEYS if k in extra]
        if stray:
            raise ValueError(f"MaruKVConnector: {', '.join(stray)} only apply to maru_storage_backend 'remote'")
        config = MaruConfig(
            server_url=extra.get("maru_server_url", "maru://localhost:5555"),
            pool_size=max(parse_size(extra.get("maru_pool_size", "1G")), entry_bytes),
            **common,
        )
        config.socket  # raises ValueError for a server_url naming another host (at start, not per call)
        return config
    url = extra.get("maru_remote_url")
    if not url:
        raise ValueError("MaruKVConnector: maru_storage_backend 'remote' needs maru_remote_url (tcp://HOST:PORT)")
    if "maru_server_url" in extra:
        raise ValueError("MaruKVConnector: maru_server_url names a local marud; the remote backend uses maru_remote_url")
    # The staging buffer (registered with NIXL once): a step's loads and saves pass through it.
    staging = parse_size(extra.get("maru_remote_staging_size", extra.get("maru_pool_size", "1G")))
    remote = dict(
        storage_backend="remote",
        remote_url=str(url),
        pool_size=max(staging, 4 * entry_bytes),
        remote_ucx_device=str(extra.get("maru_remote_ucx_device", "")),
        remote_transfer_timeout_s=float(extra.get("maru_remote_timeout_s", 30.0)),
        remote_retry_s=float(extra.get("maru_remote_retry_s", 30.0)),
        remote_load_reserve=float(extra.get("maru_remote_load_reserve", 0.5)),
        node_id=extra.get("maru_node_id"),
    )
    if extra.get("maru_remote_token") is not None:
        remote["remote_token"] = str(extra["maru_remote_token"])
    return MaruConfig(**common, **remote)


def _flag(value: Any) -> bool:
    """A boolean setting, as JSON or as text."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class _Store:
    """The connector's handler, connected on first use. A marud (or memory node) that cannot
    be reached is a miss, not an error: the connector logs it, vLLM computes, and the next
    attempt comes after ``retry_s``."""

    def __init__(self, config: Any, retry_s: float) -> None:
        self._config = config
        self._retry_s = retry_s
        self._h = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def get(self):
        """The connected handler, or None while the store is unreachable."""
        if self._h is not None:
            return self._h
        with self._lock:
            if self._h is None and time.monotonic() >= self._next_try:
                from maru import MaruHandler

                h = MaruHandler(self._config)
                if h.connect():
                    self._h = h
                else:
                    where = self._config.remote_url if self._config.is_remote else self._config.socket
                    logger.warning(
                        "MaruKVConnector: cannot reach %s; computing without it, next try in %.0f s",
                        where, self._retry_s,
                    )
                    self._next_try = time.monotonic() + self._retry_s
        return self._h

    def close(self) -> None:
        if self._h is not None:
            self._h.close()
            self._h = None


@dataclass
class ChunkIO:
    """One chunk to load or save: its key and the paged-cache blocks of its tokens."""

    key: str
    index: int  # chunk index in the prompt
    blocks: torch.Tensor  # int64 block ids of the chunk's tokens, from its first block
    first: int = 0  # load only blocks from here on (the rest is in vLLM's own cache)
    req_id: str = ""  # the request a save is for (an asynchronous save holds its blocks)


@dataclass
class MaruConnectorMetadata(KVConnectorMetadata):
    """What the workers do in one step."""

    loads: Dict[str, List[ChunkIO]] = field(default_factory=dict)  # req_id -> chunks, before the forward
    async_loads: Dict[str, List[ChunkIO]] = field(default_factory=dict)  # req_id -> chunks, reported when done
    saves: List[ChunkIO] = field(default_factory=list)
    preempted: List[str] = field(default_factory=list)  # requests whose blocks vLLM frees this step
    idle: bool = False  # no forward pass this step: asynchronous loads run at once


@dataclass
class _ReqState:
    """The scheduler's view of a request it may load for or save from."""

    tokens: List[int]
    keys: List[str]
    block_ids: List[int]
    hits: int  # stored chunks at lookup (held)
    next_save: int  # first chunk not yet saved
    local: int = 0  # tokens vLLM had in its own prefix cache at lookup
    load_from: int = 0  # first token to load (the local ones are not)
    load_to: int = 0  # tokens to load up to
    saving: bool = False  # a save was planned (an asynchronous one holds the blocks at the end)
    load_async: bool = False  # its load is asynchronous (the request waits for it)


class MaruKVConnector(KVConnectorBase_V1):
    """vLLM KV connector over maru (``kv_connector_module_path: maru_vllm``)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._extra = extra
        self._block_size = vllm_config.cache_config.block_size
        chunk = int(extra.get("maru_kv_chunk_tokens", DEFAULT_CHUNK_TOKENS))
        # A chunk covers whole blocks: round up to the block size.
        self._chunk = max(1, -(-chunk // self._block_size)) * self._block_size
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError("MaruKVConnector supports models with one KV cache group")
        spec = groups[0].kv_cache_spec
        self._layers: List[str] = list(groups[0].layer_names)
        self._layer_index = {name: i for i, name in enumerate(self._layers)}
        # Bytes of one token of one layer, from the spec's page size (K and V, every head).
        self._token_bytes = spec.page_size_bytes // self._block_size
        self._dtype: torch.dtype = spec.dtype
        self._entry_bytes = len(self._layers) * self._chunk * self._token_bytes
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        layout = (
            f"{model.model}|rev={model.revision}|{type(spec).__name__}|heads={spec.num_kv_heads}"
            f"|head={spec.head_size}|{spec.dtype}|layers={len(self._layers)}|tp={parallel.tensor_parallel_size}"
            f"|pp={parallel.pipeline_parallel_size}|chunk={self._chunk}|block={self._block_size}"
        )
        self._tag = hashlib.sha256(layout.encode()).hexdigest()[:16]
        self._prefix = f"{model.model}@{self._tag}"
        # With tensor parallelism each rank holds its own heads and stores its own share under
        # its own name (suffix @tpN, set in register_kv_caches); the scheduler looks up rank 0's
        # (a rank that finds its share gone fails that load, and vLLM recomputes it).
        self._tp = parallel.tensor_parallel_size
        self._suffix = ""
        self._lookup_suffix = "@tp0" if self._tp > 1 else ""
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "MaruKVConnector: pipeline parallelism is not supported (each stage holds other "
                f"layers and would need keys of its own); pipeline_parallel_size is {parallel.pipeline_parallel_size}"
            )
        # Disaggregated prefill: a producer (prefill) saves and never loads, a consumer
        # (decode) loads and never saves, kv_both does both.
        transfer = self._kv_transfer_config
        self._loads = bool(transfer.is_kv_consumer)
        self._saves = bool(transfer.is_kv_producer)
        self._async_load = _flag(extra.get("maru_async_load", False))
        self._async_store = _flag(extra.get("maru_async_store", False))
        self._config = handler_config(extra, self._entry_bytes)
        if self._config.is_remote:
            # A memory node that dies between a lookup and its load fails that load: vLLM must
            # recompute those blocks rather than fail the request.
            policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
            if policy != "recompute":
                raise ValueError(
                    "MaruKVConnector: maru_storage_backend 'remote' needs kv_load_failure_policy "
                    f"'recompute' (it is {policy!r}): a memory node that fails must make vLLM recompute"
                )
        retry = self._config.remote_retry_s if self._config.is_remote else float(extra.get("maru_retry_s", 5.0))
        self._store = _Store(self._config, retry)
        # Scheduler state.
        self._reqs: Dict[str, _ReqState] = {}
        self._held: Dict[str, List[str]] = {}
        self._async_plans: Dict[str, List[ChunkIO]] = {}  # loads to start in the next step
        # Worker state.
        self._kv_caches: Dict[str, torch.Tensor] = {}
        self._pending: Dict[str, Tuple[Any, torch.Tensor, int]] = {}  # key -> (handle, tensor, layers written)
        self._skip: set = set()  # chunks this step does not save (stored already, or no memory)
        self._load_errors: set = set()
        self._save_device: Optional[torch.device] = None  # a CUDA device saves copy from
        # Asynchronous loads and saves: one thread each; what they finished, under _done_lock.
        self._threads: Dict[str, ThreadPoolExecutor] = {}
        self._done_lock = threading.Lock()
        self._loaded: Dict[str, set] = {}  # req_id -> block ids that failed, since get_finished
        self._save_jobs: List[Future] = []
        self._saving: Dict[str, int] = {}  # req_id -> its save jobs not finished
        self._finishing: set = set()  # requests vLLM finished whose saves may still run
        logger.info(
            "MaruKVConnector: %s chunks of %d tokens, %d bytes each, namespace %s%s%s",
            self._prefix, self._chunk, self._entry_bytes, self._config.namespace,
            f", remote {self._config.remote_url}" if self._config.is_remote else "",
            "".join(f", {k} asynchronous" for k, on in (("loads", self._async_load), ("saves", self._async_store)) if on),
        )

    # -- shared --------------------------------------------------------------------------------

    def chunk_keys(self, tokens: List[int], request: Any = None) -> List[str]:
        """The keys of the full chunks of ``tokens``: chunk i's names tokens[: (i+1)*chunk],
        and what else makes ``request``'s KV what it is, as vLLM's own prefix cache counts it:
        its cache salt and LoRA adapter (every chunk), its multimodal inputs (from the chunk
        where each one's placeholder starts: the tokens of two images' placeholders are the
        same). A rank's entry is its key with the rank's suffix (:meth:`_mine`)."""
        seed = self._prefix
        salt = getattr(request, "cache_salt", None)
        lora = getattr(request, "lora_request", None)
        if salt:
            seed += f"|salt={salt}"
        if lora is not None:
            seed += f"|lora={lora.lora_name}"
        inputs = sorted((f.mm_position.offset, f.identifier) for f in getattr(request, "mm_features", None) or [])
        keys, h = [], hashlib.sha256(seed.encode()).digest()
        for start in range(0, len(tokens) - self._chunk + 1, self._chunk):
            piece = tokens[start : start + self._chunk]
            mixed = "".join(f"|mm={i}" for at, i in inputs if start <= at < start + self._chunk)
            h = hashlib.sha256(h + struct.pack(f"<{len(piece)}q", *piece) + mixed.encode()).digest()
            keys.append(f"{self._prefix}@{h.hex()[:32]}")
        return keys

    def _mine(self, key: str) -> str:
        """This worker's entry of chunk ``key``: its tensor-parallel rank's share."""
        return key + self._suffix

    def _blocks(self, block_ids: List[int], start: int, end: int) -> torch.Tensor:
        """The blocks of tokens [start, end) (both block aligned, or end the prompt's)."""
        return torch.tensor(block_ids[start // self._block_size : -(-end // self._block_size)], dtype=torch.int64)

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        tokens = list(request.prompt_token_ids or [])
        keys = self.chunk_keys(tokens, request)
        hits = 0
        self._unhold(self._held.pop(request.request_id, None))
        h = self._store.get() if keys and self._loads else None
        if h is not None:
            names = [k + self._lookup_suffix for k in keys]
            try:
                found = h.batch_pin(names)  # held: not evicted before the worker loads them
            except OSError as e:  # the store failed: a miss, vLLM computes
                logger.warning("MaruKVConnector: lookup failed, computing: %s", e)
                found = []
            while hits < len(found) and found[hits]:
                hits += 1
            if hits:
                self._held[request.request_id] = names[:hits]
            self._unhold([k for k, f in zip(names[hits:], found[hits:]) if f])
        # Other requests this instance is serving: what an asynchronous load runs beside.
        others = any(r != request.request_id for r in self._reqs)
        before = self._reqs.get(request.request_id)  # a request preempted and scheduled again
        st = self._reqs[request.request_id] = _ReqState(
            tokens=tokens, keys=keys, block_ids=[], hits=hits, next_save=hits, local=num_computed_tokens,
            # Its workers report it when it finishes if it ever had a save (they track the
            # request, not this lookup): vLLM must be told to wait for that report.
            saving=before is not None and before.saving,
        )
        # vLLM computes at least the last prompt token itself, and loads whole blocks: the
        # last stored chunk may be loaded in part.
        usable = (len(tokens) - 1) // self._block_size * self._block_size
        matched = min(hits * self._chunk, max(0, usable))
        if self._loads and not self._saves and keys and hits < len(keys):
            # A consumer computes what it cannot load: say so (a prefill instance missed it).
            logger.info(
                "MaruKVConnector: request %s: %d of %d prompt tokens found stored, computing the rest",
                request.request_id, matched, len(tokens),
            )
        external = max(0, matched - num_computed_tokens)
        # An asynchronous load keeps the requests already running going while it is made, and
        # costs the loading request one engine step (vLLM schedules its prefill in the step
        # after the one whose output reports the load). With no other request there is nothing
        # to keep going: the load is made in the request's first step, as a synchronous one.
        st.load_async = self._async_load and external > 0 and others
        return external, st.load_async

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return
        st.load_from = st.local
        st.load_to = st.local + num_external_tokens
        if st.load_async:
            # The request waits for its load, which starts in the next step: its blocks are
            # the ones allocated now.
            st.block_ids = list(blocks.get_block_ids()[0])
            self._async_plans[request.request_id] = self._load_plan(st)
            st.load_to = st.load_from = 0

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = MaruConnectorMetadata(
            preempted=sorted(scheduler_output.preempted_req_ids or ()),
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        meta.async_loads, self._async_plans = self._async_plans, {}
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan_load(new.req_id, st, meta)
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._plan_saves(new.req_id, st, done, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Resumed after a preemption, with all its blocks anew (the V1 model runner's
                # way; the V2 runner's comes as a new request): its load, if it has one, is
                # planned as a new request's.
                st.block_ids = list(new_blocks[0]) if new_blocks else []
                self._plan_load(req_id, st, meta)
            elif new_blocks:
                st.block_ids.extend(new_blocks[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan_saves(req_id, st, done, meta)
        return meta

    def _plan_load(self, req_id: str, st: _ReqState, meta: MaruConnectorMetadata) -> None:
        """The synchronous load of a request scheduled with its blocks, if it has one."""
        if st.load_to > st.load_from:
            meta.loads[req_id] = self._load_plan(st)
            st.load_to = st.load_from = 0

    def _load_plan(self, st: _ReqState) -> List[ChunkIO]:
        plan = []
        for c in range(st.load_from // self._chunk, -(-st.load_to // self._chunk)):
            start = c * self._chunk
            end = min(start + self._chunk, st.load_to)
            plan.append(ChunkIO(
                key=st.keys[c], index=c, blocks=self._blocks(st.block_ids, start, end),
                first=max(0, st.load_from - start) // self._block_size,
            ))
        return plan

    def _plan_saves(self, req_id: str, st: _ReqState, computed: int, meta: MaruConnectorMetadata) -> None:
        """Chunks of the prompt whose every token is in the paged cache after this step."""
        if not self._saves:
            return
        last = min(computed, len(st.tokens)) // self._chunk
        while st.next_save < min(last, len(st.keys)):
            c = st.next_save
            start = c * self._chunk
            if (start + self._chunk - 1) // self._block_size >= len(st.block_ids):
                break  # its blocks are not all known yet
            st.next_save += 1
            if any(s.key == st.keys[c] for s in meta.saves):
                continue  # another request of this step saves the same chunk (a shared prefix)
            meta.saves.append(ChunkIO(
                key=st.keys[c], index=c, blocks=self._blocks(st.block_ids, start, start + self._chunk), req_id=req_id,
            ))
            st.saving = True

    def _unhold(self, keys: Optional[List[str]]) -> None:
        h = self._store.get() if keys else None
        if h is None:
            return
        try:
            h.batch_unpin(keys)
        except OSError as e:  # a local marud's holds end with the connection anyway
            logger.warning("MaruKVConnector: unpin failed: %s", e)

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        st = self._reqs.pop(request.request_id, None)
        self._unhold(self._held.pop(request.request_id, None))
        # Asynchronous saves read the request's blocks after it ends: vLLM keeps them until
        # the workers report the request in get_finished (each worker tracks the same requests:
        # those with a save in the metadata).
        return self._async_store and st is not None and st.saving, None

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]):
        self._kv_caches = dict(kv_caches)
        if self._tp > 1:
            from vllm.distributed import get_tensor_model_parallel_rank

            self._suffix = f"@tp{get_tensor_model_parallel_rank()}"

    def _chunk_tensor(self, buf: Any, layer: torch.Tensor) -> torch.Tensor:
        """A chunk entry as [layers, blocks, *block shape]: each layer's blocks as vLLM's
        paged cache holds them ([heads, block_size, channels]), so loads and saves copy whole
        blocks."""
        t = frombuffer(buf, count=self._entry_bytes)
        nb = self._chunk // self._block_size
        per_block = layer[0].numel() * layer.element_size()
        if len(self._layers) * nb * per_block != self._entry_bytes:
            raise ValueError(
                f"MaruKVConnector: a block of {tuple(layer.shape[1:])} {layer.dtype} is {per_block} bytes, "
                f"not the {self._entry_bytes // (len(self._layers) * nb)} the KV cache spec says"
            )
        return t.view(layer.dtype).view(len(self._layers), nb, *layer.shape[1:])

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MaruConnectorMetadata)
        if not meta.loads and not meta.async_loads:
            return
        layers = {name: forward_context.no_compile_layers[name].kv_cache for name in self._layers}
        if meta.loads:
            self._load_errors.update(self._load(meta.loads, layers))
            logger.debug("MaruKVConnector: loaded %d requests", len(meta.loads))
        for req_id, plan in meta.async_loads.items():
            if meta.idle:
                # Nothing to keep off the critical path: loaded now, reported in this step.
                self._load_async(req_id, plan, layers)
            else:
                self._thread("load").submit(self._load_async, req_id, plan, layers)

    def _retrieve(self, h: Any, keys: List[str]) -> List[Any]:
        """The entries of ``keys`` (None where missing), the pool's own pages."""
        return h.batch_retrieve(keys)

    def _load(self, plans: Dict[str, List[ChunkIO]], layers: Dict[str, torch.Tensor]) -> set:
        """Copy the chunks of ``plans`` into their blocks; the block ids that could not be
        loaded (vLLM recomputes them). Copies to a CUDA device are waited for on the current
        stream."""
        h = self._store.get()
        some = next(iter(layers.values()))
        failed: set = set()
        in_flight = []  # the entries copies read from, kept until the copies are done
        for req_id, plan in plans.items():
            infos: List[Any] = [None] * len(plan)
            if h is not None:
                try:
                    infos = self._retrieve(h, [self._mine(c.key) for c in plan])
                except OSError as e:  # the store failed after the lookup: vLLM recomputes
                    logger.warning("MaruKVConnector: load of %s failed, recomputing: %s", req_id, e)
            for chunk, info in zip(plan, infos):
                if info is None or len(info.view) < self._entry_bytes:
                    # Evicted, deleted or unreachable after all: vLLM recomputes these blocks.
                    failed.update(chunk.blocks[chunk.first :].tolist())
                    continue
                if some.is_cuda and not h.is_remote:
                    h.tensors.register_entry(info)  # DMA from the pool's pages
                src = self._chunk_tensor(info.view, some)
                n = len(chunk.blocks)
                blocks = chunk.blocks[chunk.first :].to(some.device)
                for name, i in self._layer_index.items():
                    layers[name].index_copy_(0, blocks, src[i, chunk.first : n].to(some.device, non_blocking=True))
            in_flight.extend(infos)
        if some.is_cuda:
            torch.cuda.current_stream(some.device).synchronize()
        if h is not None and h.is_remote:
            h.release_retrieved(in_flight)  # their staging memory serves the next loads
        return failed

    def _load_async(self, req_id: str, plan: List[ChunkIO], layers: Dict[str, torch.Tensor]) -> None:
        """A request's load on the load thread (the forward passes go on meanwhile: nothing
        reads the request's blocks until it is reported finished)."""
        try:
            some = next(iter(layers.values()))
            with torch.cuda.stream(torch.cuda.Stream(some.device)) if some.is_cuda else nullcontext():
                failed = self._load({req_id: plan}, layers)
        except Exception as e:  # noqa: BLE001 - whatever failed, vLLM must hear the request finished
            logger.warning("MaruKVConnector: load of %s failed, recomputing: %s", req_id, e)
            failed = {b for c in plan for b in c.blocks[c.first :].tolist()}
        with self._done_lock:
            self._loaded[req_id] = failed

    def _thread(self, job: str) -> ThreadPoolExecutor:
        """The worker's thread for asynchronous ``job``s (loads, saves), made on first use."""
        if job not in self._threads:
            self._threads[job] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"maru-{job}")
        return self._threads[job]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MaruConnectorMetadata)
        if not meta.saves or self._async_store:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        h = self._store.get()
        if h is None:
            return  # unreachable: nothing is saved this step
        for chunk in meta.saves:
            key = self._mine(chunk.key)
            if key in self._skip:
                continue
            pending = self._pending.get(key)
            if pending is None:
                handle = self._allocate(h, chunk)
                if handle is None:
                    self._skip.add(key)
                    continue
                pending = (handle, self._chunk_tensor(handle.buf, kv_layer), 0)
            handle, dst, written = pending
            if kv_layer.device != dst.device:
                self._save_device = kv_layer.device  # waited for in wait_for_save
            self._copy_blocks(kv_layer, chunk.blocks, dst[i])
            self._pending[key] = (handle, dst, written + 1)

    def _allocate(self, h: Any, chunk: ChunkIO) -> Optional[Any]:
        """Pool memory for a chunk to save, or None: stored already (by another instance
        meanwhile), or no memory."""
        try:
            if h.exists(self._mine(chunk.key)):
                return None
            return h.tensors.take(self._entry_bytes)  # registered for DMA where CUDA is
        except OSError as e:  # full or failed: this chunk is not saved
            logger.warning("MaruKVConnector: chunk %d not saved: %s", chunk.index, e)
            return None

    @staticmethod
    def _copy_blocks(layer: torch.Tensor, blocks: torch.Tensor, dst: torch.Tensor) -> None:
        """A layer's ``blocks`` into ``dst`` (pool memory): one copy; from device memory a DMA
        on the current stream, to be waited for."""
        blocks = blocks.to(layer.device)
        if layer.device == dst.device:
            torch.index_select(layer, 0, blocks, out=dst)
        else:
            dst.copy_(layer.index_select(0, blocks), non_blocking=True)

    def wait_for_save(self):
        if self._async_store:
            self._save_later()
            return
        self._skip.clear()
        ready = [(k, p[0]) for k, p in self._pending.items() if p[2] == len(self._layers)]
        if not ready:
            return
        for k, _ in ready:
            del self._pending[k]
        h = self._store.get()
        if self._save_device is not None:
            torch.cuda.current_stream(self._save_device).synchronize()
        self._publish(h, ready)

    def _publish(self, h: Any, ready: List[Tuple[str, Any]]) -> None:
        """Publish chunks whose pool memory holds every layer."""
        try:
            for _, handle in ready:
                h.tensors.unregister_alloc(handle)  # publication replaces the mapping
            results = h.batch_store([k for k, _ in ready], [h for _, h in ready])
        except OSError as e:  # the allocations end with the failed store
            logger.warning("MaruKVConnector: %d chunks not stored: %s", len(ready), e)
            return
        failed = [k for (k, _), ok in zip(ready, results) if not ok]
        if failed:
            logger.warning("MaruKVConnector: %d chunks not stored (pools full or unreachable)", len(failed))

    def _save_later(self) -> None:
        """Hand this step's chunks to the save thread; their requests are held (their blocks
        kept) until it has copied and published them."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, MaruConnectorMetadata)
        if not meta.saves:
            return
        some = next(iter(self._kv_caches.values()))
        ready = None
        if some.is_cuda:  # the save stream waits for what this step wrote
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(some.device))
        reqs = {c.req_id for c in meta.saves}
        with self._done_lock:
            for r in reqs:
                self._saving[r] = self._saving.get(r, 0) + 1
        self._save_jobs = [j for j in self._save_jobs if not j.done()]
        self._save_jobs.append(self._thread("save").submit(self._save_async, list(meta.saves), ready))

    def _save_async(self, chunks: List[ChunkIO], ready: Any) -> None:
        """Copy chunks from the paged cache into pool memory and publish them (save thread)."""
        ready_chunks: List[Tuple[str, Any]] = []
        h = None
        try:
            h = self._store.get()
            if h is None:
                return  # unreachable: nothing is saved
            some = next(iter(self._kv_caches.values()))
            stream = torch.cuda.Stream(some.device) if some.is_cuda else None
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                if stream is not None:
                    stream.wait_event(ready)
                for chunk in chunks:
                    handle = self._allocate(h, chunk)
                    if handle is None:
                        continue
                    ready_chunks.append((self._mine(chunk.key), handle))
                    dst = self._chunk_tensor(handle.buf, some)
                    for name, i in self._layer_index.items():
                        self._copy_blocks(self._kv_caches[name], chunk.blocks, dst[i])
                if stream is not None:
                    stream.synchronize()
            chunks_done, ready_chunks = ready_chunks, []
            self._publish(h, chunks_done)
        except Exception as e:  # noqa: BLE001 - the thread must finish its requests whatever happens
            logger.warning("MaruKVConnector: %d chunks not stored: %s", len(chunks), e)
            self._free(h, [handle for _, handle in ready_chunks])
        finally:
            with self._done_lock:
                for r in {c.req_id for c in chunks}:
                    self._saving[r] -= 1

    @staticmethod
    def _free(h: Any, handles: List[Any]) -> None:
        """Give back allocations that will not be published."""
        for handle in handles:
            try:
                h.tensors.unregister_alloc(handle)
                h.free(handle)
            except (OSError, ValueError) as e:
                logger.debug("MaruKVConnector: an unsaved chunk's allocation: %s", e)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM frees a preempted request's blocks and may write them in this very step: the
        # saves that read them finish first.
        if isinstance(kv_connector_metadata, MaruConnectorMetadata) and kv_connector_metadata.preempted:
            wait(self._save_jobs)

    def get_finished(self, finished_req_ids: set) -> Tuple[Optional[set], Optional[set]]:
        with self._done_lock:
            loaded, self._loaded = self._loaded, {}
            self._finishing.update(r for r in finished_req_ids if r in self._saving)
            saved = {r for r in self._finishing if self._saving[r] == 0}
            for r in saved:
                self._finishing.discard(r)
                del self._saving[r]
        # A finished load's failed blocks are reported in this same step (vLLM asks for them
        # after get_finished).
        for failed in loaded.values():
            self._load_errors.update(failed)
        return saved or None, set(loaded) or None

    def get_block_ids_with_load_errors(self) -> set:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        for pool in self._threads.values():
            pool.shutdown(wait=True)  # the loads and saves under way finish
        if self._pending and self._save_device is not None:
            torch.cuda.current_stream(self._save_device).synchronize()
        h = self._store.get() if self._pending else None
        if h is not None:
            self._free(h, [handle for handle, _, _ in self._pending.values()])
        self._pending.clear()
        self._store.close()
