"""kvforge inside vLLM: a KV connector (vLLM's ``KVConnectorBase_V1``) that keeps the blocks vLLM
computes in a kvforge cache in host memory, in any kvforge layout and storage dtype, and serves vLLM's
prefix-cache misses from it.

    from vllm import LLM
    from vllm.config import KVTransferConfig
    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="KvforgeConnector", kv_connector_module_path="kvforge.vllm", kv_role="kv_both",
        kv_connector_extra_config={"storage": "int8", "host_bytes": 4 << 30}))

kv_connector_extra_config (every key optional):
    storage      the store's dtype: the model's (default), int8, fp8_e4m3, fp8_e5m2, fp4_e2m1 (NVFP4),
                 int4, uint4;
    layout       a kvforge layout (name, spec file or dict) whose page size divides vLLM's block size and
                 that takes that storage (default: STORE_LAYOUTS[storage], else "vllm_paged_nhd");
    host_bytes   the store's size (default 1 GiB);
    priority     the default retention priority (0..100).
Per request, ``SamplingParams(extra_args={"kv_transfer_params": {"kvforge_priority": 90}})`` keeps its
blocks longer (kvforge's retention: the lowest priority, then the oldest, is evicted first).

The scheduler side answers ``get_num_new_matched_tokens`` from kvforge's prefix index and pins what it
promised; the worker side copies those blocks into vLLM's K/V tensors before the forward, and after
each layer's forward copies that layer's newly full blocks into the store (``save_kv_layer``). Both
go through the kvforge cache's append and gather: quantized on the way in, dequantized on the way out.
The two sides may be processes apart (vLLM's default): the scheduler keeps a shadow of the store's
index, which decides, and each step's metadata carries its log of operations, which the worker's store
replays before that step's copies (kvforge._vllm_store).
``take_events`` returns the store's KV events as vLLM's own ``BlockStored``/``BlockRemoved``/
``AllBlocksCleared``, medium "CPU", with kvforge's block hashes (kvforge.kv_events.block_hash).

Scope: one worker (tensor and pipeline parallel are refused at start); vLLM's attention backend
CPU_ATTN, whose K/V placement within a block is found through vLLM's own cache write, per ISA (GPU
backends are refused until run on a GPU); requests with multimodal inputs or prompt embeddings are not
served from the store (their blocks depend on more than token ids).
"""

import dataclasses
import logging

import torch
from vllm.distributed.kv_events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)

from ._vllm_store import Store, salt_of
from .errors import ArgumentError, UnsupportedError

__all__ = ["KvforgeConnector", "STORE_LAYOUTS"]

logger = logging.getLogger(__name__)


