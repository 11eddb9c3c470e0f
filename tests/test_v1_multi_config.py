"""vLLM V1's MultiConnector and third-party V1 connectors, without servers: the topology
(connectors.config.topology), `kvctl validate`'s V1 rules, which checks verify cannot observe
for a third-party transfer connector (kvctl.verify.checks.third_party_checks), the default
docker image per engine, and the V1 MultiConnector / block-size scenarios."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from connectors.config.topology import (
    children,
    fs_storage_paths,
    logged_send_children,
    multi_engine,
    receiving_children,
    sending_children,
    transfer_connector,
    transfer_store,
)
from connectors.config.validate import check_kv_transfer_config, required_engine
from kvctl.errors import BadInput
from kvctl.provision.images import default_image
from kvctl.runtime.docker_options import DockerOptions
from kvctl.runtime.docker import DockerRuntime
from kvctl.verify.checks import CHECKS, third_party_checks
from seed_configs import SEED_D, SEED_P
from kvctl.verify.verifier import expected_send_children


def fs(role: str, path: str = "/store", **extra) -> dict:
    return {"kv_connector": "FSConnector", "kv_role": role,
            "kv_connector_extra_config": {"fs_storage_path": path, **extra}}


def example(role: str = "kv_both", path: str = "/ex") -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": path}}


def v1_multi(*kids, role: str = "kv_both") -> dict:
    return {"kv_connector": "MultiConnector", "kv_role": role,
            "kv_connector_extra_config": {"connectors": list(kids)}}


P = v1_multi(fs("kv_producer", transfer=True), example())
D = v1_multi(fs("kv_consumer"), example("kv_both", "/ex-d"))


def test_v1_multi_topology_children_act_by_their_own_role():
    assert multi_engine(P) == "v1" and multi_engine({"kv_connector": "MultiConnectorV0"}) == "v0"
    assert multi_engine({"kv_connector": ["x"]}) is None
    assert [(c.connector, c.sends, c.receives) for c in children(P)] == [
        ("FSConnector", True, False), ("ExampleConnector", True, True)]
    # V1's parent role gates nothing: a consumer child under a producer parent still loads.
    cfg = v1_multi(fs("kv_consumer"), role="kv_producer")
    assert [c.index for c in receiving_children(cfg)] == [0] and sending_children(cfg) == []
    # ExampleConnector ignores its role: it saves and loads whatever kv_role says.
    assert [(c.sends, c.receives) for c in children(v1_multi(example("kv_consumer")))] == [(True, True)]


def test_v1_multi_transfer_store_and_paths():
    assert transfer_store(P, "send") == "/store" and transfer_store(D, "recv") == "/store"
    assert transfer_store(P, "recv") is None
    assert fs_storage_paths(P) == ["/store", "/ex"]  # ExampleConnector's dir is created/mounted too
    assert transfer_connector(P, "send") is None and transfer_connector(D, "recv") is None


def test_v1_logs_no_sent_to_connector_lines():
    assert [c.connector for c in sending_children(P)] == ["FSConnector", "ExampleConnector"]
    assert logged_send_children(P) == [] and expected_send_children(P) == []
    v0 = {"kv_connector": "MultiConnectorV0", "kv_role": "kv_both",
          "kv_connector_extra_config": {"connectors": [fs("kv_producer", transfer=True),
                                                       {"kv_connector": "LMCacheConnector", "kv_role": "kv_both"}]}}
    assert expected_send_children(v0) == [(0, "FSConnector"), (1, "LMCacheConnector")]


def test_third_party_transfer_connectors():
    ex_p, ex_d = example("kv_producer"), example("kv_consumer")
    assert transfer_connector(ex_p, "send") == "ExampleConnector"
    assert transfer_connector(ex_d, "recv") == "ExampleConnector"
    lm = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_consumer"}
    assert transfer_connector(lm, "recv") == "LMCacheConnectorV1" and transfer_connector(lm, "send") is None
    assert transfer_connector(v1_multi(example(), {"kv_connector": "NixlConnector", "kv_role": "kv_both"}),
                              "recv") == "ExampleConnector"  # V1 loads from the first with tokens
    assert transfer_connector(fs("kv_producer"), "send") is None and transfer_connector(None, "send") is None

    hidden = third_party_checks(ex_p, ex_d)
    assert sorted(hidden) == ["decode_skipped_forward", "kv_send_logged", "store_entry_written"]
    assert "output_matches_baseline" in CHECKS and "output_matches_baseline" not in hidden
    for name, result in hidden.items():
        assert result.status == "not_observable" and result.name == name
        assert "ExampleConnector" in result.evidence, result.evidence
    assert "vllm:external_prefix_cache_hits" in hidden["decode_skipped_forward"].evidence
    assert third_party_checks(fs("kv_producer"), fs("kv_consumer")) == {}
    assert third_party_checks(P, D) == {}
    assert list(third_party_checks(fs("kv_producer"), lm)) == ["decode_skipped_forward"]


def test_validate_v1_multi_connector():
    assert check_kv_transfer_config(P, engine="v1") == [] and check_kv_transfer_config(D, engine="v1") == []
    assert required_engine(P) == "v1"
    # The parent's role gates nothing on V1: no "never runs" error (it is one on V0).
    assert check_kv_transfer_config(v1_multi(fs("kv_consumer"), role="kv_producer"), engine="v1") == []
    # D loads from the first child with tokens: an ExampleConnector before the FS child is a warning.
    late = check_kv_transfer_config(v1_multi(example(), fs("kv_consumer")), engine="v1")
    assert [(p.path, p.severity) for p in late] == [("$.kv_connector_extra_config.connectors[1]", "warning")]
    assert "first child" in late[0].message
    mixed = check_kv_transfer_config(v1_multi(fs("kv_producer"), example(path="/store")), engine="v1")
    assert [p.path for p in mixed] == [
        "$.kv_connector_extra_config.connectors[1].kv_connector_extra_config.shared_storage_path"]
    two = check_kv_transfer_config(v1_multi(fs("kv_producer", "/a", transfer=True),
                                            fs("kv_producer", "/b", transfer=True)), engine="v1")
    assert [p.severity for p in two] == ["error"] and "both marked transfer" in two[0].message


def test_kvctl_validate_says_the_engine(kvctl, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(P))
    r = kvctl("validate", f"@{path}", "--json")
    assert r.rc == 0 and json.loads(r.stdout)["engine"] == "v1", r
    r = kvctl("validate", f"@{path}")
    assert r.rc == 0 and "needs engine v1" in r.stdout, r
    # The seed's MultiConnectorV0 needs V0; FSConnector alone runs on both.
    for cfg, engine, words in ((SEED_P, "v0", "needs engine v0"), (SEED_D, "any", "runs on engine v0 or v1")):
        r = kvctl("validate", json.dumps(cfg), "--json")
        assert r.rc == 0 and json.loads(r.stdout)["engine"] == engine, r
        r = kvctl("validate", json.dumps(cfg))
        assert r.rc == 0 and words in r.stdout, r


def test_default_docker_image_per_engine():
    """Each engine's CPU image without GPUs, its GPU image with them."""
    assert default_image("gpu", "v1") == "kvctl-gpu-v1:latest"
    assert re.fullmatch(r"kvctl-cpu-v1:[0-9a-f]{16}", default_image("cpu", "v1"))
    with pytest.raises(BadInput) as e:
        default_image("cpu", "v9")
    assert e.value.fields == ("engine",)
    v1 = DockerRuntime(engines={"prefill": "v1", "decode": "v1"})
    assert v1.image_ref("prefill") == v1.image_ref("decode") == default_image("cpu", "v1")
    mixed = DockerRuntime(engines={"prefill": "v0", "decode": "v1"})
    assert mixed.image_ref("decode") == default_image("cpu", "v1") and mixed.image_ref("prefill") == default_image("cpu")
    with_gpus = DockerRuntime(DockerOptions(gpus=("0", "1")), engines={"prefill": "v1", "decode": "v1"})
    assert with_gpus.image_ref("decode") == "kvctl-gpu-v1:latest"


