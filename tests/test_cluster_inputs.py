"""Launch inputs that must be refused before anything starts, and cluster state that is damaged.

- P and D whose transfer connectors name different stores would never meet:
  refused (exit 2) naming both paths; a cluster's `store` is where its
  transfer child really writes (checked with real servers and `kvctl verify`).
- `--store FILE` and `--model FILE` say what is wrong, before any install.
- One unreadable cluster.json does not hide the other clusters from `status`,
  and `down` removes it (stopping the vLLM servers still running in its dir).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import group_alive

from kvctl.cluster.spec import build_1p1d_spec
from kvctl.cluster.state import ClusterState, save_cluster, utc_now
from kvctl.errors import BadInput

LAUNCH_TIMEOUT_S = 600


def fs(role: str, path: str, **extra) -> dict:
    return {"kv_connector": "FSConnector", "kv_role": role,
            "kv_connector_extra_config": {"fs_storage_path": path, **extra}}


def multi(role: str, *children: dict) -> dict:
    return {"kv_connector": "MultiConnectorV0", "kv_role": role,
            "kv_connector_extra_config": {"connectors": list(children)}}


# ---------------------------------------------------------------- P and D must meet

def test_launch_refuses_prefill_and_decode_stores_that_never_meet(kvctl, kvctl_home, tmp_path, model_dir):
    a, b = tmp_path / "store-a", tmp_path / "store-b"
    r = kvctl("launch", "1p1d", "--name", "apart", "--model", str(model_dir), "--json",
              "--prefill-config", json.dumps(fs("kv_producer", str(a))),
              "--decode-config", json.dumps(fs("kv_consumer", str(b))))
    assert r.rc == 2, r
    err = json.loads(r.stdout)
    assert str(a) in err["error"] and str(b) in err["error"] and "never meet" in err["error"]
    assert err["where"] == "--prefill-config, --decode-config"
    assert "one shared directory" in err["fix"]
    assert not (kvctl_home / "clusters" / "apart").exists()  # nothing started, no state


def test_launch_refuses_a_store_the_configs_do_not_use(kvctl, kvctl_home, tmp_path, model_dir):
    r = kvctl("launch", "1p1d", "--name", "apart", "--model", str(model_dir), "--json",
              "--store", str(tmp_path / "given"),
              "--decode-config", json.dumps(fs("kv_consumer", str(tmp_path / "other"))))
    assert r.rc == 2, r
    err = json.loads(r.stdout)
    assert err["where"] == "--store, --decode-config" and str(tmp_path / "given") in err["error"]


def test_store_is_where_the_transfer_child_writes(tmp_path, model_dir, kvctl_home):
    """The offload child's directory is not the cluster's store; the transfer child's is."""
    transfer, offload = tmp_path / "transfer", tmp_path / "offload"
    prefill = multi("kv_producer", fs("kv_producer", str(offload)),
                    fs("kv_producer", str(transfer), transfer=True))
    spec = build_1p1d_spec(name="m", model=model_dir, prefill_config=prefill)
    assert spec.store == transfer.resolve()
    # D's default config reads from that same directory.
    assert spec.decode.kv_transfer_config["kv_connector_extra_config"]["fs_storage_path"] == str(transfer.resolve())


def test_one_side_naming_the_store_is_used_for_both(tmp_path, model_dir, kvctl_home):
    spec = build_1p1d_spec(name="d", model=model_dir,
                           decode_config=fs("kv_consumer", str(tmp_path / "shared")))
    assert spec.store == (tmp_path / "shared").resolve()
    assert spec.prefill.kv_transfer_config == fs("kv_producer", str((tmp_path / "shared").resolve()))


def test_relative_store_paths_resolve_against_the_servers_cwd(tmp_path, model_dir, kvctl_home):
    spec = build_1p1d_spec(name="rel", model=model_dir, prefill_config=fs("kv_producer", "kv"),
                           decode_config=fs("kv_consumer", "kv"))
    assert spec.store == kvctl_home / "clusters" / "rel" / "kv"


# ---------------------------------------------------------------- files where dirs belong

