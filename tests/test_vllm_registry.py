"""connectors.registry and the attention backend lookup against the rig's real vLLM."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from connectors.v0.attn_backend import kv_cache_backend_name
from connectors.v0.kv_layout import BACKEND_LAYOUTS, CacheGeometry, PagedAttentionLayout, layout_for_backend
from connectors.registry import RegistryUnavailable, register_once, registered_connectors


def test_register_once_registers_a_name_once(monkeypatch):
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    assert "ProbeX" not in registered_connectors()
    assert register_once("ProbeX", "fault_connectors", "ProbeConnector") is True
    assert register_once("ProbeX", "fault_connectors", "ProbeConnector") is False
    assert registered_connectors().count("ProbeX") == 1


@pytest.mark.parametrize("value", ["missing", ["a", "list"]])
def test_a_vllm_without_the_registry_dict_gets_a_clear_error(monkeypatch, value):
    if value == "missing":
        monkeypatch.delattr(KVConnectorFactory, "_registry")
    else:
        monkeypatch.setattr(KVConnectorFactory, "_registry", value)
    with pytest.raises(RegistryUnavailable, match=r"KVConnectorFactory\._registry is (missing|list)"):
        registered_connectors()
    with pytest.raises(RegistryUnavailable, match="connectors.registry"):
        register_once("X", "m", "C")


def test_cpu_v0_caches_are_torch_sdpa_paged_attention(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V1", "0")
    config = SimpleNamespace(
        model_config=SimpleNamespace(get_head_size=lambda: 32, dtype=torch.float32,
                                     is_attention_free=False, use_mla=False),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16))
    name = kv_cache_backend_name(config)
    assert name == "TORCH_SDPA"
    assert layout_for_backend(name) is PagedAttentionLayout


# The backends whose classes import without their GPU kernels: each one's cache
# shape, from vLLM itself, must be the one its adapter expects.
IMPORTABLE_ON_CPU = {
    "TORCH_SDPA": "torch_sdpa.TorchSDPABackend",
    "IPEX": "ipex_attn.IpexAttnBackend",
    "ROCM_FLASH": "rocm_flash_attn.ROCmFlashAttentionBackend",
    "BLOCK_SPARSE_FLASH_ATTN": "blocksparse_attn.BlocksparseFlashAttentionBackend",
    "FLASHINFER": "flashinfer.FlashInferBackend",
    "TRITON_MLA": "triton_mla.TritonMLABackend",
    "FLASHMLA": "flashmla.FlashMLABackend",
    "ROCM_AITER_MLA": "rocm_aiter_mla.AiterMLABackend",
    "CPU_MLA": "cpu_mla.CPUMLABackend",
}


@pytest.mark.parametrize("name", sorted(IMPORTABLE_ON_CPU))
def test_adapter_expects_the_backends_own_cache_shape(name):
    module, cls_name = IMPORTABLE_ON_CPU[name].rsplit(".", 1)
    backend = getattr(importlib.import_module(f"vllm.attention.backends.{module}"), cls_name)
    assert backend.get_name() == name and name in BACKEND_LAYOUTS
    layout = BACKEND_LAYOUTS[name]
    g = CacheGeometry(block_size=16, kv_heads=1 if layout.kv_parts == 1 else 2, head_size=32)
    for blocks in (2, 7):
        assert tuple(backend.get_kv_cache_shape(blocks, g.block_size, g.kv_heads, g.head_size)) == \
            layout.cache_shape(blocks, g)