def _cpu_block_orders(dtype, block_size, head_dim, isa):
    """Where vLLM's own CPU cache write (ops.cpu_attn_reshape_and_cache, per ISA: "vec" keeps K dim-major,
    "amx" in pairs of tokens) puts K[t, d] and V[t, d] of one block's head: int64 [B * D] each, flat
    positions among the head's B * 2D elements. Found by writing known values through it once: integers
    up to 128 that every float dtype holds exactly, in two digits base 128."""
    from vllm import _custom_ops as ops
    shape = (block_size, 1, head_dim)
    token = torch.arange(block_size).view(block_size, 1, 1).expand(shape)
    dim = torch.arange(head_dim).view(1, 1, head_dim).expand(shape)

    def written(values, part):
        block = torch.zeros((1, 1, block_size, 2 * head_dim), dtype=dtype)
        k_cache, v_cache = block.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
        zero = torch.zeros(shape, dtype=dtype)
        k, v = (values.to(dtype), zero) if part == 0 else (zero, values.to(dtype))
        ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, torch.arange(block_size), isa)
        return block.flatten().long()

    orders = []
    for part in (0, 1):
        low_t, high_t = written(token % 128 + 1, part), written(token // 128 + 1, part)
        low_d, high_d = written(dim % 128 + 1, part), written(dim // 128 + 1, part)
        where = (low_t > 0).nonzero().flatten()
        key = ((low_t - 1) + 128 * (high_t - 1)) * head_dim + (low_d - 1) + 128 * (high_d - 1)
        order = torch.full((block_size * head_dim,), -1, dtype=torch.long)
        order[key[where]] = where
        if where.numel() != order.numel() or (order < 0).any():
            raise UnsupportedError(f"kvforge.vllm: vLLM's CPU cache write (isa {isa}) does not place each of a "
                                   f"block's {block_size} x {head_dim} values once")
        orders.append(order)
    return tuple(orders)


# The layout a storage dtype gets unless kv_connector_extra_config names one: scales per token and head
# (or per block of 16 values) kept in the page, as an offload tier needs; vllm_paged_nhd's quantized
# variants take vLLM's static per-tensor scales instead, which a store has no way to calibrate.
STORE_LAYOUTS = {"int8": "flashinfer_paged_hnd", "fp8_e4m3": "flashinfer_paged_hnd", "fp8_e5m2": "flashinfer_paged_hnd",
                 "fp4_e2m1": "paged_nvfp4", "int4": "paged_grouped", "uint4": "paged_zero_point"}


@dataclasses.dataclass
class _Copy:
    req_id: str
    seq: int                  # the store's sequence that holds the pages (its pin or reservation)
    blocks: list              # vLLM block ids covering tokens [begin // B * B, end), one per block
    begin: int                # token range [begin, end) of the request
    end: int
    failed: list = dataclasses.field(default_factory=list)  # a load: vLLM blocks promised and not loaded


@dataclasses.dataclass
class KvforgeMetadata(KVConnectorMetadata):
    log: list = dataclasses.field(default_factory=list)    # the scheduler's store operations, to replay first
    loads: list = dataclasses.field(default_factory=list)
    saves: list = dataclasses.field(default_factory=list)


def _model_dims(kv_cache_config):
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedError(f"kvforge.vllm: {len(groups)} KV cache groups (a hybrid or sliding-window model); "
                               f"the connector serves one group of full attention")
    spec = groups[0].kv_cache_spec
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size or not hasattr(spec, "num_kv_heads"):
        raise UnsupportedError(f"kvforge.vllm: {type(spec).__name__} (K and V of other widths, or MLA) is not "
                               f"served yet; the connector takes full attention with K and V of one width")
    dtypes = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    if spec.dtype not in dtypes:
        raise UnsupportedError(f"kvforge.vllm: vLLM's KV cache dtype {spec.dtype} (allowed: bf16, fp16, fp32; "
                               f"kvforge quantizes the store itself: set kv_connector_extra_config's storage)")
    return dict(layers=len(groups[0].layer_names), kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                input=dtypes[spec.dtype], block_size=spec.block_size), list(groups[0].layer_names)


def _store_for(vllm_config, dims, shadow):
    config = vllm_config.kv_transfer_config
    extra = dict(config.kv_connector_extra_config or {})
    known = {"layout", "storage", "host_bytes", "priority"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ArgumentError(f"kv_connector_extra_config.{unknown[0]}: not a kvforge.vllm setting "
                            f"(allowed: {', '.join(sorted(known))})")
    host_bytes, priority = extra.get("host_bytes", 1 << 30), extra.get("priority")
    if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes <= 0:
        raise ArgumentError(f"kv_connector_extra_config.host_bytes: {host_bytes!r} is not a size in bytes "
                            f"(allowed: an integer > 0)")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int) or
                                 not 0 <= priority <= 100):
        raise ArgumentError(f"kv_connector_extra_config.priority: {priority!r} (allowed: an integer in [0, 100])")
    storage = extra.get("storage", dims["input"])
    if not isinstance(storage, str):
        raise ArgumentError(f"kv_connector_extra_config.storage: {storage!r} is not a dtype name (allowed: "
                            f"{dims['input']}, {', '.join(STORE_LAYOUTS)})")
    events = vllm_config.kv_events_config is not None and vllm_config.kv_events_config.enable_kv_cache_events
    return Store(layout=extra.get("layout", STORE_LAYOUTS.get(storage, "vllm_paged_nhd")), storage=storage,
                 host_bytes=host_bytes, priority=priority,
                 kv_events=shadow and events, shadow=shadow, **dims)


class KvforgeConnector(KVConnectorBase_V1):
    """vLLM's KV connector over a kvforge store (module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise UnsupportedError(f"kvforge.vllm: tensor_parallel_size {parallel.tensor_parallel_size} x "
                                   f"pipeline_parallel_size {parallel.pipeline_parallel_size} (allowed: 1: one worker "
                                   f"and its store)")
        dims, layer_names = _model_dims(kv_cache_config)
        self._store = _store_for(vllm_config, dims, shadow=role == KVConnectorRole.SCHEDULER)
        self._block = self._store.block_size
        self._layer_index = {name: i for i, name in enumerate(layer_names)}
        # Scheduler side, per request: the request, its vLLM blocks, tokens the store holds, a pending load.
        self._requests = {}
        self._blocks = {}
        self._saved = {}
        self._planned = {}
        self._asked = {}
        self._to_free = []  # store sequences whose copies the step built last ran: freed in the next log
        # Worker side: vLLM's layers, and the pages and slots the step's replayed log gave each sequence.
        self._kv_caches = {}
        self._held = {}
        self._orders = {}
        self._load_errors = set()

    # ---- scheduler side ------------------------------------------------------------------------------

    def _salt(self, request):
        lora = getattr(request, "lora_request", None)
        return salt_of(lora.lora_name if lora else None, getattr(request, "cache_salt", None))

    @staticmethod
    def _servable(request):
        return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._requests[request.request_id] = request
        if not self._servable(request):
            return 0, False
        self._asked[request.request_id] = num_computed_tokens  # block-aligned: where a load would begin
        hit = self._store.cached(request.all_token_ids, self._salt(request))
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._requests[request.request_id] = request
        if num_external_tokens <= 0:
            return
        begin = self._asked.pop(request.request_id)
        end = begin + num_external_tokens
        seq, covered = self._store.pin(request.all_token_ids, end, self._salt(request))
        self._planned[request.request_id] = (seq, begin, end, covered)

    def _block_list(self, req_id, new_block_ids, replace):
        if new_block_ids is not None:
            ids = list(new_block_ids[0])
            self._blocks[req_id] = ids if replace else self._blocks.get(req_id, []) + ids
        return self._blocks.get(req_id, [])

    def _plan(self, meta, req_id, blocks, computed_end):
        request = self._requests.get(req_id)
        if request is None:
            return
        B = self._block
        if req_id in self._planned:
            seq, begin, end, covered = self._planned.pop(req_id)
            # vLLM pins right after it asks, so covered == end; should it fall short, the rest is reported
            # as load errors (get_block_ids_with_load_errors), never read from pages the pin does not hold.
            loaded = max(begin, covered)
            meta.loads.append(_Copy(req_id, seq, blocks[begin // B:loaded // B], begin, loaded,
                                    failed=blocks[loaded // B:end // B]))
            self._to_free.append(seq)
        if not self._servable(request):
            return
        full = min(computed_end, len(request.all_token_ids)) // B * B
        if full <= self._saved.get(req_id, 0):
            return
        taken = self._store.reserve(request.all_token_ids, full, self._salt(request), self._priority(request))
        self._saved[req_id] = full
        if taken is not None:
            seq, begin = taken
            meta.saves.append(_Copy(req_id, seq, blocks[begin // B:(full + B - 1) // B], begin, full))
            self._to_free.append(seq)

    @staticmethod
    def _priority(request):
        """The request's kv_transfer_params["kvforge_priority"], or None (the default). A bad one is said in
        the log, naming the request and the range, and the default kept: raising here would end the engine."""
        params = getattr(request, "kv_transfer_params", None)
        priority = params.get("kvforge_priority") if isinstance(params, dict) else None
        if priority is None or (isinstance(priority, int) and not isinstance(priority, bool) and 0 <= priority <= 100):
            return priority
        logger.warning("kvforge.vllm: request %s: kv_transfer_params.kvforge_priority = %r is not an integer in "
                       "[0, 100]; its blocks keep the default priority", request.request_id, priority)
        return None

    def build_connector_meta(self, scheduler_output):
        meta = KvforgeMetadata()
        # The last step's copies ran before this step's (a worker runs steps in order): its pins and
        # reservations go back to the store, evictable, in this step's log.
        freed, self._to_free = self._to_free, []
        self._store.free(freed)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            blocks = self._block_list(new.req_id, new.block_ids, replace=True)
            self._plan(meta, new.req_id, blocks, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            resumed = req_id in cached.resumed_req_ids
            blocks = self._block_list(req_id, cached.new_block_ids[i], replace=resumed)
            self._plan(meta, req_id, blocks, cached.num_computed_tokens[i] + scheduled[req_id])
        meta.log = self._store.take_log()
        return meta

    def request_finished(self, request, block_ids):
        for table in (self._requests, self._blocks, self._saved, self._asked):
            table.pop(request.request_id, None)
        planned = self._planned.pop(request.request_id, None)
        if planned is not None:  # pinned for a load that never ran
            self._to_free.append(planned[0])
        return False, None

    def take_events(self):
        events = []
        for event in self._store.take_events():
            kind = event["type"]
            if kind == "BlockStored":
                events.append(BlockStored(block_hashes=event["block_hashes"], parent_block_hash=event["parent_block_hash"],
                                          token_ids=event["token_ids"], block_size=event["block_size"], lora_id=None,
                                          medium=MEDIUM_CPU, lora_name=None))
            elif kind == "BlockRemoved":
                events.append(BlockRemoved(block_hashes=event["block_hashes"], medium=MEDIUM_CPU))
            else:
                events.append(AllBlocksCleared())
        return events

    def reset_cache(self):
        self._store.reset()
        return True

    # ---- worker side ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        self._kv_caches = dict(kv_caches)

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        self._held = self._store.replay(connector_metadata.log)

    def _blocks_of(self, layer_name, kv):
        """A layer as [blocks, H, E] and where K and V sit in it (_cpu_block_orders), for its backend."""
        from vllm.forward_context import get_forward_context
        layer = get_forward_context().no_compile_layers[layer_name]
        backend = layer.get_attn_backend().get_name()
        if backend != "CPU_ATTN":
            raise UnsupportedError(f"kvforge.vllm: layer {layer_name}'s attention backend {backend} (allowed: "
                                   f"CPU_ATTN): its K/V placement is not known to the connector")
        key = (kv.dtype, self._block, kv.shape[3] // 2, layer.isa)
        if key not in self._orders:
            self._orders[key] = _cpu_block_orders(*key)
        return kv.view(kv.shape[0], kv.shape[1], -1), *self._orders[key]

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        for copy in meta.loads:
            self._load_errors.update(copy.failed)
        for name, layer in self._layer_index.items():
            blocks, k_order, v_order = self._blocks_of(name, self._kv_caches[name])
            for copy in (c for c in meta.loads if c.end > c.begin):
                pages = self._held[copy.seq][0]
                self._store.load(layer, blocks, k_order, v_order, copy.blocks, pages, copy.begin, copy.end)

    def wait_for_layer_load(self, layer_name):
        return  # start_load_kv copies every layer before the forward

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        meta = self._get_connector_metadata()
        if not meta.saves or layer_name not in self._layer_index:
            return
        blocks, k_order, v_order = self._blocks_of(layer_name, kv_layer)
        layer = self._layer_index[layer_name]
        for copy in meta.saves:
            self._store.save(layer, blocks, k_order, v_order, copy.blocks, copy.begin, self._held[copy.seq][1])

    def wait_for_save(self):
        return  # save_kv_layer wrote each layer as its forward ended

    def get_block_ids_with_load_errors(self):
        errors, self._load_errors = self._load_errors, set()
        return errors
