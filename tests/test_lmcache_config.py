"""LMCache in kv-transfer-configs: LMCacheMPConnector's extra-config fields, and the in-process
LMCacheConnectorV1, which cannot serve on CPU (validate and launch warn with the reason and fix)."""

from __future__ import annotations

from pathlib import Path

from connectors.config.topology import LMCACHE_MP_CONNECTOR, named_connectors
from connectors.config.validate import check_kv_transfer_config
from kvctl.scenario.validation import validate_target


def _mp(extra: dict | None) -> dict:
    cfg = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}
    return cfg if extra is None else {**cfg, "kv_connector_extra_config": extra}


def _multi(*children: dict) -> dict:
    fs = {"kv_connector": "FSConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"fs_storage_path": "/tmp/store", "transfer": True}}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [fs, *children]}}


def _problems(cfg: dict, device: str | None = "cpu") -> dict[str, tuple[str, str]]:
    return {p.path: (p.severity, p.message + " | " + p.fix)
            for p in check_kv_transfer_config(cfg, engine="v1", device=device)}


def test_mp_connector_known_fields_pass():
    assert _problems(_mp(None)) == {}
    assert _problems(_multi(_mp({"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555,
                                 "lmcache.mp.mq_timeout": 30, "lmcache.mp.mp_transfer_mode": "auto",
                                 "lmcache.mp.save_decode_cache": False}))) == {}


def test_mp_connector_misspelt_key_wrong_type_and_bare_host_are_errors():
    found = _problems(_multi(_mp({"lmcache.mp.prot": 5555, "lmcache.mp.port": "5555",
                                  "lmcache.mp.host": "127.0.0.1", "lmcache.mp.mp_transfer_mode": "gpu"})))
    base = "$.kv_connector_extra_config.connectors[1].kv_connector_extra_config"
    assert found[f"{base}['lmcache.mp.prot']"][0] == "error"
    assert "did you mean 'lmcache.mp.port'" in found[f"{base}['lmcache.mp.prot']"][1]
    assert "LMCache ignores it" in found[f"{base}['lmcache.mp.prot']"][1]
    assert "must be an integer" in found[f"{base}['lmcache.mp.port']"][1]
    assert 'tcp://127.0.0.1' in found[f"{base}['lmcache.mp.host']"][1]
    assert "engine_driven" in found[f"{base}['lmcache.mp.mp_transfer_mode']"][1]
    assert all(severity == "error" for severity, _ in found.values())


def test_in_process_lmcache_connector_warns_on_cpu_not_on_gpu():
    cfg = _multi({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    path = "$.kv_connector_extra_config.connectors[1].kv_connector"
    severity, text = _problems(cfg, "cpu")[path]
    assert severity == "warning"
    assert "No supported cpu connector found" in text and "LMCacheMPConnector" in text
    assert path in _problems(cfg, None)  # unknown host: warned, with "if this server has no GPU"
    assert "if this server has no GPU" in _problems(cfg, None)[path][1]
    assert _problems(cfg, "gpu") == {}


def test_scenarios_warn_only_when_they_run_on_cpu(tmp_path: Path):
    gpu = validate_target("v1-multi-1p1d-gpu")  # LMCacheConnectorV1 on two GPUs
    assert gpu.problems == []
    text = Path(gpu.target).read_text().replace('gpus: ["0", "1"]', "gpus: null")
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text(text)
    found = validate_target(str(cpu))
    assert [p.severity for p in found.problems if "LMCacheConnectorV1" in p.message] == ["warning"]


def test_named_connectors_finds_top_level_and_children():
    assert named_connectors(_mp(None), LMCACHE_MP_CONNECTOR) == [(None, _mp(None))]
    multi = _multi(_mp({"lmcache.mp.port": 1}))
    assert [i for i, _ in named_connectors(multi, LMCACHE_MP_CONNECTOR)] == [1]
    assert named_connectors({"kv_connector": "FSConnector"}, LMCACHE_MP_CONNECTOR) == []
