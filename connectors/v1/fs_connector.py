"""FSConnector for vLLM V1: whole-prompt KV through a shared directory, in the V0 store format.

One entry per (prompt, TP rank), token-major, keyed on the whole prompt
(connectors.store.format; identity rules: connectors.v1.transfer). Prefix
caching and chunked prefill stay on; block sizes may differ between P and D.

Scheduler side (one instance, in the engine core). No store I/O runs on the
scheduler's thread: every lookup runs on a small pool (connectors.store.deadline)
with a deadline, ``store_timeout_ms``.

- `get_num_new_matched_tokens`: for a new prefill, looks up an entry for
  every TP rank (V1 producers' KV-only entries first, then V0 producers'):
  existence, header and stored token ids, bounded work (the checksum is the
  worker's). Waits for it LOOKUP_BUDGET_S at most; while it runs, answers None
  (vLLM asks again next step and schedules others). Offers ``prompt_len - 1 -
  local prefix hit`` tokens, loaded async (``load_kv_async=True``). A lookup
  past its deadline, or asked while the store is stalled (a call stuck past its
  deadline), offers nothing: the prompt is recomputed, logged "the store did
  not answer within N ms". An invalid entry is removed so P publishes it again.
  A missing entry whose pending marker is fresh (P has answered, its save is
  under way: connectors.v1.background) is waited for: None ("ask again",
  looked up again every PENDING_POLL_S) until the entry appears, the marker
  goes, or ``store_timeout_ms`` has passed since this request first saw it
  (then recomputed, logged "pending: its save was still under way after N
  ms"). A stale marker (older than the deadline) counts for nothing.
- `update_state_after_alloc`: records the load (positions [local hit,
  local hit + offered), into the request's blocks) or why nothing is loaded.
- `build_connector_meta`: per step, the loads and skips recorded above and,
  on a producer, a save for every request whose prompt's last token is
  computed in this step (the last chunk under chunked prefill; tokens from
  the local prefix cache are in the paged cache too), with its block ids.
- `request_finished`: True for a request a save was planned for: vLLM holds
  its blocks until the worker reports it finished sending (the KV is copied out).

Worker side (one instance per worker; connectors.v1.background):

- `register_kv_caches`: picks the layout adapter (connectors.v1.kv_layout)
  from the attention backend and the cache's shape; the CPU page layout is
  probed from vLLM's own cache-write kernel.
- `start_load_kv`: submits each load to the I/O pool: the entry is read,
  checked again (checksum, tokens) and scattered layer by layer straight into
  the paged cache (`FSStore.load_into`: positions [start, end) into the
  request's slots) through a write gate. `get_finished` reports it; a failure
  (the entry vanished or changed since the lookup; a checksum failure shows
  only after every layer was written; the deadline) is reported to vLLM as
  failed blocks in the same step (the gate closed first), and vLLM's
  `kv_load_failure_policy` decides (recompute or fail the request): nothing
  from a failed load is served.
- `wait_for_save`: submits each completed prompt's save. Its pending marker
  is created first (waited for 50 ms at most: it exists before the answer
  leaves); a copy thread gathers every layer's KV out of the blocks, the I/O
  pool publishes it (atomic; nothing for a prompt already stored) and then
  removes the marker; `get_finished` reports the request finished sending
  once copied. A write past its deadline is dropped (logged ``KV send
  DROPPED.``).

Log lines (INFO, "vllm.kvctl.fs_connector"; operators grep the substrings; their
text is connectors.log_lines): P logs `KV send DONE.` per stored prompt (or `KV
send DROPPED.` with the reason), D one of `KV load DONE.`, `KV load NONE.` or `KV
load FAILED.` per request.

``prompt_tokens = prefix_cached + loaded + computed``; ``key`` is the entry
this rank loaded (or would have).

Config (``kv_connector_extra_config``, connectors.config.validate):
``fs_storage_path``, ``fsync``, ``model_id``, ``max_bytes``, ``ttl_seconds``,
``store_timeout_ms``.
Refused at start-up: prompt embeddings, pipeline parallelism, a quantized
(fp8) KV cache, models with several KV cache groups (hybrid / sliding
window), attention backends with no layout adapter. Requests with a LoRA
adapter or multimodal inputs, and prompt-logprobs requests on D, are never
loaded (and the first two never stored), with the reason logged.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from connectors.config.validate import (open_store_dir, open_store_keys, ConfigError, ConfigProblem,
                                       parse_fs_settings)
from connectors import log_lines
from connectors.logs import SendFailureLog, get_logger
from connectors.store import auth, format as fmt
from connectors.store.fs_store import FSStore, LoadedEntry, TokenMismatch, dtype_tag
from connectors.store.deadline import StoreCallPool, StoreTimeout
from connectors.store.model_identity import ModelIdentityError
from connectors.served_model import served_model_identity, unkeyable_input_problems
from connectors.layout.base import LayerWriter
from connectors.v1 import transfer
from connectors.v1.background import BackgroundTransfers, LoadOutcome, SaveJob
from connectors.v1.kv_layout import UnsupportedLayout, ordered_layers, select_layout
from connectors.v1.transfer import LoadSpec, SaveSpec, Skip, StepPlan
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = get_logger(__name__)


LOOKUP_THREADS = 2  # the scheduler's store lookups run here, never on its own thread
LOOKUP_BUDGET_S = 0.002  # how long one get_num_new_matched_tokens call waits for its lookup
PENDING_POLL_S = 0.005  # an entry being saved (pending marker) is looked up again this often at most


@dataclass
class FSConnectorMetadata(StepPlan, KVConnectorMetadata):
    """What every worker loads, saves and reports in one step (connectors.v1.transfer.StepPlan)."""


@dataclass
class _Pending:
    """A prefill the scheduler has decided about, until its step's metadata is built."""

    request: "Request"
    check: transfer.EntryCheck | None  # the store lookup (None: not looked up)
    block_ids: list[int]  # the request's blocks (the only KV cache group) when allocated
    start: int  # the local prefix hit the scheduler offered tokens beyond
    end: int  # start + tokens loaded (= start: nothing is loaded)
    reason: str = ""  # why nothing is loaded, when nothing is


