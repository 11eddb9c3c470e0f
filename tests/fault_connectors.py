"""V0 connectors used only by tests, loaded into real vLLM servers via KVCTL_EXTRA_CONNECTORS.

ProbeConnector logs what it was handed (object ids and content sums), so two
probes around other children prove every child saw the same, unmutated
objects. RaisingConnector fails in every call, like a broken child.
"""

from __future__ import annotations

import logging

from vllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase

from connectors.v0.attn_backend import kv_cache_backend_name
from connectors.v0.batch import split_prefills
from connectors.v0.kv_layout import CacheGeometry, select_layout

log = logging.getLogger("vllm.kvctl.probe")


class ProbeConnector(KVConnectorBase):
    def __init__(self, rank, local_rank, config):
        self.name = (config.kv_transfer_config.kv_connector_extra_config or {}).get("probe", "probe")
        mc = config.model_config
        self.geometry = CacheGeometry(config.cache_config.block_size,
                                      mc.get_num_kv_heads(config.parallel_config), mc.get_head_size())
        self.attn_backend = kv_cache_backend_name(config)

    def send_kv_caches_and_hidden_states(self, model_executable, model_input, kv_caches,
                                         hidden_or_intermediate_states):
        spans = split_prefills(model_input).spans
        slots = model_input.attn_metadata.slot_mapping.flatten()[: spans[-1].end]
        layout = select_layout(kv_caches[0], self.geometry, self.attn_backend)
        kv_sum = sum(float(layout.gather(c, slots).double().sum()) for c in kv_caches)
        hidden = hidden_or_intermediate_states
        log.info("probe %s send: hidden_id=%d hidden_sum=%.6f kv_id=%d kv_sum=%.6f "
                 "input_id=%d tokens=%d slots=%d", self.name, id(hidden),
                 float(hidden.double().sum()), id(kv_caches), kv_sum, id(model_input),
                 spans[-1].end, slots.numel())

    def recv_kv_caches_and_hidden_states(self, model_executable, model_input, kv_caches):
        return None, False, model_input

    def close(self):
        pass


class RaisingConnector(KVConnectorBase):
    def __init__(self, rank, local_rank, config):
        pass

    def send_kv_caches_and_hidden_states(self, *args, **kwargs):
        raise RuntimeError("injected send failure")

    def recv_kv_caches_and_hidden_states(self, *args, **kwargs):
        raise RuntimeError("injected recv failure")

    def close(self):
        raise RuntimeError("injected close failure")