def test_docker_runtime_for_a_v1_spec_picks_the_v1_cpu_image(kvctl_home, tiny_model):
    from kvctl.cluster.spec import build_1p1d_spec

    spec = build_1p1d_spec(name="v1d", runtime="docker", model=tiny_model, prefill_engine="v1",
                           decode_engine="v1")
    assert DockerRuntime.for_cluster(spec).image_ref("decode") == default_image("cpu", "v1")


@pytest.mark.parametrize("name", ["v1-multi-1p1d", "v1-multi-1p1d-gpu", "v1-block-size-mismatch",
                                  "v1-block-size-mismatch-example"])
def test_v1_scenarios_validate(name):
    from kvctl.scenario.schema import check_scenario, load_scenario, scenarios_dir

    assert check_scenario(yaml.safe_load((scenarios_dir() / f"{name}.yaml").read_text())) == []
    s = load_scenario(name)
    assert s.engine == "v1"
    p, d = s.role("prefill").kv_transfer_config, s.role("decode").kv_transfer_config
    if name.startswith("v1-block-size"):
        assert (s.role("prefill").args, s.role("decode").args) == (["--block-size=32"], ["--block-size=64"])
    if name == "v1-block-size-mismatch-example":
        assert s.expectations.checks == ["output_matches_baseline"]
        assert set(third_party_checks(p, d)) == {"kv_send_logged", "store_entry_written",
                                                 "decode_skipped_forward"}
    else:
        assert third_party_checks(p, d) == {} and s.expected_sent_to() == []


def test_nixl_carries_the_kv_and_an_fs_child_beside_it_is_an_offload(tmp_path):
    """v1-nixl-multi's shape: NIXL moves KV P->D, each side's FS child keeps a private copy; so
    no FS transfer store (P's and D's FS dirs need not meet) and NIXL is the transfer connector."""
    from kvctl.cluster.spec import shared_store

    nixl = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    p = v1_multi({**nixl, "kv_role": "kv_producer"}, fs("kv_producer", "/p/offload"))
    d = v1_multi({**nixl, "kv_role": "kv_consumer"}, fs("kv_both", "/d/offload"))
    assert transfer_store(p, "send") is None and transfer_store(d, "recv") is None
    assert transfer_connector(p, "send") == "NixlConnector" and transfer_connector(d, "recv") == "NixlConnector"
    assert shared_store({"prefill": p, "decode": d}, None, tmp_path) == tmp_path / "store"  # no clash
    # an FS child marked transfer still carries the KV, NIXL or not
    marked = v1_multi({**nixl, "kv_role": "kv_producer"}, fs("kv_producer", "/s", transfer=True))
    assert transfer_store(marked, "send") == "/s"