class FSConnector(KVConnectorBase_V1):
    """Whole-prompt KV through a shared filesystem path (V1), in the V0 store format."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kv_config = self._kv_transfer_config
        model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
        try:
            self.settings = parse_fs_settings(kv_config.kv_connector_extra_config or {})
            problems = _unsupported(vllm_config, kv_cache_config) + unkeyable_input_problems(model_config)
            if problems:
                raise ConfigError(problems)
            self.root = open_store_dir(self.settings.fs_storage_path)
            self.keys = open_store_keys(self.settings)
            self.model_id, described = _model_identity(model_config, self.settings.model_id)
        except ConfigError as e:
            logger.error("FSConnector: cannot start:\n%s", e)
            raise
        self.is_producer = kv_config.is_kv_producer
        self.is_consumer = kv_config.is_kv_consumer
        self.store = FSStore(self.root, fsync=self.settings.fsync, max_bytes=self.settings.max_bytes,
                             ttl_seconds=self.settings.ttl_seconds, keys=self.keys)
        self.block_size = _manager_block_size(vllm_config, kv_cache_config)
        self.tp_size = parallel.tensor_parallel_size
        self.tp_rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self.model_dtype = model_config.dtype
        # The identity of this rank's entries as a V0 producer would write them;
        # V1 producers write its KV-only form (connectors.v1.transfer).
        self.identity = fmt.KVIdentity(
            model=self.model_id, num_layers=model_config.get_num_layers(parallel), kv_parts=2,
            kv_heads=model_config.get_num_kv_heads(parallel), head_size=model_config.get_head_size(),
            dtype=dtype_tag(model_config.dtype), tp_rank=self.tp_rank, tp_size=self.tp_size)
        self.timeout_s = self.settings.store_timeout_ms / 1e3
        # scheduler side
        self._asked: dict[str, tuple[int, transfer.EntryCheck | None, str]] = {}
        self._pending: dict[str, _Pending] = {}
        self._prompts: dict[str, "Request"] = {}
        self._lookups: dict = {}  # req_id -> StoreCall of a lookup still running
        self._saves_awaited: dict[str, tuple[float, float]] = {}  # req_id -> (first, last) pending sighting
        self._saving: set[str] = set()  # requests whose save a plan carried: request_finished holds their blocks
        self._lookup_pool = (StoreCallPool("fs-store-lookup", LOOKUP_THREADS, self.timeout_s)
                             if role == KVConnectorRole.SCHEDULER and self.is_consumer else None)
        # worker side
        self._layers: list[tuple[str, torch.Tensor]] = []
        self._layout = None
        self._send_failures = SendFailureLog(logger)
        self._bg = (BackgroundTransfers(self.timeout_s, self._load_blocking, self._gather, self._write,
                                        self._log_load, self._log_save_dropped, self._mark, self._unmark)
                    if role == KVConnectorRole.WORKER else None)
        if role == KVConnectorRole.SCHEDULER:
            logger.info("FSConnector (V1) ready: role=%s store=%s model=%s layers=%d kv_heads=%d "
                        "head_size=%d dtype=%s block_size=%d tp_size=%d fsync=%s store_timeout_ms=%d "
                        "(loads and saves async)", kv_config.kv_role,
                        self.root, self.model_id, self.identity.num_layers, self.identity.kv_heads,
                        self.identity.head_size, self.identity.dtype, self.block_size, self.tp_size,
                        self.settings.fsync, self.settings.store_timeout_ms)
            logger.info("FSConnector model identity: %s; weights: %s", self.model_id, described)
            logger.info(log_lines.STORE_KEYS, auth.describe(self.keys))

    # ================================================================ scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens the store provides beyond `num_computed_tokens` (never the last one), loaded async.

        The lookup (header and token ids of every rank's entry, bounded work)
        runs on the lookup pool; this call waits for it LOOKUP_BUDGET_S at
        most and answers None ("ask again": vLLM schedules other requests
        meanwhile) while it runs, 0 once it is past its deadline (the prompt
        is recomputed, logged with the reason). An entry being saved (a fresh
        pending marker, no entry yet) is None too, for the store deadline at
        most from the first time this request found it so.
        """
        if not self.is_consumer:
            return 0, False
        req_id = request.request_id
        tokens = request.prompt_token_ids or []
        refusal = _refusal(request, loading=True)
        check = None
        if refusal:
            reason = refusal
        elif transfer.tokens_to_load(len(tokens), num_computed_tokens) == 0:
            reason = (f"local prefix cache holds {num_computed_tokens} of {len(tokens)} prompt tokens"
                      if num_computed_tokens else f"prompt of {len(tokens)} token")
        else:
            previous = self._asked.get(req_id)  # vLLM asks again while the request waits for blocks
            found = previous is not None and previous[1] is not None and previous[1].found
            if found:
                check = previous[1]
            elif self._look_again_later(req_id):
                return None, False  # its entry is being saved: looked at again shortly
            else:
                check = self._lookup(req_id, tokens)
            if check is None:
                return None, False  # the lookup is still running: vLLM asks again next step
            reason = check.reason
            if check.pending:
                waited = self._waited_for_save(req_id)
                if waited < self.timeout_s:
                    return None, False  # P's save of it is under way: vLLM asks again next step
                reason = (f"pending: its save was still under way after {waited * 1e3:.0f} ms "
                          f"(store_timeout_ms {self.settings.store_timeout_ms})")
        awaited = self._saves_awaited.pop(req_id, None)
        if awaited is not None:
            ended = ("published" if check is not None and check.found else
                     "still under way at the deadline" if check is not None and check.pending else
                     f"not published ({reason})")
            logger.info(log_lines.KV_LOAD_WAITED, 0, req_id, check.key if check is not None else "-",
                        (time.monotonic() - awaited[0]) * 1e3, ended)
        self._asked[req_id] = (num_computed_tokens, check, reason)
        if check is None or not check.found:
            return 0, False
        return transfer.tokens_to_load(len(tokens), num_computed_tokens), True

    def _waited_for_save(self, req_id: str) -> float:
        """Seconds since this request first found its entry pending (D's own clock)."""
        now = time.monotonic()
        first, _ = self._saves_awaited.get(req_id, (now, now))
        self._saves_awaited[req_id] = (first, now)
        return now - first

    def _look_again_later(self, req_id: str) -> bool:
        """True while a request whose entry is pending was looked up less than PENDING_POLL_S ago."""
        awaited = self._saves_awaited.get(req_id)
        return awaited is not None and time.monotonic() - awaited[1] < PENDING_POLL_S

    def _lookup(self, req_id: str, tokens: list[int]) -> transfer.EntryCheck | None:
        """The lookup's verdict, None while it runs; a lookup past its deadline is a miss with that reason."""
        identity = transfer.kv_only_identity(transfer.rank_identity(self.identity, 0))
        call = self._lookups.get(req_id)
        if call is None:
            stalled = self._lookup_pool.stalled()
            if stalled:  # an earlier lookup is stuck past its deadline: do not queue behind it
                reason = str(StoreTimeout(self._lookup_pool.timeout_ms, stalled))
                return transfer.EntryCheck(None, fmt.compute_key(identity, tokens), reason)
            call = self._lookup_pool.submit(self._find, tokens)
        if call.wait(LOOKUP_BUDGET_S):
            self._lookups.pop(req_id, None)
            return call.result()  # _find never raises
        if not call.expired():
            self._lookups[req_id] = call
            return None
        self._lookups.pop(req_id, None)
        return transfer.EntryCheck(None, fmt.compute_key(identity, tokens), str(call.give_up()))

    def _find(self, tokens: list[int]) -> transfer.EntryCheck:
        """Header and token ids of every rank's entry (the checksum is the worker's, as it loads)."""
        identity = transfer.rank_identity(self.identity, 0)
        check = transfer.find_entry(self.root, identity, tokens, self.tp_size, self.keys, full=False,
                                    pending_s=self.timeout_s)
        for error in check.corrupt:
            _remove_corrupt(self.store, error)
        return check

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        req_id = request.request_id
        if self.is_producer:
            self._prompts[req_id] = request
        asked = self._asked.pop(req_id, None)
        if asked is None:
            return  # not a fresh prefill (vLLM asks only those)
        start, check, reason = asked
        if num_external_tokens:
            reason = ""
        elif not reason:  # the entry was there: under MultiConnector another child may have won
            reason = (f"entry found, vLLM took no tokens from it (another connector's load or the "
                      f"local prefix cache, which holds {start})")
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self._pending[req_id] = _Pending(request, check, list(block_ids), start, start + num_external_tokens,
                                         reason)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        plan = FSConnectorMetadata(block_size=self.block_size)
        blocks = scheduler_output.kv_connector_block_state
        for req_id, pending in self._pending.items():
            tokens = list(pending.request.prompt_token_ids or [])
            if pending.end > pending.start:
                plan.loads.append(LoadSpec(
                    req_id=req_id, token_ids=tokens, kv_only=transfer.is_kv_only(pending.check.identity),
                    block_ids=pending.block_ids, start=pending.start, end=pending.end))
            else:
                kv_only = pending.check.kv_only if pending.check is not None else True
                plan.skips.append(Skip(req_id=req_id, token_ids=tokens, kv_only=kv_only,
                                       prefix_cached=pending.start, reason=pending.reason))
        self._pending.clear()
        plan.preempted = sorted(scheduler_output.preempted_req_ids or ())
        if self.is_producer:
            for req_id, num_computed, prompt in self._scheduled(scheduler_output):
                scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
                if prompt is None or not transfer.prompt_completes(num_computed, scheduled, len(prompt)):
                    continue
                request = self._prompts.get(req_id)
                refusal = _refusal(request, loading=False) if request is not None else ""
                if refusal:
                    logger.info(log_lines.KV_NOT_SENT_REQUEST, 0, req_id, len(prompt), refusal)
                    continue
                plan.saves.append(SaveSpec(req_id=req_id, token_ids=list(prompt),
                                           block_ids=list(_block_ids(blocks, req_id))))
                self._saving.add(req_id)
        return plan

    def _scheduled(self, scheduler_output: "SchedulerOutput"):
        """(req_id, tokens computed before this step, prompt token ids) of every scheduled request."""
        for new in scheduler_output.scheduled_new_reqs:
            yield new.req_id, new.num_computed_tokens, new.prompt_token_ids
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            request = self._prompts.get(req_id)
            prompt = request.prompt_token_ids if request is not None else None
            yield req_id, cached.num_computed_tokens[i], prompt

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._prompts.pop(req_id, None)
        self._asked.pop(req_id, None)
        self._pending.pop(req_id, None)
        self._saves_awaited.pop(req_id, None)
        lookup = self._lookups.pop(req_id, None)
        if lookup is not None:
            lookup.give_up()
        # A save a plan carried is copied out of the blocks in the background: vLLM keeps them
        # until the worker reports the request as finished sending (get_finished).
        if req_id in self._saving:
            self._saving.discard(req_id)
            return True, None
        return False, None

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Bind the layers (model order) and the layout adapter. Raises UnsupportedLayout, ValueError."""
        from vllm.model_executor.models.utils import extract_layer_index

        layers = ordered_layers(kv_caches, extract_layer_index)
        if len(layers) != self.identity.num_layers:
            raise ValueError(f"FSConnector: got KV caches for {len(layers)} layers, the model has "
                             f"{self.identity.num_layers}")
        name, cache = layers[0]
        tag = dtype_tag(cache.dtype)
        if tag != self.identity.dtype:
            raise ValueError(f"FSConnector: KV cache dtype {tag} is not the model dtype {self.identity.dtype}")
        backend = _backend_name(self._vllm_config, name)
        try:
            layout = select_layout(cache, backend, kv_heads=self.identity.kv_heads,
                                   head_size=self.identity.head_size,
                                   cpu_writer=_cpu_writer(self._vllm_config, name))
        except UnsupportedLayout as e:
            logger.error("FSConnector: cannot start: %s", e)
            raise
        for other_name, other in layers[1:]:
            if other.shape != cache.shape or other.dtype != cache.dtype:
                raise UnsupportedLayout(f"FSConnector: layer {other_name} has cache {list(other.shape)} "
                                        f"{other.dtype}, layer {name} {list(cache.shape)} {cache.dtype}")
        self._layers, self._layout = layers, layout
        logger.info("FSConnector layout: %s (attention backend %s, cache %s %s, kernel block %d, "
                    "manager block %d), identity %s", layout.name, backend, list(cache.shape),
                    cache.dtype, layout.g.block_size, self.block_size, self.identity)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Log this step's skips and submit its loads to the store I/O pool (they end in get_finished)."""
        if not self.has_connector_metadata():
            return
        plan = self._get_connector_metadata()
        if not isinstance(plan, FSConnectorMetadata):
            return
        for skip in plan.skips:
            key = fmt.compute_key(self._rank_identity(skip.kv_only), skip.token_ids)
            total = len(skip.token_ids)
            logger.info(log_lines.KV_LOAD_NONE, self.tp_rank, skip.req_id, key, total,
                        total - skip.prefix_cached, skip.prefix_cached, skip.reason)
        for load in plan.loads:
            load.block_size = plan.block_size
            self._bg.start_load(load, _blocks_of(load.block_ids, plan.block_size, load.start, load.end))

    def _load_blocking(self, load: LoadSpec, gate) -> LoadedEntry:
        """On the I/O pool: read, verify and scatter one entry into the request's blocks, through `gate`.

        Each layer goes from the file into its paged cache through the store's
        reused staging buffer (positions [start, end) of the entry). The
        checksum is known only after the last layer: what a failed load wrote
        stays in blocks reported failed, which vLLM recomputes (or fails the
        request) and never serves. Raises what FSStore.load_into raises.
        """
        identity = self._rank_identity(load.kv_only)
        device = self._layers[0][1].device
        slots = torch.tensor(transfer.slots_for(load.block_ids, load.block_size, load.start, load.end),
                             dtype=torch.int64, device=device)
        write_layer = LayerWriter(self._layout, [cache for _, cache in self._layers], slots,
                                  slice(load.start, load.end))
        try:
            return self.store.load_into(identity, load.token_ids, lambda i, kv: gate.write(write_layer, i, kv))
        except fmt.EntryCorrupt as e:
            _remove_corrupt(self.store, e)
            raise

    def _log_load(self, outcome: LoadOutcome) -> None:
        load, e = outcome.spec, outcome.error
        key = fmt.compute_key(self._rank_identity(load.kv_only), load.token_ids)
        total, count = len(load.token_ids), load.end - load.start
        if e is None:
            logger.info(log_lines.KV_LOAD_DONE, self.tp_rank, load.req_id, key, total, count,
                        total - load.start - count, load.start, outcome.result.num_bytes, outcome.seconds * 1e3)
            return
        why = "miss (entry gone since the scheduler checked it)" if isinstance(e, FileNotFoundError) else (
            f"token mismatch: {e}" if isinstance(e, TokenMismatch) else
            str(e) if isinstance(e, StoreTimeout) else f"{type(e).__name__}: {e}")
        failed = _blocks_of(load.block_ids, load.block_size, load.start, load.end)
        logger.error(log_lines.KV_LOAD_FAILED, self.tp_rank, load.req_id, key, total,
                     total - load.start, load.start, why, len(failed))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are async: their requests are scheduled once get_finished reported them

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # every layer is gathered at once, in the background, after the forward pass

    def wait_for_save(self):
        """Submit this step's saves (copy out of the cache, then publish): nothing here waits for the store."""
        if not self.has_connector_metadata():
            return
        plan = self._get_connector_metadata()
        if not isinstance(plan, FSConnectorMetadata):
            return
        for save in plan.saves:
            save.block_size = plan.block_size
        self._bg.start_saves(plan.saves)

    def _mark(self, save: SaveSpec) -> fmt.StoreFile | None:
        """On the marker pool: this rank's pending marker for the prompt; None when not created here.

        A decode instance that misses the entry while the marker is fresh asks
        again instead of recomputing. Without it (the store refused it) the
        save goes on: such a reader may miss the entry until it is published.
        """
        key = fmt.compute_key(self._rank_identity(kv_only=True), save.token_ids)
        try:
            return fmt.create_pending(self.root, key, stale_after_s=self.timeout_s)
        except (OSError, fmt.StoreError) as e:
            logger.warning("FSConnector: no pending marker for %s (a reader may miss the entry until it is "
                           "published): %s", key, e)
            return None

    def _unmark(self, marker: fmt.StoreFile) -> None:
        """Remove a pending marker this worker created (after its entry's rename, or once its save ended)."""
        try:
            fmt.remove_store_file(marker, unchanged=True)
        except OSError as e:  # it goes stale after the deadline: readers then ignore it
            logger.warning("FSConnector: could not remove pending marker %s: %s", marker.name, e)

    def _gather(self, save: SaveSpec) -> torch.Tensor:
        """On the copy thread: the prompt's KV out of its blocks (after this, vLLM may reuse them)."""
        start = time.perf_counter()
        device = self._layers[0][1].device
        slots = torch.tensor(transfer.slots_for(save.block_ids, save.block_size, 0, len(save.token_ids)),
                             dtype=torch.int64, device=device)
        kv = self._layout.gather_layers([cache for _, cache in self._layers], slots)
        save.gather_s = time.perf_counter() - start
        return kv

    def _write(self, save: SaveSpec, kv: torch.Tensor, job: SaveJob) -> None:
        """On the I/O pool: publish one prompt (atomic), logging how it ended."""
        identity = self._rank_identity(kv_only=True)
        tokens = save.token_ids
        key = fmt.compute_key(identity, tokens)
        late = lambda: (f" (published {(time.perf_counter() - job.started) * 1e3:.0f} ms after its save "
                        f"started, past the deadline: it had been dropped)" if job.dropped else "")
        if self.store.has_entry(key):
            logger.info(log_lines.KV_SEND_STORED + "%s", self.tp_rank,
                        key, len(tokens), late())
            return
        try:
            hidden = torch.empty((1, 0), dtype=self.model_dtype)  # KV only (connectors.v1.transfer)
            result = self.store.save(identity, tokens, kv, hidden)
        except (OSError, fmt.StoreError, ValueError) as e:
            self._send_failures.report(self.tp_rank, key, e)
            return
        logger.info(log_lines.KV_SEND + "%s", self.tp_rank,
                    result.key, len(tokens), result.num_bytes, result.seconds * 1e3,
                    save.gather_s * 1e3, late())

    def _log_save_dropped(self, job: SaveJob, reason: str) -> None:
        key = fmt.compute_key(self._rank_identity(kv_only=True), job.spec.token_ids)
        logger.error(log_lines.KV_SEND_DROPPED, self.tp_rank, key, len(job.spec.token_ids), reason)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(saves whose blocks are copied out, loads that ended) since the last call."""
        if self._bg is None:
            return None, None
        sending, recving = self._bg.poll(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._bg.take_failed_blocks() if self._bg is not None else set()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Preempted requests' blocks are about to be reused: their copies must be done first."""
        if self._bg is not None and isinstance(kv_connector_metadata, FSConnectorMetadata):
            self._bg.wait_copied(set(kv_connector_metadata.preempted))

    def shutdown(self) -> None:
        if self._bg is not None:
            self._bg.shutdown()
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown()

    def _rank_identity(self, kv_only: bool) -> fmt.KVIdentity:
        own, v0 = transfer.lookup_identities(self.identity)
        return own if kv_only else v0


