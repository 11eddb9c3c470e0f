"""FSConnector: V0 KV connector that hands KV + hidden states through a directory.

Producer (``kv_producer``/``kv_both``): after a prefill step, each request's
KV (all layers) and hidden states are gathered from the paged cache into one
token-major entry and published atomically (connectors.store.format). The
paged cache's layout adapter (connectors.v0.kv_layout) is chosen by the
worker's attention backend, checked against the cache's shape.

Only the last prompt token's hidden state is stored: it is what samples the
first generated token; every later token comes from the KV.

Keys hash the prompt's token ids under an identity whose `model` part names
the weights and the serving settings that change KV
(connectors.served_model: a Hugging Face commit or a content fingerprint
of the weights, plus dtype, quantization, RoPE and config overrides; the
``model_id`` setting replaces the weights part). It is computed once at
start-up and logged. A request whose KV depends on more than its token ids
(a LoRA adapter, multimodal inputs, a prompt adapter) is never published and
never served from the store: it recomputes, with the reason logged
(connectors.v0.batch). Prompt embeddings are refused at start-up.

Consumer (``kv_consumer``/``kv_both``): before a prefill step, the entry of
every prefill request is loaded. The forward pass is skipped only when every
request in the step is a complete, valid hit, the step holds no decode
tokens and no request asks for prompt logprobs (they need every position's
hidden state); otherwise nothing is taken from the store and the step
recomputes. A miss, a corrupt entry or a token mismatch is logged with its
reason.

Config (``kv_connector_extra_config``, see connectors.config.validate):
``fs_storage_path`` (relative paths resolve against the server's working
directory), ``fsync``, ``model_id``, and the store bounds ``max_bytes`` and
``ttl_seconds`` (connectors.store.eviction). Prefix caching and chunked
prefill make a step compute only part of a prompt; they, pipeline
parallelism, prompt embeddings and an attention backend with no layout
adapter are refused at start-up.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Union

import torch

from connectors.store import auth, format as fmt
from connectors.store.deadline import StoreCallPool, StoreTimeout, WriteGate
from connectors.store.model_identity import ModelIdentityError
from connectors.v0.batch import split_prefills, span_slots, span_tokens
from connectors.config.validate import (open_store_dir, open_store_keys, ConfigError, ConfigProblem,
                                       parse_fs_settings)
from connectors.store.fs_store import FSStore, TokenMismatch, dtype_tag
from connectors.v0.attn_backend import kv_cache_backend_name
from connectors.layout.base import CacheGeometry, GatherBuffers, KVLayout, LayerWriter, UnsupportedLayout
from connectors.v0.kv_layout import SharedGathers, layout_for_backend, select_layout
from connectors.served_model import served_model_identity, unkeyable_input_problems
from connectors import log_lines
from connectors.logs import SendFailureLog, get_logger
from vllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.sequence import IntermediateTensors

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)

IO_THREADS = 2  # the store calls of one worker run here, each waited for until its deadline


class FSConnector(KVConnectorBase):
    """KV and hidden states through a shared filesystem path, one entry per prompt."""

    # Set by MultiConnectorV0 for one send step: the KV another child already gathered.
    shared_gathers: SharedGathers | None = None
    _buffers: GatherBuffers | None = None

    def __init__(self, rank: int, local_rank: int, config: "VllmConfig"):
        self.rank = rank
        self.config = config
        kv_config = config.kv_transfer_config
        try:
            self.settings = parse_fs_settings(kv_config.kv_connector_extra_config or {})
            _refuse_unsupported(config)
            problems = unkeyable_input_problems(config.model_config)
            if problems:
                raise ConfigError(problems)
            self.root = open_store_dir(self.settings.fs_storage_path)
            self.keys = open_store_keys(self.settings)
            self.model_id, described = _model_identity(config.model_config, self.settings.model_id)
        except ConfigError as e:
            logger.error("FSConnector: cannot start:\n%s", e)
            raise
        # The attention backend decides the cache layout (its shape alone can be ambiguous).
        self.attn_backend = kv_cache_backend_name(config)
        try:
            layout_for_backend(self.attn_backend)
        except UnsupportedLayout as e:
            logger.error("FSConnector: cannot start: %s", e)
            raise
        self.is_producer = kv_config.is_kv_producer
        self.is_consumer = kv_config.is_kv_consumer
        # V0's hooks are synchronous: each store call runs on this pool and the step waits for
        # it until its deadline at most (past it: recompute / drop the save).
        self._io = StoreCallPool("fs-store-io", IO_THREADS, self.settings.store_timeout_ms / 1e3)
        self.store = FSStore(self.root, fsync=self.settings.fsync,
                             max_bytes=self.settings.max_bytes,
                             ttl_seconds=self.settings.ttl_seconds, keys=self.keys)

        model_config, parallel = config.model_config, config.parallel_config
        self.geometry = CacheGeometry(
            block_size=config.cache_config.block_size,
            kv_heads=1 if model_config.use_mla else model_config.get_num_kv_heads(parallel),
            head_size=model_config.get_head_size(),
        )
        self.num_layers = model_config.get_num_layers(parallel)
        # What an entry's hidden state must be to stand in for this model's (checked on load).
        self.hidden_size = model_config.get_hidden_size()
        self.hidden_dtype = model_config.dtype
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = parallel.tensor_parallel_size
        self._identity: fmt.KVIdentity | None = None  # known once caches exist
        self._layout: KVLayout | None = None
        self._send_failures = SendFailureLog(logger)
        self._buffers = GatherBuffers()  # gather outputs, reused step after step
        logger.info("FSConnector ready: role=%s store=%s model=%s layers=%d kv_heads=%d "
                    "head_size=%d block_size=%d tp=%d/%d fsync=%s", kv_config.kv_role, self.root,
                    self.model_id, self.num_layers, self.geometry.kv_heads,
                    self.geometry.head_size, self.geometry.block_size, self.tp_rank,
                    self.tp_size, self.settings.fsync)
        logger.info("FSConnector model identity: %s; weights: %s", self.model_id, described)
        logger.info(log_lines.STORE_KEYS, auth.describe(self.keys))
        if config.lora_config is not None:
            logger.info("FSConnector: LoRA is enabled; requests with an adapter are recomputed, "
                        "never published or loaded (their KV depends on the adapter)")

    # -- identity and layout, fixed by the first real (non-profile) cache --

    def _bind(self, kv_caches: list[torch.Tensor]) -> tuple[fmt.KVIdentity, KVLayout]:
        if self._identity is None:
            if len(kv_caches) != self.num_layers:
                raise ValueError(f"got {len(kv_caches)} KV caches for {self.num_layers} layers")
            self._layout = select_layout(kv_caches[0], self.geometry, self.attn_backend)
            self._identity = fmt.KVIdentity(
                model=self.model_id, num_layers=self.num_layers,
                kv_parts=self._layout.kv_parts, kv_heads=self.geometry.kv_heads,
                head_size=self.geometry.head_size, dtype=dtype_tag(kv_caches[0].dtype),
                tp_rank=self.tp_rank, tp_size=self.tp_size)
            logger.info("FSConnector layout: %s (attention backend %s), identity %s",
                        self._layout.name, self.attn_backend, self._identity)
        return self._identity, self._layout

    # -- producer --

    def send_kv_caches_and_hidden_states(
        self, model_executable: torch.nn.Module, model_input, kv_caches: list[torch.Tensor],
        hidden_or_intermediate_states: Union[torch.Tensor, IntermediateTensors],
    ) -> None:
        """Publish one entry per prefill request of this step. Never raises on I/O errors."""
        step = split_prefills(model_input)
        if not step.transferable:
            if step.problem:
                logger.warning(log_lines.KV_NOT_SENT, self.rank, step.problem)
            return
        identity, layout = self._bind(kv_caches)
        hidden = hidden_or_intermediate_states
        for span in step.spans:
            if span.refusal:
                logger.info(log_lines.KV_NOT_SENT_REQUEST, self.rank, span.index, span.num_tokens,
                            span.refusal)
                continue
            tokens = span_tokens(model_input, span).tolist()
            key = fmt.compute_key(identity, tokens)
            stalled = self._io.stalled()
            if stalled:
                self._drop(key, tokens, str(StoreTimeout(self._io.timeout_ms, stalled)))
                continue
            try:
                stored = self._io.run(self.store.has_entry, key)
            except StoreTimeout as e:
                self._drop(key, tokens, str(e))
                continue
            if stored:
                logger.info(log_lines.KV_SEND_STORED, self.rank, key, len(tokens))
                continue
            if hidden.shape[0] < span.end:
                logger.warning(log_lines.KV_NOT_SENT_HIDDEN, self.rank, key, hidden.shape[0], span.end)
                continue
            slots = span_slots(model_input, span)
            try:
                start = time.perf_counter()
                kv = self._gather(layout, kv_caches, slots)
                gather_s = time.perf_counter() - start
                result = self._io.run(self.store.save, identity, tokens, kv, hidden[span.end - 1:span.end])
            except StoreTimeout as e:
                # The write may still read `kv`: its buffer is never handed out again.
                (self.shared_gathers or self._buffers or GatherBuffers()).abandon()
                self._drop(key, tokens, str(e))
                continue
            except (OSError, fmt.StoreError) as e:
                self._send_failures.report(self.rank, key, e)
                continue
            logger.info(log_lines.KV_SEND, self.rank, result.key, len(tokens), result.num_bytes,
                        result.seconds * 1e3, gather_s * 1e3)


    def _drop(self, key: str, tokens: list[int], reason: str) -> None:
        logger.error(log_lines.KV_SEND_DROPPED, self.rank, key, len(tokens), reason)

    def _gather(self, layout: KVLayout, kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """Every layer's KV of `slots`: another child's gather of this step when shared, else ours."""
        if self.shared_gathers is not None:
            return self.shared_gathers.gather(layout, kv_caches, slots)
        if self._buffers is None:
            self._buffers = GatherBuffers()
        self._buffers.start_step()  # the previous request's entry is saved: reuse its buffer
        return layout.gather_layers(kv_caches, slots,
                                    out=self._buffers.take(layout.layers_shape(len(kv_caches), slots.shape[0]),
                                                           kv_caches[0]))

    # -- consumer --

    def recv_kv_caches_and_hidden_states(self, model_executable: torch.nn.Module, model_input,
                                         kv_caches: list[torch.Tensor]):
        """Returns (hidden_states, True, model_input) when every prefill hit, else (None, False, model_input)."""
        step = split_prefills(model_input)
        if not step.transferable:
            return self._redo(model_input, step.problem or "no prefill requests in step")
        if step.num_decode_tokens:
            return self._redo(model_input, f"step has {step.num_decode_tokens} decode tokens")
        if _wants_prompt_logprobs(model_input):
            return self._redo(model_input, "prompt_logprobs requested (needs every position's hidden state)")
        refused = next((span for span in step.spans if span.refusal), None)
        if refused is not None:
            return self._redo(model_input, f"request {refused.index} ({refused.num_tokens} tokens) "
                                           f"not served from the store: {refused.refusal}")
        identity, layout = self._bind(kv_caches)
        device = kv_caches[0].device
        start = time.perf_counter()
        scatter_s = 0.0
        loaded = []
        for span in step.spans:
            tokens = span_tokens(model_input, span).tolist()
            key = fmt.compute_key(identity, tokens)
            write_layer = LayerWriter(layout, kv_caches, span_slots(model_input, span))
            # Each layer goes from the file into the paged cache through one reused staging
            # buffer. What it wrote before a failure (checksum, miss of a later request) is
            # overwritten: any failure recomputes the whole step. The load runs on the I/O
            # pool with a deadline; its writes pass a gate closed when it is given up on, so
            # a load the store answers late never writes into the cache of a later step.
            stalled = self._io.stalled()
            if stalled:
                return self._redo(model_input, f"key={key}: {StoreTimeout(self._io.timeout_ms, stalled)}")
            gate = WriteGate()
            try:
                entry = self._io.run(lambda: self.store.load_into(
                    identity, tokens, lambda i, kv: gate.write(write_layer, i, kv),
                    hidden_size=self.hidden_size, hidden_dtype=self.hidden_dtype))
            except StoreTimeout as e:
                gate.close()
                return self._redo(model_input, f"key={key}: {e}")
            except FileNotFoundError:
                return self._redo(model_input, f"miss key={key} tokens={len(tokens)}")
            except fmt.EntryCorrupt as e:
                self._remove_corrupt(e)
                return self._redo(model_input, f"corrupt key={key}: {e.reason}")
            except TokenMismatch as e:
                return self._redo(model_input, f"token mismatch key={key}: {e}")
            except auth.EntryUnauthenticated as e:  # another writer's entry: left where it is
                return self._redo(model_input, f"refused key={key}: {e.reason}")
            except Exception as e:  # whatever a damaged file does, recompute instead of crashing
                logger.exception("[rank%d]: unexpected error loading key=%s", self.rank, key)
                return self._redo(model_input, f"unreadable key={key}: {type(e).__name__}: {e}")
            loaded.append((span, entry))
            scatter_s += write_layer.seconds
        load_s = time.perf_counter() - start - scatter_s
        # The sampler reads only each prompt's last position (no prompt logprobs here).
        last = step.spans[-1].end
        hidden = loaded[0][1].hidden.new_zeros((last, loaded[0][1].hidden.shape[-1]), device=device)
        for span, entry in loaded:
            hidden[span.end - 1] = entry.hidden[-1]
        keys = ",".join(entry.key for _, entry in loaded)
        logger.info(log_lines.SKIP_FORWARD, self.rank, keys, last, sum(e.num_bytes for _, e in loaded),
                    (time.perf_counter() - start) * 1e3, load_s * 1e3, scatter_s * 1e3)
        return hidden, True, model_input

    def _remove_corrupt(self, error: fmt.EntryCorrupt) -> None:
        """Delete an entry that can never be served, so the producer publishes it again.

        (A producer that finds the name taken would otherwise keep reporting
        it as stored.) Only an entry by the store's rule is removed
        (FSStore.remove_corrupt). Best effort: a read-only mount just keeps
        recomputing.
        """
        try:
            if self.store.remove_corrupt(error):
                logger.warning("[rank%d]: removed corrupt entry %s", self.rank, error.path.name)
        except OSError:
            pass

    def _redo(self, model_input, reason: str):
        logger.info(log_lines.REDO_FORWARD, self.rank, reason)
        return None, False, model_input

    def close(self) -> None:
        self._io.shutdown()


def _wants_prompt_logprobs(model_input) -> bool:
    groups = getattr(model_input.sampling_metadata, "seq_groups", None) or []
    return any(g.sampling_params is not None and g.sampling_params.prompt_logprobs is not None
               for g in groups)


def _model_identity(model_config, model_id: str | None) -> tuple[str, str]:
    """served_model_identity, its failure as a start-up ConfigError naming vLLM's --model."""
    try:
        return served_model_identity(model_config, model_id)
    except ModelIdentityError as e:
        problems = [ConfigProblem("--model", e.message, e.fix)]
        raise ConfigError(problems) from e


def _refuse_unsupported(config: "VllmConfig") -> None:
    """Start-up errors for settings under which a prompt's KV can't be keyed whole."""
    problems = []
    if config.cache_config.enable_prefix_caching:
        problems.append(ConfigProblem(
            "--enable-prefix-caching", "prefix caching makes a prefill compute only part "
            "of its prompt, so FSConnector cannot store or load it whole",
            "start vLLM with --no-enable-prefix-caching"))
    if config.scheduler_config.chunked_prefill_enabled:
        problems.append(ConfigProblem(
            "--enable-chunked-prefill", "chunked prefill splits a prompt over several steps",
            "start vLLM with --no-enable-chunked-prefill (and a --max-num-batched-tokens "
            ">= --max-model-len)"))
    if config.parallel_config.pipeline_parallel_size > 1:
        problems.append(ConfigProblem(
            "--pipeline-parallel-size", "FSConnector supports tensor parallelism only",
            "use --pipeline-parallel-size 1"))
    if problems:
        raise ConfigError(problems)
