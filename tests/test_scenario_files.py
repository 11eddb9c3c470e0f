"""Scenario files: the shipped ones parse and validate; bad ones are refused with paths."""

from __future__ import annotations

import copy
import json
import typing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from seed_configs import SEED_D, SEED_P

from kvctl.errors import BadInput
from kvctl.verify.checks import CHECKS
from kvctl.scenario.schema import (
    FIELD_PATHS,
    Scenario,
    check_scenario,
    list_scenarios,
    load_scenario,
    scenario_path,
    scenarios_dir,
)

SHIPPED = ("smoke-1p1d", "multi-1p1d", "seed-replica-gpu", "fs-1p1d-gpu")
SEED_PROMPT = "Hello, how are you?" * 67


def raw(name: str) -> dict:
    return yaml.safe_load((scenarios_dir() / f"{name}.yaml").read_text())


def errors(doc) -> list:
    return [p for p in check_scenario(doc) if p.severity == "error"]


def test_shipped_scenarios_are_listed():
    names = [p.stem for p in list_scenarios()]
    assert set(SHIPPED) <= set(names)
    assert (scenarios_dir() / "README.md").is_file()


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_scenario_is_valid(name):
    assert check_scenario(raw(name)) == []
    scenario = load_scenario(name)
    assert scenario.name == name  # file name and name agree
    assert scenario.prompts and scenario.expectations.checks
    assert load_scenario(str(scenarios_dir() / f"{name}.yaml")) == scenario  # by path too


def test_smoke_has_short_long_and_non_ascii_prompts():
    s = load_scenario("smoke-1p1d")
    texts = s.prompt_texts()
    assert SEED_PROMPT in texts
    assert any(not t.isascii() for t in texts)
    assert any(len(t) < 40 for t in texts)
    assert s.runtime == "local" and s.model == "tiny"
    assert s.prefill.kv_transfer_config["kv_connector"] == s.decode.kv_transfer_config["kv_connector"] == "FSConnector"
    decode = s.resolved_config("decode", "/tmp/st", "/tmp/d")
    assert decode["kv_connector_extra_config"] == {"fs_storage_path": "/tmp/st"}


def test_multi_has_transfer_and_offload_children():
    s = load_scenario("multi-1p1d")
    p = s.resolved_config("prefill", "/shared", "/cluster/prefill")
    assert p["kv_connector"] == "MultiConnectorV0" and p["kv_role"] == "kv_both"
    transfer, offload = p["kv_connector_extra_config"]["connectors"]
    assert transfer["kv_connector_extra_config"] == {"fs_storage_path": "/shared", "transfer": True}
    assert transfer["kv_role"] == "kv_producer"
    assert offload["kv_role"] == "kv_both"
    assert offload["kv_connector_extra_config"] == {"fs_storage_path": "/cluster/prefill/offload"}
    assert s.expected_sent_to() == ["FSConnector", "FSConnector"]


def test_seed_replica_is_the_seed():
    s = load_scenario("seed-replica-gpu")
    assert s.prefill.kv_transfer_config == SEED_P
    assert s.decode.kv_transfer_config == SEED_D
    assert s.runtime == "docker" and s.gpus == ["0", "1"]
    assert s.model.endswith("DeepSeek-V2-Lite-Chat") and s.served_model_name == "vllm_cpu_offload"
    for role in (s.prefill, s.decode):
        args = " ".join(role.args)
        for flag in ("--trust-remote-code", "--max-model-len=32768", "--max-seq-len-to-capture=10000",
                     "--max-num-seqs=64", "--gpu-memory-utilization=0.9", "--host=0.0.0.0", "-tp=1",
                     "--no-enable-prefix-caching", "--max-num-batched-tokens=64000"):
            assert flag in args
        assert role.env["VLLM_MLA_DISABLE"] == "1"
        assert role.env["LMCACHE_USE_EXPERIMENTAL"] == "True"
        assert role.env["LMCACHE_TRACK_USAGE"] == "false"
    assert s.prompt_texts()[0] == SEED_PROMPT
    assert s.max_tokens == 10
    assert s.expected_sent_to() == ["FSConnector", "LMCacheConnector"]


def test_gpu_fs_scenario():
    s = load_scenario("fs-1p1d-gpu")
    assert s.runtime == "docker" and s.gpus == ["0", "1"]
    assert s.prefill.kv_transfer_config["kv_connector"] == "FSConnector"
    assert s.expected_sent_to() == []
    assert set(s.expectations.checks) == set(CHECKS)


def _mutate(path: str, value, base: str = "smoke-1p1d") -> dict:
    doc = copy.deepcopy(raw(base))
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


DELETE = object()
P_CFG = "prefill.kv_transfer_config"
D_CFG = "decode.kv_transfer_config"

