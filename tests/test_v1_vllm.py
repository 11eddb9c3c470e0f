"""connectors.v1 against a real vLLM V1 (0.32) in this interpreter: plugin registration, the CPU kernel's layout.

Runs only in a V1 interpreter (the V1 rig's python); skipped in the V0 rig
and the light venv.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
factory = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")
if hasattr(factory.KVConnectorFactory, "create_connector_v0"):
    pytest.skip("vLLM with the V0 connector API: V1 tests need a V1-only vLLM", allow_module_level=True)

from connectors import plugin  # noqa: E402
from connectors.layout.base import CacheGeometry  # noqa: E402
from connectors.v1.kv_layout import PagedCPULayout, probe_page_positions  # noqa: E402

KVConnectorFactory = factory.KVConnectorFactory


def test_plugin_registers_the_v1_fs_connector_once(monkeypatch):
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    KVConnectorFactory._registry.pop("FSConnector", None)
    monkeypatch.setenv("KVCTL_EXTRA_CONNECTORS", "Mine=my_pkg.mod:Mine")  # V0-only: ignored on V1
    assert not plugin.has_v0_connector_api()
    plugin.register()
    plugin.register()  # vLLM loads plugins in several processes, sometimes twice in one
    from connectors.v1.fs_connector import FSConnector

    assert KVConnectorFactory.get_connector_class_by_name("FSConnector") is FSConnector
    assert "MultiConnectorV0" not in KVConnectorFactory._registry
    assert "Mine" not in KVConnectorFactory._registry


def test_module_path_finds_the_connector_without_the_plugin():
    from vllm.config.kv_transfer import KVTransferConfig

    from connectors.v1.fs_connector import FSConnector

    config = KVTransferConfig(kv_connector="FSConnector", kv_role="kv_consumer",
                              kv_connector_module_path="connectors.v1.fs_connector",
                              kv_connector_extra_config={"fs_storage_path": "/tmp/x"})
    assert KVConnectorFactory.get_connector_class(config) is FSConnector


def _kernel_writer(dtype: torch.dtype, block_size: int, head_size: int):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size, "auto")

    def write(key, value, cache, slots):
        blocks, heads, n, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, 2 * n, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    return write, isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [32, 128])
def test_cpu_kernel_pages_are_probed_and_read_back_exactly(dtype, block_size):
    """vLLM's own cache write, then our gather: the same token-major KV (the CPU layout from the BRIEF, verified)."""
    heads, head_size = 2, 32
    g = CacheGeometry(block_size=block_size, kv_heads=heads, head_size=head_size)
    write, isa = _kernel_writer(dtype, block_size, head_size)
    layout = PagedCPULayout(g, *probe_page_positions(write, g, dtype))
    if isa == "vec":  # fp32 everywhere, bf16 without AMX: K transposed [head_size, N], then V [N, head_size]
        vec = PagedCPULayout.vec(g)
        assert torch.equal(layout.key_pos, vec.key_pos) and torch.equal(layout.value_pos, vec.value_pos)
    cache = torch.zeros(4, heads, block_size, 2 * head_size, dtype=dtype)
    slots = torch.tensor([3 * block_size + 1, 0, block_size - 1, 2 * block_size + 17])
    kv = torch.randn(2, len(slots), heads, head_size).to(dtype)
    write(kv[0], kv[1], cache, slots)
    assert torch.equal(layout.gather(cache, slots), kv)
    ours = torch.zeros_like(cache)
    layout.scatter(ours, slots, kv)
    assert torch.equal(ours, cache)


def test_requests_whose_kv_is_not_their_token_ids_are_refused():
    from connectors.v1.fs_connector import _refusal

    plain = SimpleNamespace(prompt_token_ids=[1, 2], prompt_embeds=None, lora_request=None, mm_features=[],
                            sampling_params=SimpleNamespace(prompt_logprobs=None), skip_reading_prefix_cache=False)
    assert _refusal(plain, loading=True) == ""
    lora = SimpleNamespace(**{**vars(plain), "lora_request": SimpleNamespace(lora_name="sql")})
    assert "LoRA adapter 'sql'" in _refusal(lora, loading=False)
    mm = SimpleNamespace(**{**vars(plain), "mm_features": [object()]})
    assert "multimodal" in _refusal(mm, loading=True)
    logprobs = SimpleNamespace(**{**vars(plain), "sampling_params": SimpleNamespace(prompt_logprobs=1)})
    assert "prompt_logprobs" in _refusal(logprobs, loading=True) and _refusal(logprobs, loading=False) == ""