# ---------------------------------------------------------------- helpers

def _block_ids(blocks, req_id: str) -> list[int]:
    """The request's block ids in the (only) KV cache group, from the scheduler's block state."""
    found = blocks.get_block_ids(req_id) if blocks is not None else None
    if not found:
        raise RuntimeError(f"FSConnector: no block ids for scheduled request {req_id}")
    return found[0]


def _blocks_of(block_ids: list[int], block_size: int, start: int, end: int) -> set[int]:
    return set(block_ids[start // block_size:math.ceil(end / block_size)])


def _refusal(request: "Request", *, loading: bool) -> str:
    """Why a request's KV must not come from (or go to) the store by token ids alone; "" if it may."""
    if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings (no token ids to key on)"
    if getattr(request, "lora_request", None) is not None:
        return f"LoRA adapter {request.lora_request.lora_name!r} (its KV depends on the adapter)"
    if getattr(request, "mm_features", None):
        return "multimodal inputs (their KV depends on more than token ids)"
    if loading:
        params = getattr(request, "sampling_params", None)
        if params is not None and getattr(params, "prompt_logprobs", None) is not None:
            return "prompt_logprobs requested (needs every position computed)"
        if getattr(request, "skip_reading_prefix_cache", False):
            return "the request skips cached prefixes"
    return ""


def _remove_corrupt(store: FSStore, error: fmt.EntryCorrupt) -> None:
    """Delete an entry proven invalid so the producer publishes it again (best effort, logged)."""
    try:
        if store.remove_corrupt(error):
            logger.warning("FSConnector: removed corrupt entry %s: %s", error.path.name, error.reason)
    except OSError:
        pass


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _manager_block_size(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> int:
    """The KV cache manager's block size: block ids and slots are in these blocks."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if groups:
        return groups[0].kv_cache_spec.block_size
    return vllm_config.cache_config.block_size


def _backend_name(vllm_config: "VllmConfig", layer_name: str) -> str:
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    backend = getattr(layer, "attn_backend", None)
    return backend.get_name() if backend is not None else "unknown"


def _cpu_writer(vllm_config: "VllmConfig", layer_name: str):
    """The CPU attention backend's cache write (its page layout is probed from it), or None off CPU."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    isa = getattr(layer, "isa", None)
    if isa is None:
        return None
    from vllm import _custom_ops as ops

    def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        blocks, heads, n, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, 2 * n, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    return write


def _unsupported(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> list[ConfigProblem]:
    """Start-up problems: settings under which whole-prompt entries cannot be read or written."""
    problems = []
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        problems.append(ConfigProblem("--pipeline-parallel-size", "FSConnector supports tensor "
                                      "parallelism only", "use --pipeline-parallel-size 1"))
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        problems.append(ConfigProblem("--kv-cache-dtype", f"KV cache dtype {cache_dtype}: FSConnector "
                                      "stores KV in the model dtype only", "use --kv-cache-dtype auto"))
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        problems.append(ConfigProblem("--model", f"the model has {len(groups)} KV cache groups (hybrid or "
                                      "sliding-window attention); FSConnector handles one",
                                      "serve a model with full attention in every layer"))
    return problems


def _model_identity(model_config, model_id: str | None) -> tuple[str, str]:
    """served_model_identity, its failure as a start-up ConfigError naming vLLM's --model."""
    try:
        return served_model_identity(model_config, model_id)
    except ModelIdentityError as e:
        problems = [ConfigProblem("--model", e.message, e.fix)]
        raise ConfigError(problems) from e