# (mutation path, new value, expected error paths in order)
BAD = {
    "unknown top key": ("prompt", ["x"], ["$.prompt"]),
    "bad runtime": ("runtime", "kubernetes", ["$.runtime"]),
    "bad name": ("name", "Smoke 1P1D", ["$.name"]),
    "no prompts": ("prompts", [], ["$.prompts"]),
    "repeat without times": ("prompts", [{"repeat": "x"}], ["$.prompts[0]"]),
    "prompt neither": ("prompts", [{"times": 3}], ["$.prompts[0]"]),
    "prompt a number": ("prompts", ["ok", 7], ["$.prompts[1]"]),
    "zero max_tokens": ("max_tokens", 0, ["$.max_tokens"]),
    "negative timeout": ("timeout", -1, ["$.timeout"]),
    "unknown check": ("expectations", {"checks": ["kv_sent"]}, ["$.expectations.checks[0]"]),
    "env not a string": ("prefill.env", {"LMCACHE_TRACK_USAGE": False}, ["$.prefill.env"]),
    "no decode config": ("decode.kv_transfer_config", DELETE, ["$.decode.kv_transfer_config"]),
    "bad P connector role": (f"{P_CFG}.kv_role", "kv_producr", ["$.prefill.kv_transfer_config.kv_role"]),
    "unknown P setting": (f"{P_CFG}.kv_connector_extra_config", {"fs_storage_path": "${store}", "ttl": 3},
                          ["$.prefill.kv_transfer_config.kv_connector_extra_config.ttl"]),
    "P only receives": (f"{P_CFG}.kv_role", "kv_consumer", ["$.prefill.kv_transfer_config.kv_role"]),
    "D only sends": (f"{D_CFG}.kv_role", "kv_producer", ["$.decode.kv_transfer_config.kv_role"]),
    "different stores": (f"{D_CFG}.kv_connector_extra_config", {"fs_storage_path": "/elsewhere"},
                         ["$.decode.kv_transfer_config"]),
    "D without FS": (D_CFG, {"kv_connector": "LMCacheConnector", "kv_role": "kv_consumer"},
                     ["$.decode.kv_transfer_config"]),
    "unknown placeholder": (f"{D_CFG}.kv_connector_extra_config", {"fs_storage_path": "${stor}"},
                            ["$.decode.kv_transfer_config",
                             "$.decode.kv_transfer_config.kv_connector_extra_config.fs_storage_path"]),
    "managed flag": ("prefill.args", ["--port=8000"], ["$.prefill.args[0]"]),
    "V1 env": ("decode.env", {"VLLM_USE_V1": "1"}, ["$.decode.env.VLLM_USE_V1"]),
    "sent_to not a child": ("expectations", {"sent_to_connectors": ["LMCacheConnector"]},
                            ["$.expectations.sent_to_connectors[0]"]),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_scenarios_are_refused_with_paths(case, tmp_path):
    path, value, expected = BAD[case]
    doc = _mutate(path, value)
    found = errors(doc)
    assert [p.path for p in found] == expected, found
    assert all(p.message and p.fix for p in found)
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text(yaml.safe_dump(doc))
    with pytest.raises(BadInput) as info:
        load_scenario(str(bad_file))
    assert expected[0] in info.value.details


def test_multi_child_errors_have_scenario_paths():
    doc = _mutate(f"{P_CFG}.kv_connector_extra_config.connectors.1.kv_connector", "MultiConnectorV0",
                  base="multi-1p1d")
    (problem,) = errors(doc)
    assert problem.path == "$.prefill.kv_transfer_config.kv_connector_extra_config.connectors[1].kv_connector"


def test_docker_hosts_and_shared_store():
    doc = raw("fs-1p1d-gpu")
    doc["decode"]["docker_host"] = "ssh://gpu-host-2"
    assert [p.path for p in errors(doc)] == ["$.store"]  # a fresh local dir cannot be shared
    doc["store"] = "/mnt/nfs/kv"
    problems = check_scenario(doc)
    assert [(p.path, p.severity) for p in problems] == [("$.store", "warning")]
    assert "NFS" in problems[0].message
    load_scenario_doc = Scenario.model_validate(doc)
    assert load_scenario_doc.decode.docker_host == "ssh://gpu-host-2"


def test_local_runtime_warns_about_docker_fields():
    doc = raw("smoke-1p1d")
    doc["gpus"] = ["0", "1"]
    doc["prefill"]["docker_host"] = "unix:///var/run/docker.sock"
    assert sorted((p.path, p.severity) for p in check_scenario(doc)) == [
        ("$.gpus", "warning"), ("$.prefill.docker_host", "warning")]


def test_docker_pool_gpus_one_list_per_instance():
    doc = raw("fs-1p1d-gpu")
    doc["prefill"] = 2
    doc["gpus"] = ["0", "1", "2"]  # prefill-0, prefill-1, decode-0
    assert errors(doc) == []
    doc["gpus"] = ["decode-0=2", "prefill-1=1", "prefill-0=0+3"]
    assert errors(doc) == []
    doc["gpus"] = ["0", "1"]
    (problem,) = errors(doc)
    assert problem.path == "$.gpus" and "3 instances" in problem.message, problem
    doc["gpus"] = ["prefill-0=0", "decode-7=1"]
    (problem,) = errors(doc)
    assert problem.path == "$.gpus" and "decode-7" in problem.message, problem


def test_unknown_name_lists_shipped_scenarios():
    with pytest.raises(BadInput) as info:
        load_scenario("smoke")
    assert "smoke-1p1d" in info.value.fix
    with pytest.raises(BadInput) as info:
        load_scenario("/nonexistent/x.yaml")
    assert "does not exist" in info.value.what


def test_yaml_syntax_error_names_line(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("name: x\nprompts: [a, b\nmax_tokens: 3\n")
    with pytest.raises(BadInput) as info:
        load_scenario(str(f))
    assert "not valid YAML" in info.value.what and str(f) in info.value.where


def test_scenario_module_does_not_import_vllm_or_torch():
    code = ("import sys, kvctl.scenario.schema; kvctl.scenario.schema.load_scenario('seed-replica-gpu'); "
            "print([m for m in ('torch', 'vllm') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent).stdout
    assert out.strip() == "[]"


def kvctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvctl.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=120)


def test_cli_validate_scenarios(tmp_path):
    for name in ("smoke-1p1d", str(scenarios_dir() / "seed-replica-gpu.yaml")):
        result = kvctl("validate", name, "--json")
        assert result.returncode == 0, result.stdout
        assert json.loads(result.stdout)["kind"] == "scenario"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_mutate(f"{D_CFG}.kv_role", "kv_producer")))
    result = kvctl("validate", str(bad))
    assert result.returncode == 2
    assert "$.decode.kv_transfer_config.kv_role" in result.stdout.replace("\n", " ")
    doc = json.loads(kvctl("validate", str(bad), "--json").stdout)
    assert [p["path"] for p in doc["problems"]] == ["$.decode.kv_transfer_config.kv_role"]
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [x\n")
    result = kvctl("validate", str(broken))
    assert result.returncode == 2 and "not valid YAML" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_field_paths_point_at_scenario_keys():
    """Every library field a scenario maps lands on a key the schema has (so a located error is findable)."""
    for field, path in FIELD_PATHS.items():
        model, parts = Scenario, path.removeprefix("$.").split(".")
        for i, part in enumerate(parts):
            assert part in model.model_fields, (field, path)
            if i < len(parts) - 1:
                model = model.model_fields[part].annotation
                # an optional block (`eval: EvalSpec | None`): the model inside it
                model = next((a for a in typing.get_args(model) if a is not type(None)), model)
    assert scenario_path("max_tokens") == "$.max_tokens"
    assert scenario_path("prefill_config") == "$.prefill.kv_transfer_config"
    assert scenario_path("prefill_port") is None  # scenarios pick ports themselves


# ---------------------------------------------------------------- xPyD pools: prefill: N, count: N


def test_pool_shorthand_and_count():
    doc = raw("smoke-1p1d")
    doc["prefill"] = 2  # N instances with the default config
    doc["decode"]["count"] = 3
    assert errors(doc) == []
    s = Scenario.model_validate(doc)
    assert s.prefill.count == 2 and s.decode.count == 3 and s.via == "endpoint"
    assert s.prefill.kv_transfer_config == {"kv_connector": "FSConnector", "kv_role": "kv_producer",
                                            "kv_connector_extra_config": {"fs_storage_path": "${store}"}}
    doc["decode"] = 1
    assert Scenario.model_validate(doc).decode.kv_transfer_config["kv_role"] == "kv_consumer"
    assert raw("smoke-1p1d")["prefill"].get("count") is None and load_scenario("smoke-1p1d").prefill.count == 1


@pytest.mark.parametrize("edit, path", [
    (lambda d: d.update(prefill=0), "$.prefill"),
    (lambda d: d.update(decode=65), "$.decode"),
    (lambda d: d.update(prefill=True), "$.prefill"),
    (lambda d: d["decode"].update(count=0), "$.decode.count"),
    (lambda d: d["decode"].update(count="two"), "$.decode.count"),
    (lambda d: d.update(decode={"count": 2}), "$.decode.kv_transfer_config"),
    (lambda d: d.update(via="router"), "$.via"),
], ids=["zero", "too-many", "bool", "count-zero", "count-text", "count-without-config", "bad-via"])
def test_bad_pool_sizes_are_refused_with_paths(edit, path):
    doc = raw("smoke-1p1d")
    edit(doc)
    found = errors(doc)
    assert [p.path for p in found] == [path], found
    assert all(p.fix for p in found)


def test_instance_dir_is_refused_in_a_pool():
    doc = raw("multi-1p1d")  # P's offload child writes under ${instance_dir}
    assert errors(doc) == []
    doc["prefill"]["count"] = 2
    (problem,) = errors(doc)
    assert problem.path.startswith("$.prefill.kv_transfer_config.kv_connector_extra_config.connectors[1]")
    assert "shared by the 2 instances" in problem.message


def test_pd_2p2d_is_two_prefill_two_decode_through_the_router():
    s = load_scenario("pd-2p2d")
    assert (s.prefill.count, s.decode.count, s.runtime, s.via) == (2, 2, "local", "endpoint")
    assert len(s.prompts) >= 4  # round robin reaches every instance of both pools
    assert scenario_path("prefill") == "$.prefill" and scenario_path("via_endpoint") == "$.via"