def test_store_that_is_a_file_is_refused_before_any_install(kvctl, kvctl_home, tmp_path, model_dir):
    store_file = tmp_path / "store.txt"
    store_file.write_text("not a dir")
    env_without_rig = {k: v for k, v in kvctl.env.items() if k != "KVCTL_RIG_PYTHON"}
    p = subprocess.run(kvctl.argv("launch", "1p1d", "--name", "f", "--model", str(model_dir),
                                  "--store", str(store_file)),
                       env=env_without_rig, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "is a file, not a directory" in p.stderr and "--store" in p.stderr
    assert "rig install" not in p.stderr  # refused before installing anything
    assert store_file.read_text() == "not a dir"


def test_model_that_is_a_file_says_so(kvctl, tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 16)
    r = kvctl("launch", "1p1d", "--name", "f", "--model", str(weights), "--json")
    assert r.rc == 2, r
    err = json.loads(r.stdout)
    assert err["where"] == "--model" and "is a file, not a model directory" in err["error"]
    assert "not found" not in err["error"]


# ---------------------------------------------------------------- damaged cluster state

def _good_state(home: Path, name: str) -> None:
    save_cluster(ClusterState(name, "local", "/m", "m", str(home / "clusters" / name / "store"), utc_now(), {}))


def test_status_lists_other_clusters_and_names_the_damaged_one(kvctl, kvctl_home):
    _good_state(kvctl_home, "fine")
    bad = kvctl_home / "clusters" / "broken" / "cluster.json"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"name": "broken", "runtime": ')  # cut short
    r = kvctl("status", "--json")
    assert r.rc == 0, r
    out = json.loads(r.stdout)
    assert [c["name"] for c in out["clusters"]] == ["fine"]
    assert [d["name"] for d in out["damaged"]] == ["broken"]
    assert out["damaged"][0]["path"] == str(bad)
    human = kvctl("status")
    assert human.rc == 0 and "broken" in human.stderr and "kvctl down --name broken" in human.stderr
    one = kvctl("status", "--name", "broken")
    assert one.rc == 2 and "kvctl down" in one.stderr  # the advice leads to a command that works


def test_down_removes_unreadable_state_and_stops_its_servers(kvctl, kvctl_home):
    cdir = kvctl_home / "clusters" / "broken"
    cdir.mkdir(parents=True)
    (cdir / "cluster.json").write_text("[1, 2")
    # A stand-in server: a process group led by a command line that names vLLM, running in the cluster dir.
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                               "vllm.entrypoints.openai.api_server"], cwd=cdir, start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"], cwd=cdir, start_new_session=True)  # not ours
    try:
        time.sleep(0.3)
        r = kvctl("down", "--name", "broken", "--json")
        assert r.rc == 0, r
        report = json.loads(r.stdout)
        assert report["damaged_state"] and report["removed"] == str(cdir)
        assert [s["role"] for s in report["stopped"]] == [f"process group {server.pid}"]
        assert server.wait(timeout=10) is not None and group_alive(server.pid) == []
        assert bystander.poll() is None  # only vLLM servers are stopped
        assert not cdir.exists()
        assert kvctl("status", "--json").rc == 0
    finally:
        for p in (server, bystander):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def test_library_error_names_both_fields(tmp_path, model_dir, kvctl_home):
    with pytest.raises(BadInput) as e:
        build_1p1d_spec(name="x", model=model_dir, prefill_config=fs("kv_producer", str(tmp_path / "a")),
                        decode_config=fs("kv_consumer", str(tmp_path / "b")))
    assert e.value.fields == ("prefill_config", "decode_config") and e.value.where is None


# ---------------------------------------------------------------- with real servers

@pytest.mark.e2e
@pytest.mark.xdist_group("vllm")
def test_multi_connector_cluster_store_is_the_transfer_childs(kvctl, kvctl_home, rig_python, tiny_model,
                                                             vllm_slot, tmp_path):
    """P: offload child first, transfer child second; D reads the transfer store. Verify looks there."""
    transfer, offload = tmp_path / "transfer", tmp_path / "offload"
    prefill = multi("kv_producer", fs("kv_producer", str(offload)),
                    fs("kv_producer", str(transfer), transfer=True))
    r = kvctl("launch", "1p1d", "--name", "mt", "--model", str(tiny_model), "--json",
              "--prefill-config", json.dumps(prefill),
              "--decode-config", json.dumps(fs("kv_consumer", str(transfer))), timeout=LAUNCH_TIMEOUT_S)
    assert r.rc == 0, r
    assert json.loads(r.stdout)["store"] == str(transfer)
    v = kvctl("verify", "--name", "mt", "--json", "--prompt", "Where does the KV go?", timeout=300)
    assert v.rc == 0, v
    report = json.loads(v.stdout)
    assert report["passed"] is True
    assert any(p.name.endswith(".safetensors") for p in transfer.iterdir())
    assert any(p.name.endswith(".safetensors") for p in offload.iterdir())
    assert kvctl("down", "--name", "mt").rc == 0
