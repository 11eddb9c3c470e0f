"""connectors.config.validate: what a vLLM server (and kvctl validate) accepts as --kv-transfer-config."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
from seed_configs import SEED_D, SEED_P

from connectors.config.topology import transfer_store
from connectors.config.validate import (
    ConfigError,
    ConfigProblem,
    FSConnectorSettings,
    check_kv_transfer_config,
    parse_fs_settings,
    validate_kv_transfer_config,
)

CHILDREN = "$.kv_connector_extra_config.connectors"


def fs(role: str = "kv_producer", **extra) -> dict:
    return {"kv_connector": "FSConnector", "kv_role": role,
            "kv_connector_extra_config": {"fs_storage_path": "/store", **extra}}


def multi(*children, role: str = "kv_both") -> dict:
    return {"kv_connector": "MultiConnectorV0", "kv_role": role,
            "kv_connector_extra_config": {"connectors": list(children)}}


def errors(cfg, registered=None) -> list[ConfigProblem]:
    return [p for p in check_kv_transfer_config(cfg, registered) if p.severity == "error"]


def test_seed_configs_are_valid():
    assert check_kv_transfer_config(SEED_P) == []
    assert check_kv_transfer_config(SEED_D) == []
    validate_kv_transfer_config(SEED_P)
    validate_kv_transfer_config(SEED_D)
    assert transfer_store(SEED_P, "send") == transfer_store(SEED_D, "recv") == "fs_local_storage"


# (config, [(path, substring of message)]) -- every error expected, nothing else.
INVALID = {
    "not an object": ([1, 2], [("$", "must be an object, got an array")]),
    "no connector": ({"kv_role": "kv_both"}, [("$.kv_connector", "required key 'kv_connector'")]),
    "connector not a string": ({"kv_connector": 3, "kv_role": "kv_both"}, [("$.kv_connector", "must be a string")]),
    "no role": ({"kv_connector": "LMCacheConnector"}, [("$.kv_role", "required key 'kv_role'")]),
    "bad role": ({"kv_connector": "LMCacheConnector", "kv_role": "kv_consumr"},
                 [("$.kv_role", "'kv_consumr' is not a role")]),
    "unknown connector": ({"kv_connector": "FSConector", "kv_role": "kv_both"},
                          [("$.kv_connector", "unknown connector 'FSConector'")]),
    "v1 connector": ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"},
                     [("$.kv_connector", "vLLM V1 connector")]),
    "unknown top-level key": ({**fs(), "kv_rol": "kv_both"}, [("$.kv_rol", "unknown key 'kv_rol'")]),
    "wrong type of known key": ({**fs(), "kv_port": "8000"}, [("$.kv_port", "must be an integer")]),
    "bool is not a number": ({**fs(), "kv_buffer_size": True}, [("$.kv_buffer_size", "must be a number")]),
    "fs without extra": ({"kv_connector": "FSConnector", "kv_role": "kv_producer"},
                         [("$.kv_connector_extra_config.fs_storage_path", "required key 'fs_storage_path'")]),
    "fs extra not an object": ({"kv_connector": "FSConnector", "kv_role": "kv_producer",
                                "kv_connector_extra_config": "/store"},
                               [("$.kv_connector_extra_config", "must be an object, got a string")]),
    "fs empty path": (fs(fs_storage_path=""), [("$.kv_connector_extra_config.fs_storage_path", "must not be empty")]),
    "fs unknown key": (fs(fs_storage_pth="/x"), [("$.kv_connector_extra_config.fs_storage_pth", "unknown key")]),
    "fs transfer as string": (fs(transfer="yes"),
                              [("$.kv_connector_extra_config.transfer", "must be a valid boolean")]),
    "fs max_bytes negative": (fs(max_bytes=-1), [("$.kv_connector_extra_config.max_bytes", "greater than 0")]),
    "fs max_bytes fractional": (fs(max_bytes=1.5), [("$.kv_connector_extra_config.max_bytes", "valid integer")]),
    "fs ttl zero": (fs(ttl_seconds=0), [("$.kv_connector_extra_config.ttl_seconds", "greater than 0")]),
    "multi without extra": ({"kv_connector": "MultiConnectorV0", "kv_role": "kv_both"},
                            [(CHILDREN, "needs a list of child connectors")]),
    "multi without connectors": ({"kv_connector": "MultiConnectorV0", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {}}, [(CHILDREN, "required key 'connectors'")]),
    "multi connectors not a list": ({"kv_connector": "MultiConnectorV0", "kv_role": "kv_both",
                                     "kv_connector_extra_config": {"connectors": {"a": 1}}},
                                    [(CHILDREN, "must be an array, got an object")]),
    "multi empty": (multi(), [(CHILDREN, "is empty")]),
    "multi unknown extra key": ({"kv_connector": "MultiConnectorV0", "kv_role": "kv_both",
                                 "kv_connector_extra_config": {"connector": [fs()]}},
                                [("$.kv_connector_extra_config.connector", "unknown key 'connector'"),
                                 (CHILDREN, "required key 'connectors'")]),
    "child not an object": (multi(fs(), "FSConnector"), [(f"{CHILDREN}[1]", "must be an object, got a string")]),
    "child without connector": (multi({"kv_role": "kv_both"}), [(f"{CHILDREN}[0].kv_connector", "required key")]),
    "child without role": (multi({"kv_connector": "LMCacheConnector"}), [(f"{CHILDREN}[0].kv_role", "required key")]),
    "nested multi": (multi(fs(), multi(fs())), [(f"{CHILDREN}[1].kv_connector", "cannot itself be MultiConnectorV0")]),
    "unknown child": (multi(fs(), {"kv_connector": "LMCache", "kv_role": "kv_both"}),
                      [(f"{CHILDREN}[1].kv_connector", "unknown connector 'LMCache'")]),
    "consumer child under producer": (multi(fs(), fs("kv_consumer"), role="kv_producer"),
                                      [(f"{CHILDREN}[1].kv_role", "never runs under a kv_producer parent")]),
    "producer child under consumer": (multi(fs("kv_producer"), role="kv_consumer"),
                                      [(f"{CHILDREN}[0].kv_role", "never runs under a kv_consumer parent")]),
    "bad child fs settings": (multi(fs(fsync="no")),
                              [(f"{CHILDREN}[0].kv_connector_extra_config.fsync", "must be a valid boolean")]),
    "child unknown key": (multi({**fs(), "kv_conector": "x"}), [(f"{CHILDREN}[0].kv_conector", "unknown key")]),
    "two transfer children": (multi(fs(transfer=True), fs(transfer=True, fs_storage_path="/b")),
                              [(f"{CHILDREN}[1].kv_connector_extra_config.transfer", "both marked transfer")]),
}


@pytest.mark.parametrize("case", INVALID, ids=list(INVALID))
def test_invalid_configs_name_path_and_fix(case):
    cfg, expected = INVALID[case]
    found = errors(cfg)
    assert [p.path for p in found] == [path for path, _ in expected], found
    for problem, (_, message) in zip(found, expected):
        assert message in problem.message, problem
        assert problem.fix, problem
    with pytest.raises(ConfigError) as info:
        validate_kv_transfer_config(cfg)
    assert info.value.problems == check_kv_transfer_config(cfg)


def test_fixes_suggest_names():
    (unknown,) = errors({"kv_connector": "FSConector", "kv_role": "kv_both"})
    assert "did you mean 'FSConnector'?" in unknown.fix
    assert "LMCacheConnector" in unknown.fix and "MooncakeStoreConnector" in unknown.fix
    (key,) = errors({**fs(), "kv_rol": "kv_both"})
    assert "'kv_role'" in key.fix
    (setting,) = errors(fs(fs_storage_pth="/x"))
    assert "'fs_storage_path'" in setting.fix
    (role,) = errors({"kv_connector": "LMCacheConnector", "kv_role": "kv_consumr"})
    assert "'kv_consumer'" in role.fix


def test_registered_names_come_from_the_caller():
    cfg = multi(fs(), {"kv_connector": "MyConnector", "kv_role": "kv_both"})
    assert errors(cfg)[0].path == f"{CHILDREN}[1].kv_connector"
    assert errors(cfg, registered=["FSConnector", "MultiConnectorV0", "MyConnector"]) == []
    # vLLM's factory registry also holds V1 names: they stay refused under V0 and unlisted.
    registry = ["FSConnector", "MultiConnectorV0", "SharedStorageConnector", "LMCacheConnector"]
    (v1,) = errors(multi({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}), registry)
    assert "V1" in v1.message and "SharedStorageConnector" not in v1.fix


def test_every_problem_is_reported_at_once():
    cfg = multi(fs("kv_consumer", fsync=1), {"kv_connector": "Nope", "kv_role": "kv_producer"}, role="kv_producer")
    paths = [p.path for p in errors(cfg)]
    assert paths == [f"{CHILDREN}[0].kv_role", f"{CHILDREN}[0].kv_connector_extra_config.fsync",
                     f"{CHILDREN}[1].kv_connector"]


def test_warnings_do_not_fail_validation():
    same_dir = multi(fs(transfer=True), fs("kv_both"))
    no_transfer = multi(fs(), {"kv_connector": "LMCacheConnector", "kv_role": "kv_both"})
    module_path = {**fs(), "kv_connector_module_path": "my.module"}
    for cfg, path in ((same_dir, f"{CHILDREN}[1].kv_connector_extra_config.fs_storage_path"),
                      (no_transfer, f"{CHILDREN}[0].kv_connector_extra_config.transfer"),
                      (module_path, "$.kv_connector_module_path")):
        problems = check_kv_transfer_config(cfg)
        assert [(p.path, p.severity) for p in problems] == [(path, "warning")]
        validate_kv_transfer_config(cfg)  # does not raise


def test_config_error_reads_one_problem_per_line():
    cfg = multi(fs(), {"kv_connector": "FSConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"fs_storage_path": "/x", "bogus": 1}}, role="kv_producer")
    with pytest.raises(ConfigError) as info:
        validate_kv_transfer_config(cfg)
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid kv-transfer-config: 2 problems"
    assert lines[1].strip().startswith(f"{CHILDREN}[1].kv_role: a kv_consumer child never runs")
    assert lines[2].strip().startswith(f"{CHILDREN}[1].kv_connector_extra_config.bogus: unknown key 'bogus'")
    assert all("(fix: " in line for line in lines[1:])


def test_parse_fs_settings():
    settings = parse_fs_settings({"fs_storage_path": "/s", "transfer": True, "max_bytes": 10, "ttl_seconds": 5})
    assert settings == FSConnectorSettings(fs_storage_path="/s", transfer=True, max_bytes=10, ttl_seconds=5.0)
    assert settings.fsync is True and settings.model_id is None
    with pytest.raises(ConfigError) as info:
        parse_fs_settings({"fs_storage_path": "/s", "fsync": "false"}, path_prefix="$.x")
    assert [p.path for p in info.value.problems] == ["$.x.fsync"]
    with pytest.raises(ConfigError):
        parse_fs_settings(None)


def test_imports_neither_torch_vllm_nor_kvctl():
    code = ("import sys, connectors.config.validate, connectors.config.topology; "
            "bad = [m for m in ('torch', 'vllm', 'kvctl') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_check_never_raises_on_garbage():
    for cfg in (None, "x", 3, {"kv_connector_extra_config": None}, {"kv_connector": "MultiConnectorV0",
                "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [None, [], {"kv_role": 1}]}}):
        assert all(isinstance(p, ConfigProblem) for p in check_kv_transfer_config(copy.deepcopy(cfg)))


# ---------------------------------------------------------------- kvctl validate

def kvctl(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvctl.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "COLUMNS": "200"}, timeout=120)


def test_cli_validate_seed_configs_all_forms(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(SEED_P))
    for arg in (json.dumps(SEED_P), json.dumps(SEED_D), f"@{tmp_path / 'p.json'}", str(tmp_path / "p.json")):
        result = kvctl("validate", arg)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "valid" in result.stdout
    relative = kvctl("validate", "@p.json", "--json", cwd=tmp_path)
    assert relative.returncode == 0
    assert json.loads(relative.stdout) == {"target": "p.json", "kind": "kv_transfer_config", "valid": True,
                                           "errors": 0, "warnings": 0, "problems": [], "engine": "v0"}


def test_cli_validate_lists_every_problem_and_exits_2():
    bad = multi(fs("kv_consumer"), {"kv_connector": "FSConector", "kv_role": "kv_both"}, role="kv_producer")
    result = kvctl("validate", json.dumps(bad))
    assert result.returncode == 2
    text = result.stdout.replace("\n", " ")
    assert "connectors[0].kv_role" in text and "connectors[1].kv_connector" in text
    assert "did you mean 'FSConnector'?" in text and "2 error(s)" in text
    doc = json.loads(kvctl("validate", json.dumps(bad), "--json").stdout)
    assert doc["valid"] is False and doc["errors"] == 2
    assert [p["path"] for p in doc["problems"]] == [f"{CHILDREN}[0].kv_role", f"{CHILDREN}[1].kv_connector"]
    assert all(p["fix"] and p["severity"] == "error" for p in doc["problems"])


def test_cli_validate_warnings_alone_exit_0():
    result = kvctl("validate", json.dumps(multi(fs(transfer=True), fs("kv_both"))), "--json")
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    assert doc["valid"] is True and doc["warnings"] == 1


@pytest.mark.parametrize("arg, words", [
    ("{kv_connector: FSConnector}", "not valid JSON"),
    ("@/nonexistent/cfg.json", "does not exist"),
    ("/nonexistent/cfg.json", "does not exist"),
    ("no-such-scenario", "unknown scenario"),
])
def test_cli_validate_unreadable_input(arg, words):
    result = kvctl("validate", arg)
    assert result.returncode == 2
    assert words in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    as_json = kvctl("validate", arg, "--json")
    assert as_json.returncode == 2 and json.loads(as_json.stdout)["exit_code"] == 2
